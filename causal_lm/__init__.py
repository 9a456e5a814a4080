"""causal_lm: small decoder-only language models in JAX/Flax, with a position-based causal mask and a KV cache."""

from causal_lm.config import (
    Config,
    ConfigError,
    DataConfig,
    MeshConfig,
    ModelConfig,
    TrainConfig,
    apply_overrides,
    load_config,
)
from causal_lm.data import DataError, build_data
from causal_lm.decode import GenerateError, GenerateResult, generate
from causal_lm.interop.chat import ChatTemplateError, apply_chat_template
from causal_lm.interop.gguf import GGUFFormatError, load_gguf
from causal_lm.interop.hf import HFFormatError, load_hf, save_hf
from causal_lm.model import CacheError, Decoder, InputError, KVCache, build_model, init_cache
from causal_lm.model.functional import forward
from causal_lm.train import (
    CheckpointError,
    NonFiniteLossError,
    evaluate,
    load_for_inference,
    save_for_inference,
    train_and_evaluate,
)

__version__ = "0.1.0"

__all__ = [
    "Config",
    "ConfigError",
    "DataConfig",
    "MeshConfig",
    "ModelConfig",
    "TrainConfig",
    "apply_overrides",
    "load_config",
    "GenerateError",
    "GenerateResult",
    "generate",
    "CacheError",
    "Decoder",
    "InputError",
    "KVCache",
    "build_model",
    "init_cache",
    "forward",
    "HFFormatError",
    "load_hf",
    "save_hf",
    "GGUFFormatError",
    "load_gguf",
    "ChatTemplateError",
    "apply_chat_template",
    "DataError",
    "build_data",
    "CheckpointError",
    "NonFiniteLossError",
    "evaluate",
    "load_for_inference",
    "save_for_inference",
    "train_and_evaluate",
]
