from causal_lm.decode.generate import GenerateError, GenerateResult, bucket_length, compile_count, generate
from causal_lm.decode.sampling import sample

__all__ = ["GenerateError", "GenerateResult", "bucket_length", "compile_count", "generate", "sample"]
