"""The model: config -> Decoder (attention layers over one position mask), the KV cache, and the kernels.

Module map (where to add what):
    mask.py          make_mask (the one invariant) and AttentionMask (the dense mask + the facts kernels may use)
    kernels.py       the reference attention kernel and each faster path, and the dispatcher choosing one;
                     a new kernel (a fused backend) goes here, with a test against reference_attention
    attention.py     the MHA / GQA / MQA layer: projections, RoPE, cache update, kernel, output gate;
                     a new attention variant is a layer beside it (as mla.py) with the same call signature
    mla.py           multi-head latent attention (DeepSeek-V2), through the same kernels
    kv_cache.py      the cache as data with slot positions: groups of layers by layout, plan / update / commit,
                     rollback, quantized storage; a new cache layout changes this file only
    context.py       AttentionContext, what every layer of one call receives (its RoPE tables and mask by layer)
    layers.py        projections, RMSNorm (w or 1 + w), the gated MLP (SwiGLU / GeGLU), parameter init
    rope.py          rotary embeddings: scaled inverse frequencies (linear / llama3 / yarn) and per-layer tables
                     (a local theta, NoPE layers)
    transformer.py   Block, Decoder (embed -> scanned blocks -> logits), ModelOutput
    functional.py    jitted pure entry point over a split model
    weights.py       check_weights: NaN / infinite (or absurdly large) parameters refused before compute
    native.py        C++ CPU kernels (csrc/*.cc) through XLA's FFI, compiled on first use; XLA forms elsewhere
"""

from causal_lm.model.kernels import attention, attention_weights, reference_attention
from causal_lm.model.kv_cache import CacheError, KVCache, init_cache
from causal_lm.model.mask import AttentionMask, make_mask
from causal_lm.model.transformer import Decoder, InputError, ModelOutput, build_model
from causal_lm.model.weights import WeightError, check_weights

__all__ = [
    "attention",
    "attention_weights",
    "reference_attention",
    "AttentionMask",
    "make_mask",
    "CacheError",
    "KVCache",
    "init_cache",
    "Decoder",
    "InputError",
    "ModelOutput",
    "build_model",
    "WeightError",
    "check_weights",
]
