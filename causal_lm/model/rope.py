"""Rotary position embeddings on a fraction of each head's dims (rotate-half convention).

Only Q and K are rotated, never V: the rotation makes q.k depend on the distance between positions, while V is
the content that is fetched and must not carry absolute position. With `rope_fraction < 1` the first
`rope_dim` dims of each head are rotated and the rest pass through unchanged (NoPE dims).

The rotate-half layout (pairs (i, i + rope_dim/2)) is the one Hugging Face Llama checkpoints use, so their
weights load without a permutation.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from causal_lm.config import ModelConfig


def rope_tables(positions, rope_dim: int, theta: float, *, inv_freq=None, attention_factor: float = 1.0):
    """cos and sin tables for integer positions [B, T] -> two float32 arrays [B, T, rope_dim].

    inv_freq: the rope_dim/2 inverse frequencies (default: plain RoPE, theta ** (-2i / rope_dim)); attention_factor
    multiplies both tables (YaRN's), as transformers does."""
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (jnp.arange(0, rope_dim, 2, dtype=jnp.float32) / rope_dim))  # [rope_dim/2]
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [B, T, rope_dim/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [B, T, rope_dim]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if attention_factor != 1.0:
        cos, sin = cos * jnp.float32(attention_factor), sin * jnp.float32(attention_factor)
    return cos, sin


# ---- scaled frequencies ---------------------------------------------------------------------------------------
# Each function mirrors transformers' modeling_rope_utils operation for operation in float32 (python scalars meet
# float32 arrays as weak scalars, as in torch), so the tables match its own to the last bit or nearly.


def _plain_inv_freq(dim: int, theta: float) -> np.ndarray:
    return (1.0 / (np.float32(theta) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim)))).astype(np.float32)


def _llama3_inv_freq(dim, theta, factor, low_freq_factor, high_freq_factor, old_context_len) -> np.ndarray:
    """Llama 3.1: wavelengths longer than old_context / low_freq_factor are stretched by `factor`, shorter than
    old_context / high_freq_factor kept, and the band between blended smoothly."""
    inv_freq = _plain_inv_freq(dim, theta)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = np.where(wavelen > np.float32(low_freq_wavelen), inv_freq / np.float32(factor), inv_freq)
    smooth = (old_context_len / wavelen - np.float32(low_freq_factor)) / np.float32(high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / np.float32(factor) + smooth * inv_freq_llama
    medium = ~(wavelen < np.float32(high_freq_wavelen)) & ~(wavelen > np.float32(low_freq_wavelen))
    return np.where(medium, smoothed, inv_freq_llama).astype(np.float32)


def _yarn_inv_freq(dim, theta, factor, original_max_len, beta_fast, beta_slow, truncate) -> np.ndarray:
    """YaRN: dims that turn fewer than beta_slow times over the original context are interpolated (divided by
    `factor`), those that turn more than beta_fast times kept, with a linear ramp between."""

    def correction_dim(rotations):
        return (dim * math.log(original_max_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    pos_freqs = np.float32(theta) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (np.float32(factor) * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    return (interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor).astype(np.float32)


def yarn_attention_factor(factor: float) -> float:
    """YaRN's default multiplier of cos and sin: 0.1 ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def inverse_frequencies(c: ModelConfig, kind: str = "rope") -> tuple[np.ndarray, float]:
    """(inverse frequencies [rope_dim/2] float32, cos/sin multiplier) of a layer kind of `c.layer_ropes`."""
    dim = c.rope_dim
    if kind == "local":
        return _plain_inv_freq(dim, c.rope_local_theta), 1.0
    r = c.rope_scaling
    if r.type == "linear":
        return (_plain_inv_freq(dim, c.rope_theta) / np.float32(r.factor)).astype(np.float32), 1.0
    if r.type == "llama3":
        inv = _llama3_inv_freq(dim, c.rope_theta, r.factor, r.low_freq_factor, r.high_freq_factor, r.original_max_len)
        return inv, 1.0
    if r.type == "yarn":
        inv = _yarn_inv_freq(dim, c.rope_theta, r.factor, r.original_max_len, r.beta_fast, r.beta_slow, r.truncate)
        a = r.attention_factor
        return inv, yarn_attention_factor(r.factor) if a is None else float(a)
    return _plain_inv_freq(dim, c.rope_theta), 1.0


def layer_rope_tables(c: ModelConfig, positions) -> tuple[tuple, tuple]:
    """(tables, table_of_layer) for one call: the distinct (cos, sin) [B, T, rope_dim] pairs of the layers'
    rotary embeddings (None for NoPE layers) and which one each layer uses (see AttentionContext.rope_for)."""
    kinds = tuple(dict.fromkeys(c.layer_ropes))  # distinct, in layer order
    tables = []
    for kind in kinds:
        if kind == "nope":
            tables.append(None)
        elif kind == "rope" and c.rope_scaling.type == "default":  # plain RoPE, computed as it always was
            tables.append(rope_tables(positions, c.rope_dim, c.rope_theta))
        else:
            inv, factor = inverse_frequencies(c, kind)
            tables.append(rope_tables(positions, c.rope_dim, c.rope_theta, inv_freq=inv, attention_factor=factor))
    return tuple(tables), tuple(kinds.index(k) for k in c.layer_ropes)


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
