"""Next-token sampling: greedy, temperature, top-k and top-p, all from an explicit PRNG key.

The same function serves the cached and the recompute loops, so the two differ only in what they recompute.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample(logits, key, temperature, top_k, top_p):
    """logits [B, V] float32 -> token ids [B] int32.

    temperature == 0 is greedy (argmax). top_k <= 0 disables top-k; top_p >= 1 disables top-p. Top-p keeps the
    smallest set of most likely tokens whose probability reaches top_p, including the token that crosses the
    threshold. All three are traced scalars, so changing them does not recompile.
    """
    logits = logits.astype(jnp.float32)
    V = logits.shape[-1]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    desc = -jnp.sort(-scaled, axis=-1)  # [B, V], largest first
    # top-k: drop everything below the k-th largest value (ties with it are kept).
    k = jnp.clip(top_k, 1, V)
    kth = jnp.take_along_axis(desc, jnp.broadcast_to(k - 1, desc.shape[:-1])[..., None], axis=-1)
    scaled = jnp.where((top_k > 0) & (scaled < kth), -jnp.inf, scaled)
    desc = jnp.where((top_k > 0) & (desc < kth), -jnp.inf, desc)
    # top-p: keep a sorted token if the mass strictly before it is below top_p (so the crossing token stays).
    probs = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep = (before < top_p) | (jnp.arange(V) == 0)
    cutoff = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
    scaled = jnp.where((top_p < 1.0) & (scaled < cutoff), -jnp.inf, scaled)
    sampled = jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)
