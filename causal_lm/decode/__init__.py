from causal_lm.decode.generate import GenerateError, GenerateResult, bucket_length, generate
from causal_lm.decode.sampling import sample

__all__ = ["GenerateError", "GenerateResult", "bucket_length", "generate", "sample"]
