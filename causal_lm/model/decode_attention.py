"""Decode attention's two products through C++ kernels (`csrc/decode_attention.cc`, built by `native.py`).

A decode step's attention is, per layer, a score product of a few queries with every cached key and a weighted sum
of every cached value. XLA:CPU runs them (`kernels.in_place_attention`) as small batched matmuls that read the
cache at a fifth of the memory bandwidth: on the 135M shape at context 512 they took 3.8 ms of a 14 ms int8 decode
step. The kernels read each key and value once, in its cache layout, for all the queries that use it; the scale,
mask, sink, softcap and softmax between them stay `kernels.masked_softmax` (one place for those rules).

Used by `kernels.attention` for a few queries over a cache (not a fresh gathered copy) in float32, when the
decoder is decoding (`matvec.native_products`, the flag the weight kernels use: a forward pass over a cache outside
the batch-invariant mode) on the CPU with the kernels built. Each output's sums run in one fixed order whatever
the batch or the threads (the .cc file says which), so a row's result does not depend on its batch. The calls
have a custom derivative through the XLA products, so a gradient traced through a decode step still works.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from causal_lm.model import matvec, native

NAME = "decode_attention"
TARGETS = (
    "causal_lm_decode_attention_scores",
    "causal_lm_decode_attention_values",
    "causal_lm_decode_attention",
    "causal_lm_decode_attention_paged",
)


def usable() -> bool:
    """Whether the kernels can be used in this process: CPU backend, built, not turned off."""
    return native.enabled() and native.on_cpu() and native.available(NAME, TARGETS)


def native_here(*dtypes) -> bool:
    """Whether decode attention with operands of these dtypes goes to the kernels now (see the module docstring)."""
    return matvec.native_on() and all(jnp.dtype(d) == jnp.float32 for d in dtypes) and usable()


def _call(target: str, shape: tuple, *args):
    native.library(NAME, TARGETS)
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(shape, jnp.float32), vmap_method="sequential")(*args)


@jax.custom_vjp
def scores(q, k):
    """q [B, T, K*G, H] . k [B, S, K, H] -> [B, K, G, T, S] float32 (unscaled, unmasked)."""
    B, T, N, _ = q.shape
    S, K = k.shape[1], k.shape[2]
    return _call("causal_lm_decode_attention_scores", (B, K, N // K, T, S), q, k)


def _scores_fwd(q, k):
    return scores(q, k), (q, k)


def _scores_bwd(res, g):
    q, k = res
    B, T, N, H = q.shape
    K = k.shape[2]
    dq = jnp.einsum("bkgts,bskh->btkgh", g, k).reshape(B, T, N, H)
    dk = jnp.einsum("bkgts,btkgh->bskh", g, q.reshape(B, T, K, N // K, H))
    return dq, dk


scores.defvjp(_scores_fwd, _scores_bwd)


@jax.custom_vjp
def values(w, v):
    """w [B, K, G, T, S] . v [B, S, K, Hv] -> [B, T, K*G, Hv] float32."""
    B, K, G, T, _ = w.shape
    return _call("causal_lm_decode_attention_values", (B, T, K * G, v.shape[-1]), w, v)


def _values_fwd(w, v):
    return values(w, v), (w, v)


def _values_bwd(res, g):
    w, v = res
    B, K, G, T, _ = w.shape
    gg = g.reshape(B, T, K, G, -1)
    return jnp.einsum("btkgh,bskh->bkgts", gg, v), jnp.einsum("bkgts,btkgh->bskh", w, gg)


values.defvjp(_values_fwd, _values_bwd)


# ---- the whole attention of a layer over a contiguous cache, read in place -----------------------------------


def attend(q, k, v, layer, visible, *, scale: float, sink=None, softcap=None):
    """Attention of q [B, T, N, H] over layer `layer` of a contiguous cache's stacked buffers k [L, B, C, K, H] and
    v [L, B, C, K, Hv] (float32), under the mask visible [B, T, C]: out [B, T, N, Hv] float32, the function of
    `kernels.masked_softmax` between the grouped products, in one C++ call (`causal_lm_decode_attention`) that reads
    the layer where it lies and skips the slots no query sees. sink: optional [N] logits; softcap: optional float.
    No derivative of its own: `kernels.layer_attention_in_place` gives it one through the XLA form."""
    native.library(NAME, TARGETS)
    B, T, N, _ = q.shape
    has_sink = sink is not None
    sink = jnp.zeros((N,), jnp.float32) if sink is None else sink
    call = jax.ffi.ffi_call(
        "causal_lm_decode_attention",
        jax.ShapeDtypeStruct((B, T, N, v.shape[-1]), jnp.float32),
        vmap_method="sequential",
    )
    return call(
        q,
        k,
        v,
        jnp.asarray(layer, jnp.int32),
        visible,
        sink.astype(jnp.float32),
        scale=np.float32(scale),
        softcap=np.float32(softcap or 0.0),
        has_sink=np.int32(has_sink),
    )
