"""The attention core: one mask built from positions, a float32 softmax, and the MHA/GQA/MQA layer.

Shape letters, used in every `# [...]` comment of the package:
    B batch, T query length, S key length, N query heads, K kv heads, G query heads per kv head (N = K*G),
    H head dim, D model dim, F mlp dim, V vocab, L layers.

The one invariant (see DESIGN.md): for query i and key j of the same row,

    visible[b, i, j] = key_valid[b, j] & (key_pos[b, j] <= query_pos[b, i]) & same_segment[b, i, j]
                       (& query_pos[b, i] - key_pos[b, j] < window, for a sliding-window layer)

Training (positions 0..T-1), one-shot and chunked prefill (a chunk at offset o sees keys 0..o+i: the
`tril(diagonal=o)` case falls out of the positions), single-token decode, ragged batches and packed documents
all use this one function; there is no separate mask per mode.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from causal_lm.config import ModelConfig
from causal_lm.model.kv_cache import write_rows
from causal_lm.model.rope import apply_rope

# Finite large negative for masked float32 scores: -inf would turn a row with no visible key into NaN.
MASK_VALUE = -1e30


def make_mask(query_pos, key_pos, key_valid, query_segment=None, key_segment=None, *, causal: bool = True,
              window=None):
    """Boolean visibility [B, T, S] from positions [B, T] / [B, S], key validity [B, S] and optional segments.

    window: a sliding window (int, or a traced int32 scalar when layers differ); a query at position p then sees
    keys at p - window + 1 .. p. None or 0 means no window (a global layer).
    """
    visible = key_valid[:, None, :]  # [B, 1, S]
    if causal:
        visible = visible & (key_pos[:, None, :] <= query_pos[:, :, None])  # [B, T, S]
    if window is not None and not (isinstance(window, int) and window == 0):
        within = (query_pos[:, :, None] - key_pos[:, None, :]) < window  # [B, T, S]
        visible = visible & (within | (window <= 0))
    if query_segment is not None and key_segment is not None:
        visible = visible & (key_segment[:, None, :] == query_segment[:, :, None])
    return jnp.broadcast_to(visible, (query_pos.shape[0], query_pos.shape[1], key_pos.shape[1]))


def attention_weights(q, k, visible, *, sink=None, zero_after=None):
    """Softmax attention weights in float32.

    q: [B, T, N, H]; k: [B, S, K, H]; visible: [B, T, S] (which keys each query's softmax normalises over);
    sink: optional [N] logits that join the denominator only; zero_after: optional [B, T, S] applied after the
    softmax (the "zero after softmax" research variant). Returns weights [B, K, G, T, S].
    A row with no visible key gets all-zero weights, never NaN.
    """
    return masked_softmax(attention_scores(q, k), visible, sink=sink, zero_after=zero_after)


def attention_scores(q, k):
    """Scaled dot-product scores S = q.k / sqrt(H) in float32, before any mask: [B, K, G, T, S]."""
    B, T, N, H = q.shape
    K = k.shape[2]
    G = N // K
    q = q.reshape(B, T, K, G, H)
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32)  # [B, K, G, T, S]
    return scores * (1.0 / jnp.sqrt(jnp.float32(H)))


def masked_softmax(scores, visible, *, sink=None, zero_after=None):
    """Float32 softmax of scaled scores [B, K, G, T, S] over the visible keys (visible: [B, T, S]).

    sink: optional [K*G] logits that join the denominator only. Shared by every attention form (MHA/GQA/MQA and
    both MLA paths), so the mask value, the sink and the empty-row rule live in one place.
    """
    scores = scores.astype(jnp.float32)
    _, K, G, _, _ = scores.shape
    vis = visible[:, None, None, :, :]  # [B, 1, 1, T, S]
    scores = jnp.where(vis, scores, MASK_VALUE)
    row_max = jnp.max(scores, axis=-1, keepdims=True)  # [B, K, G, T, 1]
    if sink is not None:
        sink = sink.astype(jnp.float32).reshape(1, K, G, 1, 1)
        row_max = jnp.maximum(row_max, sink)
    e = jnp.exp(scores - row_max) * vis  # exactly 0 where not visible
    denom = jnp.sum(e, axis=-1, keepdims=True)
    if sink is not None:
        denom = denom + jnp.exp(sink - row_max)
    weights = e / jnp.maximum(denom, jnp.finfo(jnp.float32).tiny)
    if zero_after is not None:
        weights = weights * zero_after[:, None, None, :, :]
    return weights


def attend(q, k, v, visible, *, sink=None, zero_after=None, impl: str = "xla", return_weights: bool = False):
    """Attention output [B, T, N, H] (and optionally weights [B, N, T, S]).

    GQA/MQA: the G query heads of a group attend to their shared K/V head through the einsum's k axis; K and V
    are never repeated to N heads.
    """
    B, T, N, H = q.shape
    if impl == "dot_product_attention" and not return_weights:
        assert sink is None and zero_after is None
        out = jax.nn.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), mask=visible[:, None, :, :])
        # A row with no visible key: defined as zeros (the library returns an average of V there).
        any_visible = jnp.any(visible, axis=-1)  # [B, T]
        return out * any_visible[:, :, None, None].astype(out.dtype), None
    weights = attention_weights(q, k, visible, sink=sink, zero_after=zero_after)  # [B, K, G, T, S]
    K = k.shape[2]
    out = jnp.einsum("bkgts,bskh->btkgh", weights.astype(v.dtype), v)  # [B, T, K, G, H]
    out = out.reshape(B, T, N, H)
    if return_weights:
        return out, weights.reshape(B, N, T, -1)
    return out, None


def _normal(rngs: nnx.Rngs, shape, std, dtype):
    return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32).astype(dtype) * jnp.asarray(std, dtype))


class Attention(nnx.Module):
    """Multi-head attention with K/V heads shared by groups of query heads (MHA / GQA / MQA)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c = config
        D, N, K, H = c.d_model, c.num_heads, c.kv_heads, c.head_size
        pd = jnp.dtype(c.param_dtype)
        self.config = c
        self.wq = _normal(rngs, (D, N, H), c.init_std, pd)
        self.wk = _normal(rngs, (D, K, H), c.init_std, pd)
        self.wv = _normal(rngs, (D, K, H), c.init_std, pd)
        self.wo = _normal(rngs, (N, H, D), c.init_std / (2 * c.num_layers) ** 0.5, pd)
        if c.qkv_bias:
            self.bq = nnx.Param(jnp.zeros((N, H), pd))
            self.bk = nnx.Param(jnp.zeros((K, H), pd))
            self.bv = nnx.Param(jnp.zeros((K, H), pd))
        if c.attn_output_gate:
            # One sigmoid gate per head and head dim, computed from the block input (Gated Attention, 2025).
            self.wg = _normal(rngs, (D, N, H), c.init_std, pd)
        if c.attn_sink:
            self.sink = nnx.Param(jnp.zeros((N,), pd))

    def project_q(self, x, cos, sin):
        """Queries for the tokens: [B, T, N, H] (rotated with RoPE)."""
        c = self.config
        dt = jnp.dtype(c.dtype)
        q = jnp.einsum("btd,dnh->btnh", x, self.wq[...].astype(dt))  # [B, T, N, H]
        if c.qkv_bias:
            q = q + self.bq[...].astype(dt)
        if cos is not None:
            q = apply_rope(q, cos, sin)
        return q

    def project_kv(self, x, cos, sin):
        """K and V for the new tokens: [B, T, K, H] each (K rotated, V never)."""
        c = self.config
        dt = jnp.dtype(c.dtype)
        k = jnp.einsum("btd,dkh->btkh", x, self.wk[...].astype(dt))
        v = jnp.einsum("btd,dkh->btkh", x, self.wv[...].astype(dt))
        if c.qkv_bias:
            k = k + self.bk[...].astype(dt)
            v = v + self.bv[...].astype(dt)
        if cos is not None:
            k = apply_rope(k, cos, sin)
        return k, v

    def __call__(self, x, *, cos, sin, visible, zero_after=None, layer_cache=None, starts=None,
                 return_weights=False):
        """x: [B, T, D] -> [B, T, D].

        layer_cache: optional (k, v) [B, S, K, H] of this layer; the chunk's K/V are written at per-row offsets
        `starts` [B] and the queries attend over the whole cache (the mask hides unwritten slots). Without a
        cache the keys are the chunk's own tokens. Returns (out, new_layer_cache or None, weights or None).
        """
        c = self.config
        dt = jnp.dtype(c.dtype)
        q = self.project_q(x, cos, sin)  # [B, T, N, H]
        k_new, v_new = self.project_kv(x, cos, sin)  # [B, T, K, H]
        if layer_cache is None:
            k, v, new_cache = k_new, v_new, None
        else:
            ck, cv = layer_cache
            new_cache = (write_rows(ck, k_new, starts), write_rows(cv, v_new, starts))
            k, v = new_cache[0].astype(dt), new_cache[1].astype(dt)
        sink = self.sink[...] if c.attn_sink else None
        out, weights = attend(q, k, v, visible, sink=sink, zero_after=zero_after, impl=c.attention_impl,
                              return_weights=return_weights)  # [B, T, N, H]
        if c.attn_output_gate:
            gate = jax.nn.sigmoid(jnp.einsum("btd,dnh->btnh", x, self.wg[...].astype(dt)).astype(jnp.float32))
            out = (out.astype(jnp.float32) * gate).astype(dt)
        out = jnp.einsum("btnh,nhd->btd", out.astype(dt), self.wo[...].astype(dt))
        return out, new_cache, weights
