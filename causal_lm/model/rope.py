"""Rotary position embeddings on a fraction of each head's dims (rotate-half convention).

Only Q and K are rotated, never V: the rotation makes q.k depend on the distance between positions, while V is
the content that is fetched and must not carry absolute position. With `rope_fraction < 1` the first
`rope_dim` dims of each head are rotated and the rest pass through unchanged (NoPE dims).

The rotate-half layout (pairs (i, i + rope_dim/2)) is the one Hugging Face Llama checkpoints use, so their
weights load without a permutation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_tables(positions, rope_dim: int, theta: float):
    """cos and sin tables for integer positions [B, T] -> two float32 arrays [B, T, rope_dim]."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rope_dim, 2, dtype=jnp.float32) / rope_dim))  # [rope_dim/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, rope_dim/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [B, T, rope_dim]
    return jnp.cos(angles), jnp.sin(angles)


def _rotate_half(y):
    """(y1, y2) -> (-y2, y1) over the last axis, split in halves."""
    half = y.shape[-1] // 2
    return jnp.concatenate([-y[..., half:], y[..., :half]], axis=-1)


def _rope_forward(x, cos, sin):
    rope_dim = cos.shape[-1]
    rot = x[..., :rope_dim].astype(jnp.float32)
    out = (rot * cos[:, :, None, :] + _rotate_half(rot) * sin[:, :, None, :]).astype(x.dtype)  # broadcast over heads
    if rope_dim == x.shape[-1]:
        return out
    return jnp.concatenate([out, x[..., rope_dim:]], axis=-1)


@jax.custom_vjp
def apply_rope(x, cos, sin):
    """Rotate the first cos.shape[-1] dims of x [B, T, heads, H] by the angles of cos, sin [B, T, rope_dim]; the
    rest pass through.

    The derivative is written out (a rotation's transpose is the rotation by minus the angle): differentiated op
    by op, the slices and the concatenation of the rotate-half turn into pads and adds over the whole [B, T, heads,
    H] gradient, 4.5% of the training step's kernel time at the benchmark shape, ten times the forward rotation.
    Being a custom VJP, it supports reverse-mode differentiation (grad, vjp) but not forward mode (jvp, jacfwd).
    """
    return _rope_forward(x, cos, sin)


def _sum_to(y, shape):
    """Sum y over the axes where `shape` (same rank) has size 1."""
    axes = tuple(i for i, (a, b) in enumerate(zip(y.shape, shape, strict=True)) if b == 1 and a != 1)
    return jnp.sum(y, axis=axes, keepdims=True) if axes else y


def _rope_fwd(x, cos, sin):
    return _rope_forward(x, cos, sin), (x, cos, sin)


def _rope_bwd(res, g):
    x, cos, sin = res
    rope_dim = cos.shape[-1]
    g_rot = g[..., :rope_dim].astype(jnp.float32)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    # out = r*c + R(r)*s with R(y) = (-y2, y1), whose transpose is -R: dr = g*c - R(g*s).
    dx = (g_rot * c - _rotate_half(g_rot * s)).astype(x.dtype)
    if rope_dim < x.shape[-1]:
        dx = jnp.concatenate([dx, g[..., rope_dim:].astype(x.dtype)], axis=-1)
    # Cotangents of the tables, for completeness (they come from integer positions, so XLA drops them unused).
    rot = x[..., :rope_dim].astype(jnp.float32)
    dcos = _sum_to(jnp.sum(g_rot * rot, axis=2), cos.shape).astype(cos.dtype)
    dsin = _sum_to(jnp.sum(g_rot * _rotate_half(rot), axis=2), sin.shape).astype(sin.dtype)
    return dx, dcos, dsin


apply_rope.defvjp(_rope_fwd, _rope_bwd)
