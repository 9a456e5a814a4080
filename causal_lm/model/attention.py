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

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from causal_lm.config import ModelConfig
from causal_lm.model.kv_cache import write_layer_rows
from causal_lm.model.rope import apply_rope

# Finite large negative for masked float32 scores: -inf would turn a row with no visible key into NaN.
MASK_VALUE = -1e30


def make_mask(query_pos, key_pos, key_valid, query_segment=None, key_segment=None, *, causal: bool = True, window=None):
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
    qh, kh, _ = heads_major(q, k, None)
    return _scores(qh, kh)


def heads_major(q, k, v):
    """q [B, T, N, H] -> [B, K, G, T, H]; k, v [B, S, K, H] -> [B, K, S, H] (v may be None).

    The score and value matmuls batch over (B, K) with rows T (or S) and columns H contiguous; transposing once
    here, instead of inside each einsum, lets the query blocks of `attend` slice along T without transposing
    the keys again for every block.
    """
    B, T, N, H = q.shape
    K = k.shape[2]
    qh = q.reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4)
    kh = k.transpose(0, 2, 1, 3)
    return qh, kh, (None if v is None else v.transpose(0, 2, 1, 3))


def _scores(qh, kh):
    """qh [B, K, G, T, H] . kh [B, K, S, H] / sqrt(H) -> float32 [B, K, G, T, S]."""
    H = qh.shape[-1]
    if qh.shape[2] == 1:  # MHA / one query per group: a plain batched matmul (a size-1 g axis costs a transpose)
        scores = jnp.einsum("bkth,bksh->bkts", qh[:, :, 0], kh, preferred_element_type=jnp.float32)[:, :, None]
    else:
        scores = jnp.einsum("bkgth,bksh->bkgts", qh, kh, preferred_element_type=jnp.float32)
    return scores * (1.0 / jnp.sqrt(jnp.float32(H)))


# Up to this many queries (a decode step, a short chunk), attention reads K and V in their cache layout
# [B, S, K, H] instead of transposing them to heads-major first.
FEW_QUERIES = 8


def _scores_in_place(q, k):
    """Scores [B, K, G, T, S] of q [B, T, N, H] against k [B, S, K, H] in k's own layout.

    A batched matmul needs its batch axes (b, k) leading, so the heads-major form first copies the whole layer
    of keys into that order; in a decode step that copy (and V's) cost as much as all the weight reads. Here
    the T*N queries meet all S*K key vectors in one matmul over the row's contiguous [S*K, H] block, and the
    pairs of a query head with its own KV head are picked out after: K times the score FLOPs, which is nothing
    for a few queries, and the cache is read once, in place.
    """
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    pairs = jnp.einsum(
        "bqh,bjh->bqj", q.reshape(B, T * N, H), k.reshape(B, S * K, H), preferred_element_type=jnp.float32
    ).reshape(B, T, K, N // K, S, K)
    scores = jnp.diagonal(pairs, axis1=2, axis2=5)  # query head group k with key head k: [B, T, G, S, K]
    return scores.transpose(0, 4, 2, 1, 3) * (1.0 / jnp.sqrt(jnp.float32(H)))  # [B, K, G, T, S]


def _weighted_values_in_place(weights, v):
    """weights [B, K, G, T, S] . v [B, S, K, H] in v's own layout (as `_scores_in_place`) -> [B, T, N, H]."""
    B, K, G, T, S = weights.shape
    H = v.shape[-1]
    w = weights.astype(v.dtype).transpose(0, 3, 1, 2, 4).reshape(B, T * K * G, S)
    pairs = jnp.einsum("bqs,bsj->bqj", w, v.reshape(B, S, K * H)).reshape(B, T, K, G, K, H)
    out = jnp.diagonal(pairs, axis1=2, axis2=4)  # [B, T, G, H, K]
    return out.transpose(0, 1, 4, 2, 3).reshape(B, T, K * G, H)


def _weighted_values(weights, vh):
    """weights [B, K, G, T, S] . vh [B, K, S, H] -> [B, K, G, T, H]."""
    weights = weights.astype(vh.dtype)
    if weights.shape[2] == 1:
        return jnp.einsum("bkts,bksh->bkth", weights[:, :, 0], vh)[:, :, None]
    return jnp.einsum("bkgts,bksh->bkgth", weights, vh)


def masked_softmax(scores, visible, *, sink=None, zero_after=None):
    """Float32 softmax of scaled scores [B, K, G, T, S] over the visible keys (visible: [B, T, S]).

    sink: optional [K*G] logits that join the denominator only. Shared by every attention form (MHA/GQA/MQA and
    both MLA paths), so the mask value, the sink and the empty-row rule live in one place.
    """
    scores = scores.astype(jnp.float32)
    _, K, G, _, _ = scores.shape
    vis = visible[:, None, None, :, :]  # [B, 1, 1, T, S]
    # The mask as an additive bias (0 or MASK_VALUE) rather than a select: s + MASK_VALUE rounds to MASK_VALUE for
    # any score below ~1e22, so the values are the same, and the derivative of an add is the identity, where a
    # select's derivative is a second select over the [B, K, G, T, S] gradient (measured at the benchmark shape, a
    # layer's softmax alone: forward + backward 6.5 ms with the bias vs 23-28 ms with the select; the whole training
    # step, together with RoPE's written-out derivative: 2.24 vs 2.33 s).
    scores = scores + jnp.where(vis, jnp.float32(0), jnp.float32(MASK_VALUE))
    if sink is None:
        # jax.nn.softmax computes exp(s - max) / sum with a custom derivative that keeps only the weights for the
        # backward pass; differentiating the formula below op by op stores and re-reads several more [B, K, G, T,
        # S] arrays (a quarter of the attention time of a training step). A masked key gets exp(MASK_VALUE - max)
        # == 0 exactly when its row has a visible key; a row with none would come out uniform, so it is zeroed.
        return _zero_after(jax.nn.softmax(scores, axis=-1) * jnp.any(vis, axis=-1, keepdims=True), zero_after)
    row_max = jnp.max(scores, axis=-1, keepdims=True)  # [B, K, G, T, 1]
    sink = sink.astype(jnp.float32).reshape(1, K, G, 1, 1)
    row_max = jnp.maximum(row_max, sink)
    e = jnp.exp(scores - row_max) * vis  # exactly 0 where not visible
    denom = jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - row_max)
    return _zero_after(e / jnp.maximum(denom, jnp.finfo(jnp.float32).tiny), zero_after)


