"""causal_lm: small decoder-only language models in JAX/Flax, with a position-based causal mask and a KV cache.

The names below are loaded on first use (PEP 562), so `import causal_lm` (and the command line's start-up) does not
import JAX, the training stack and the interop readers until something needs them.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "causal_lm.config": (
        "Config",
        "ConfigError",
        "DataConfig",
        "MLAConfig",
        "MeshConfig",
        "ModelConfig",
        "RopeScaling",
        "TrainConfig",
        "apply_overrides",
        "load_config",
    ),
    "causal_lm.data": ("DataError", "build_data"),
    "causal_lm.decode": ("GenerateError", "GenerateResult", "generate"),
    "causal_lm.interop.chat": ("ChatTemplateError", "apply_chat_template"),
    "causal_lm.interop.gguf": ("GGUFFormatError", "load_gguf"),
    "causal_lm.interop.hf": ("HFFormatError", "load_hf", "save_hf"),
    "causal_lm.model": (
        "CacheError",
        "Decoder",
        "InputError",
        "KVCache",
        "WeightError",
        "build_model",
        "init_cache",
    ),
    "causal_lm.model.functional": ("forward",),
    "causal_lm.model.quant": ("QuantizeError", "quantize"),
    "causal_lm.serve": ("Engine", "EngineError"),
    "causal_lm.train": (
        "CheckpointError",
        "NonFiniteLossError",
        "evaluate",
        "load_for_inference",
        "save_for_inference",
        "train_and_evaluate",
    ),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'causal_lm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
