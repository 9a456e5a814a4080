from causal_lm.model.attention import attend, attention_weights, make_mask
from causal_lm.model.kv_cache import CacheError, KVCache, init_cache
from causal_lm.model.transformer import Decoder, InputError, build_model

__all__ = [
    "attend",
    "attention_weights",
    "make_mask",
    "CacheError",
    "KVCache",
    "init_cache",
    "Decoder",
    "InputError",
    "build_model",
]
