"""Next-token sampling: greedy, temperature, top-k and top-p, all from an explicit PRNG key.

The same functions serve the cached, the recompute and the speculative loops, so they differ only in what they
compute, never in how a token is chosen. `filtered_logits` is the distribution every sampler draws from (the
speculative acceptance test compares exactly these distributions for the target and the draft).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def filtered_logits(logits, temperature, top_k, top_p):
    """logits [..., V] -> the logits sampling draws from: divided by the temperature, -inf outside top-k and top-p.

    top_k <= 0 disables top-k; top_p >= 1 disables top-p. Top-k keeps ties with the k-th largest value; top-p keeps
    the smallest set of most likely tokens whose probability reaches top_p, including the token that crosses the
    threshold. All three are traced scalars, so changing them does not recompile.
    """
    logits = logits.astype(jnp.float32)
    V = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)
    desc = -jnp.sort(-scaled, axis=-1)  # [..., V], largest first
    k = jnp.clip(top_k, 1, V)
    kth = jnp.take_along_axis(desc, jnp.broadcast_to(k - 1, desc.shape[:-1])[..., None], axis=-1)
    scaled = jnp.where((top_k > 0) & (scaled < kth), -jnp.inf, scaled)
    desc = jnp.where((top_k > 0) & (desc < kth), -jnp.inf, desc)
    # top-p: keep a sorted token if the mass strictly before it is below top_p (so the crossing token stays).
    probs = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep = (before < top_p) | (jnp.arange(V) == 0)
    cutoff = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where((top_p < 1.0) & (scaled < cutoff), -jnp.inf, scaled)


def probabilities(logits, temperature, top_k, top_p):
    """The distribution `sample` draws from, as probabilities [..., V]: one-hot on the argmax when greedy."""
    greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jnp.where(temperature > 0, jax.nn.softmax(filtered_logits(logits, temperature, top_k, top_p), -1), greedy)


def sample(logits, key, temperature, top_k, top_p):
    """logits [B, V] float32 -> token ids [B] int32. temperature == 0 is greedy (argmax)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled = jax.random.categorical(key, filtered_logits(logits, temperature, top_k, top_p), axis=-1)
    return jnp.where(temperature > 0, sampled.astype(jnp.int32), greedy)
