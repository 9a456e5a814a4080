"""Rotary position embeddings on a fraction of each head's dims (rotate-half convention).

Only Q and K are rotated, never V: the rotation makes q.k depend on the distance between positions, while V is
the content that is fetched and must not carry absolute position. With `rope_fraction < 1` the first
`rope_dim` dims of each head are rotated and the rest pass through unchanged (NoPE dims).

The rotate-half layout (pairs (i, i + rope_dim/2)) is the one Hugging Face Llama checkpoints use, so their
weights load without a permutation.
"""

from __future__ import annotations

import jax.numpy as jnp


def rope_tables(positions, rope_dim: int, theta: float):
    """cos and sin tables for integer positions [B, T] -> two float32 arrays [B, T, rope_dim]."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rope_dim, 2, dtype=jnp.float32) / rope_dim))  # [rope_dim/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, rope_dim/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [B, T, rope_dim]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, cos, sin):
    """Rotate the first cos.shape[-1] dims of x [B, T, heads, H]; the rest pass through."""
    rope_dim = cos.shape[-1]
    dtype = x.dtype
    rot, rest = x[..., :rope_dim].astype(jnp.float32), x[..., rope_dim:]
    half = rope_dim // 2
    rotated_half = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # broadcast over heads
    out = (rot * cos + rotated_half * sin).astype(dtype)
    if rest.shape[-1] == 0:
        return out
    return jnp.concatenate([out, rest], axis=-1)