def _zero_after(weights, zero_after):
    """The "zero after softmax" research variant: weights [B, K, G, T, S] times zero_after [B, T, S] (or as is)."""
    if zero_after is not None:
        weights = weights * zero_after[:, None, None, :, :]
    return weights


def attend(
    q,
    k,
    v,
    visible,
    *,
    sink=None,
    zero_after=None,
    impl: str = "xla",
    return_weights: bool = False,
    query_block: int = 0,
):
    """Attention output [B, T, N, H] (and optionally weights [B, N, T, S]).

    GQA/MQA: the G query heads of a group attend to their shared K/V head through the einsum's k axis; K and V
    are never repeated to N heads.
    query_block: when > 0, the caller guarantees that no key after a query's own index is visible (keys = the
    queries' own tokens, with positions that increase within each segment: training and one-shot prefill). The
    queries are then taken in blocks of this size and block [i, i + query_block) scores only keys [0, i +
    query_block): about half the score matmuls and softmax work of the full T x T square for the same result
    (the mask is still applied inside each block; the skipped keys would have had weight exactly 0).
    """
    B, T, N, H = q.shape
    S = k.shape[1]
    blocked = 0 < query_block < T and S == T and not return_weights
    spans = [(i, min(i + query_block, T)) for i in range(0, T, query_block)] if blocked else [(0, T)]
    if impl == "dot_product_attention" and not return_weights:
        assert sink is None and zero_after is None
        outs = []
        for i, e in spans:
            s_end = e if blocked else S
            vis = visible[:, i:e, :s_end]
            out = jax.nn.dot_product_attention(
                q[:, i:e], k[:, :s_end].astype(q.dtype), v[:, :s_end].astype(q.dtype), mask=vis[:, None, :, :]
            )
            # A row with no visible key: defined as zeros (the library returns an average of V there).
            outs.append(out * jnp.any(vis, axis=-1)[:, :, None, None].astype(out.dtype))
        return (outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)), None
    if T <= FEW_QUERIES and k.shape[2] > 1:  # decode: attend over the cache where it lies (see _scores_in_place)
        weights = masked_softmax(_scores_in_place(q, k), visible, sink=sink, zero_after=zero_after)
        out = _weighted_values_in_place(weights, v)  # [B, T, N, H]
        return out, (weights.reshape(B, N, T, S) if return_weights else None)
    qh, kh, vh = heads_major(q, k, v)
    outs = []
    for i, e in spans:
        s_end = e if blocked else S  # a block's queries see no key after their own block
        za = None if zero_after is None else zero_after[:, i:e, :s_end]
        weights = masked_softmax(
            _scores(qh[:, :, :, i:e], kh[:, :, :s_end]), visible[:, i:e, :s_end], sink=sink, zero_after=za
        )  # [B, K, G, t, s]
        outs.append(_weighted_values(weights, vh[:, :, :s_end]))  # [B, K, G, t, H]
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=3)
    out = out.transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)
    if return_weights:
        return out, weights.reshape(B, N, T, S)
    return out, None


def project(x, w, n_in: int = 1, preferred_element_type=None):
    """Contract the last `n_in` dims of x [..., *in] with the first `n_in` of w [*in, *out] -> [..., *out].

    Computed as one 2-D matmul over flattened rows, [rows, prod(in)] @ [prod(in), prod(out)]. The same einsum on
    3-D/4-D operands differentiates into dot_generals whose weight gradient XLA:CPU feeds through a strided
    transpose of the output gradient (a third of a training step at the benchmark shape); on flattened rows
    both the forward and the backward are plain matmuls.
    """
    in_shape, out_shape = w.shape[:n_in], w.shape[n_in:]
    lead = x.shape[: x.ndim - n_in]
    y = jnp.matmul(
        x.reshape(-1, int(np.prod(in_shape))),
        w.reshape(int(np.prod(in_shape)), -1),
        preferred_element_type=preferred_element_type,
    )
    return y.reshape(lead + out_shape)


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
        q = project(x, self.wq[...].astype(dt))  # [B, T, N, H]
        if c.qkv_bias:
            q = q + self.bq[...].astype(dt)
        if cos is not None:
            q = apply_rope(q, cos, sin)
        return q

    def project_kv(self, x, cos, sin):
        """K and V for the new tokens: [B, T, K, H] each (K rotated, V never)."""
        c = self.config
        dt = jnp.dtype(c.dtype)
        k = project(x, self.wk[...].astype(dt))  # [B, T, K, H]
        v = project(x, self.wv[...].astype(dt))
        if c.qkv_bias:
            k = k + self.bk[...].astype(dt)
            v = v + self.bv[...].astype(dt)
        if cos is not None:
            k = apply_rope(k, cos, sin)
        return k, v

    def __call__(
        self,
        x,
        *,
        cos,
        sin,
        visible,
        zero_after=None,
        layer_cache=None,
        starts=None,
        return_weights=False,
        query_block=0,
    ):
        """x: [B, T, D] -> [B, T, D].

        layer_cache: optional (buffers, layer): the cache's (k, v) buffers [L, B, S, K, H] and this layer's index;
        the chunk's K/V are written into layer `layer` at per-row offsets `starts` [B] and the queries attend over
        the layer's whole cache (the mask hides unwritten slots). Without a cache the keys are the chunk's own
        tokens. Returns (out, new (k, v) buffers or None, weights or None).
        """
        c = self.config
        dt = jnp.dtype(c.dtype)
        q = self.project_q(x, cos, sin)  # [B, T, N, H]
        k_new, v_new = self.project_kv(x, cos, sin)  # [B, T, K, H]
        if layer_cache is None:
            k, v, new_cache = k_new, v_new, None
        else:
            (ck, cv), layer = layer_cache
            new_cache = (write_layer_rows(ck, layer, k_new, starts), write_layer_rows(cv, layer, v_new, starts))
            k, v = new_cache[0][layer].astype(dt), new_cache[1][layer].astype(dt)  # [B, S, K, H]
        sink = self.sink[...] if c.attn_sink else None
        out, weights = attend(
            q,
            k,
            v,
            visible,
            sink=sink,
            zero_after=zero_after,
            impl=c.attention_impl,
            return_weights=return_weights,
            query_block=query_block,
        )  # [B, T, N, H]
        if c.attn_output_gate:
            gate = jax.nn.sigmoid(project(x, self.wg[...].astype(dt)).astype(jnp.float32))
            out = (out.astype(jnp.float32) * gate).astype(dt)
        out = project(out.astype(dt), self.wo[...].astype(dt), n_in=2)  # [B, T, D]
        return out, new_cache, weights
