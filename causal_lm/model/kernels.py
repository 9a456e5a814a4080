"""Attention kernels: one reference definition and the faster paths, each tested equal to it.

Every kernel computes the same function of (q, k, v, mask):

    out[b, t, n] = sum_s softmax_s(q[b, t, n] . k[b, s, kv(n)] * scale  over visible keys (+ sink)) * v[b, s, kv(n)]

with float32 scores and softmax, a finite large negative for masked scores (a row that sees no key gets zeros, never
NaN), K/V at the KV-head count (query head n reads KV head n // G: GQA/MQA without repeating K/V), optional
per-head sink logits that join the softmax denominator only, and optional tanh softcapping of the scaled scores
(Gemma 2: softcap * tanh(score / softcap), before the mask).

Shape letters (used in every `# [...]` comment of the package):
    B batch, T query length, S key length, N query heads, K kv heads, G query heads per kv head (N = K*G),
    H head dim (Hv: value head dim where it differs), D model dim, F mlp dim, V vocab, L layers.

    reference_attention   plain einsums over the dense mask: the definition every other kernel is tested against.
    heads_major_attention the same maths with Q, K, V transposed once to [B, K, ..., H] so each matmul batches over
                          (B, K) with contiguous rows: XLA:CPU's fast batched-matmul form for many queries.
    blocked_causal_attention  heads-major, in query blocks that score only the keys up to the block's end. Applies
                          only when the mask says no key after a query's own index is visible (`index_causal`,
                          derived from the positions, see mask.py): about half the work of the T x T square.
    query_blocked_attention   heads-major in the same query blocks, each over every key: any mask (a prompt
                          written into a cache), the whole square, but each block's scores stay in the CPU's cache.
    in_place_attention    a few queries over a long cache (decode): reads K/V in their cache layout [B, S, K, H]
                          instead of transposing the whole layer first.
    xla_dot_product_attention  `jax.nn.dot_product_attention`, XLA's own choice of implementation.
    invariant_attention   one query at a time over fixed key chunks: bitwise the same for a query whatever the
                          call's shapes (the batch-invariant scoring mode of RL's sampler and trainer).
    backends.cudnn_attention / backends.splash_attention  the fused kernels of GPUs and TPUs (see backends.py).
    PagedKVCache.attend   (paged_cache.py) a decode step over a paged cache on the CPU: the paged form of the C++
                          decode kernel (csrc/decode_attention.cc) copies each 128-slot chunk's visible slots out of
                          the pool and sums them as it sums a contiguous cache's (the same bits) instead of gathering
                          every row's pages per layer; the attention layer picks it before `attention()` when the
                          cache offers it.

`attention()` picks one from static facts (platform, shapes, mask structure, config); `attention_impl` names the
family.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from causal_lm.model import backends, decode_attention
from causal_lm.model.mask import AttentionMask

# Finite large negative for masked float32 scores: -inf would turn a row with no visible key into NaN.
MASK_VALUE = -1e30

# Up to this many queries (a decode step, a short chunk), attention reads K and V in their cache layout.
FEW_QUERIES = 8


def default_scale(head_dim: int) -> float:
    return float(head_dim) ** -0.5


# ---- shared pieces: scores, softmax, values ---------------------------------------------------------------------


def grouped_scores(q, k, scale):
    """Scores of q [B, T, N, H] against k [B, S, K, H] in float32, before any mask: [B, K, G, T, S]."""
    B, T, N, H = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, N // K, H)
    return jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * jnp.float32(scale)


def masked_softmax(scores, visible, *, sink=None, zero_after=None, softcap=None):
    """Float32 softmax of scaled scores [B, K, G, T, S] over the visible keys (visible: [B, T, S]).

    sink: optional [K*G] logits that join the denominator only. zero_after: optional [B, T, S] multiplied in after
    the softmax (the "zero after softmax" research variant). softcap: optional float c, scores -> c * tanh(scores
    / c) before the mask (a static switch: nothing is computed without it). Every kernel goes through this one
    function, so the mask value, the sink, the softcap and the empty-row rule live in one place.
    """
    scores = scores.astype(jnp.float32)
    if softcap:
        # Before the mask, as Gemma 2 does: capping after it would turn MASK_VALUE into -softcap, a visible score.
        scores = jnp.tanh(scores / jnp.float32(softcap)) * jnp.float32(softcap)
    _, K, G, _, _ = scores.shape
    vis = visible[:, None, None, :, :]  # [B, 1, 1, T, S]
    # The mask as an additive bias (0 or MASK_VALUE) rather than a select: s + MASK_VALUE rounds to MASK_VALUE for
    # any score below ~1e22, so the values are the same, and the derivative of an add is the identity where a
    # select's derivative is a second select over the whole [B, K, G, T, S] gradient.
    scores = scores + jnp.where(vis, jnp.float32(0), jnp.float32(MASK_VALUE))
    if sink is None:
        # jax.nn.softmax keeps only the weights for its backward pass (a custom derivative); differentiating the
        # formula op by op would store and re-read several more [B, K, G, T, S] arrays. A masked key gets
        # exp(MASK_VALUE - max) == 0 exactly when its row has a visible key; a row with none would come out
        # uniform, so it is zeroed.
        weights = jax.nn.softmax(scores, axis=-1) * jnp.any(vis, axis=-1, keepdims=True)
    else:
        row_max = jnp.max(scores, axis=-1, keepdims=True)  # [B, K, G, T, 1]
        sink = sink.astype(jnp.float32).reshape(1, K, G, 1, 1)
        row_max = jnp.maximum(row_max, sink)
        e = jnp.exp(scores - row_max) * vis  # exactly 0 where not visible
        denom = jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - row_max)
        weights = e / jnp.maximum(denom, jnp.finfo(jnp.float32).tiny)
    if zero_after is not None:
        weights = weights * zero_after[:, None, None, :, :]
    return weights


def grouped_values(weights, v):
    """weights [B, K, G, T, S] . v [B, S, K, Hv] -> [B, T, N, Hv] (in v's dtype)."""
    B, K, G, T, _ = weights.shape
    out = jnp.einsum("bkgts,bskh->btkgh", weights.astype(v.dtype), v)
    return out.reshape(B, T, K * G, v.shape[-1])


# ---- the reference ------------------------------------------------------------------------------------------


def reference_attention(q, k, v, mask: AttentionMask, *, scale, sink=None, softcap=None):
    """The definition: einsums over the dense mask. q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv].

    Returns (out [B, T, N, Hv], weights [B, N, T, S] float32)."""
    B, T, N, _ = q.shape
    weights = masked_softmax(
        grouped_scores(q, k, scale), mask.visible, sink=sink, zero_after=mask.zero_after, softcap=softcap
    )
    return grouped_values(weights, v), weights.reshape(B, N, T, k.shape[1])


# ---- heads-major: many queries ------------------------------------------------------------------------------


def _heads_major(q, k, v):
    """q [B, T, N, H] -> [B, K, G, T, H]; k, v [B, S, K, H] -> [B, K, S, H]."""
    B, T, N, H = q.shape
    K = k.shape[2]
    return q.reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def _hm_scores(qh, kh, scale):
    """qh [B, K, G, T, H] . kh [B, K, S, H] -> float32 [B, K, G, T, S]."""
    if qh.shape[2] == 1:  # one query head per KV head (MHA): a plain batched matmul; a size-1 g axis costs a transpose
        s = jnp.einsum("bkth,bksh->bkts", qh[:, :, 0], kh, preferred_element_type=jnp.float32)[:, :, None]
    else:
        s = jnp.einsum("bkgth,bksh->bkgts", qh, kh, preferred_element_type=jnp.float32)
    return s * jnp.float32(scale)


def _hm_values(weights, vh):
    """weights [B, K, G, T, S] . vh [B, K, S, Hv] -> [B, K, G, T, Hv]."""
    weights = weights.astype(vh.dtype)
    if weights.shape[2] == 1:
        return jnp.einsum("bkts,bksh->bkth", weights[:, :, 0], vh)[:, :, None]
    return jnp.einsum("bkgts,bksh->bkgth", weights, vh)


def _from_heads_major(out):
    """[B, K, G, T, Hv] -> [B, T, N, Hv]."""
    B, K, G, T, Hv = out.shape
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, K * G, Hv)


def heads_major_attention(q, k, v, mask: AttentionMask, *, scale, sink=None, softcap=None):
    """Reference maths with Q, K and V transposed once to heads-major order, so the score and value matmuls batch
    over (B, K) with rows T (or S) and columns H contiguous: XLA:CPU runs that form as plain batched matmuls where
    the reference's einsums would transpose inside each one. For many queries (training, prefill)."""
    qh, kh, vh = _heads_major(q, k, v)
    weights = masked_softmax(
        _hm_scores(qh, kh, scale), mask.visible, sink=sink, zero_after=mask.zero_after, softcap=softcap
    )
    return _from_heads_major(_hm_values(weights, vh))


def causal_query_block(T: int) -> int:
    """Query block size for `blocked_causal_attention` over T tokens (0: not worth blocking).

    At most 8 blocks of at least 64 queries: block i then scores (i + 1) / 8 of the keys, 56% of the full square in
    all, while each block's matmuls stay large enough to run near the CPU's matmul rate.
    """
    if T <= 64:
        return 0
    return max(64, -(-T // 8))


def _query_blocks(q, k, v, mask: AttentionMask, *, scale, sink, softcap, block: int, keys_to_block_end: bool):
    """Heads-major attention in query blocks of `block`. keys_to_block_end: each block scores only the keys up to
    its own end (sound only when no later key is visible, see blocked_causal_attention); else every key."""
    T = q.shape[1]
    qh, kh, vh = _heads_major(q, k, v)
    outs = []
    for i in range(0, T, block):
        e = min(i + block, T)
        s = e if keys_to_block_end else k.shape[1]  # the keys block [i, e) scores
        za = None if mask.zero_after is None else mask.zero_after[:, i:e, :s]
        w = masked_softmax(
            _hm_scores(qh[:, :, :, i:e], kh[:, :, :s], scale),
            mask.visible[:, i:e, :s],
            sink=sink,
            zero_after=za,
            softcap=softcap,
        )
        outs.append(_hm_values(w, vh[:, :, :s]))
    return _from_heads_major(jnp.concatenate(outs, axis=3))


def blocked_causal_attention(q, k, v, mask: AttentionMask, *, scale, sink=None, softcap=None, block: int):
    """Heads-major attention in query blocks of `block`, each scoring only the keys up to its own end.

    Applies when `mask.index_causal`: the keys are the queries' own tokens (S == T) and no key after a query's
    index is visible to it (what the positions guarantee when they increase within each segment; mask.py derives
    it). The skipped keys would get weight exactly 0, so the result equals the reference; the work is about half
    the T x T square. The mask is still applied inside each block."""
    if not mask.index_causal or k.shape[1] != q.shape[1]:
        raise ValueError("blocked_causal_attention needs a mask whose keys are the queries' own, index-causal tokens")
    return _query_blocks(q, k, v, mask, scale=scale, sink=sink, softcap=softcap, block=block, keys_to_block_end=True)


def query_blocked_attention(q, k, v, mask: AttentionMask, *, scale, sink=None, softcap=None, block: int):
    """Heads-major attention in query blocks of `block`, each over every key: the reference's result for any mask.

    The work is the full square, as in `heads_major_attention`, but each block's scores [B, K, G, block, S] stay
    small enough to remain in the CPU's cache between the score matmul, the softmax and the value matmul, where
    the whole [B, K, G, T, S] of a batched prompt (a 512-token prefill at batch 8: 78 MB) makes each of them a
    trip through main memory: on the 135M shape's prefill (9 heads, 512 queries over 528 keys) blocks of 64 took
    the attention from 233 to 133 ms per layer at batch 8 and from 22 to 17 ms at batch 1 (2-core EPYC). For many
    queries whose mask promises nothing about the keys' order (a prompt written into a cache)."""
    return _query_blocks(q, k, v, mask, scale=scale, sink=sink, softcap=softcap, block=block, keys_to_block_end=False)


# ---- in place: few queries over a cache ---------------------------------------------------------------------


def in_place_attention(q, k, v, mask: AttentionMask, *, scale, sink=None, softcap=None):
    """A few queries (a decode step) over keys in their cache layout [B, S, K, H], read once and in place.

    A batched matmul needs its batch axes (b, k) leading, so the heads-major form would first copy the whole layer
    of keys into that order; in a decode step that copy (and V's) costs as much as all the weight reads. Here the
    T*N queries meet all S*K key vectors in one matmul over the row's contiguous [S*K, H] block and the pairs of a
    query head with its own KV head are picked out after: K times the score FLOPs, nothing for a few queries."""
    B, T, N, H = q.shape
    S, K, Hv = k.shape[1], k.shape[2], v.shape[-1]
    G = N // K
    pairs = jnp.einsum(
        "bqh,bjh->bqj", q.reshape(B, T * N, H), k.reshape(B, S * K, H), preferred_element_type=jnp.float32
    ).reshape(B, T, K, G, S, K)
    scores = jnp.diagonal(pairs, axis1=2, axis2=5).transpose(0, 4, 2, 1, 3) * jnp.float32(scale)  # [B, K, G, T, S]
    weights = masked_softmax(scores, mask.visible, sink=sink, zero_after=mask.zero_after, softcap=softcap)
    w = weights.astype(v.dtype).transpose(0, 3, 1, 2, 4).reshape(B, T * K * G, S)
    vpairs = jnp.einsum("bqs,bsj->bqj", w, v.reshape(B, S, K * Hv)).reshape(B, T, K, G, K, Hv)
    out = jnp.diagonal(vpairs, axis1=2, axis2=4)  # [B, T, G, Hv, K]
    return out.transpose(0, 1, 4, 2, 3).reshape(B, T, N, Hv)


def native_attention(q, k, v, mask: AttentionMask, *, scale, sink=None, softcap=None):
    """A few queries over keys in their cache layout, the two products in C++ (`decode_attention.py`): each key
    and value read once, in place, for all the queries that use it; the softmax between them is `masked_softmax`."""
    if v.dtype != jnp.float32:
        return in_place_attention(q, k, v, mask, scale=scale, sink=sink, softcap=softcap)
    scores = decode_attention.scores(q, k) * jnp.float32(scale)  # as grouped_scores: the product, then the scale
    weights = masked_softmax(scores, mask.visible, sink=sink, zero_after=mask.zero_after, softcap=softcap)
    return decode_attention.values(weights, v)


def layer_attention_in_place(q, k, v, layer, visible, *, scale: float, sink=None, softcap=None):
    """Attention of q [B, T, N, H] over layer `layer` of a contiguous cache's stacked float32 buffers
    k [L, B, C, K, H], v [L, B, C, K, Hv] under visible [B, T, C], read where it lies by one C++ call
    (`decode_attention.attend`): out [B, T, N, Hv] float32. Its derivative is the XLA form's (`reference_attention`
    on the layer sliced out), so a gradient traced through a decode step still works."""
    params = (float(scale), None if softcap is None else float(softcap), sink is not None)
    sink = jnp.zeros((q.shape[2],), jnp.float32) if sink is None else sink.astype(jnp.float32)
    return _layer_in_place(params, q, k, v, jnp.asarray(layer, jnp.int32), visible, sink)


def _layer_in_place_xla(params, q, k, v, layer, visible, sink):
    scale, softcap, has_sink = params
    s = grouped_scores(q, k[layer], scale)
    w = masked_softmax(s, visible, sink=sink if has_sink else None, softcap=softcap)
    return grouped_values(w, v[layer])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _layer_in_place(params, q, k, v, layer, visible, sink):
    scale, softcap, has_sink = params
    return decode_attention.attend(
        q, k, v, layer, visible, scale=scale, sink=sink if has_sink else None, softcap=softcap
    )


def _layer_in_place_fwd(params, q, k, v, layer, visible, sink):
    return _layer_in_place(params, q, k, v, layer, visible, sink), (q, k, v, layer, visible, sink)


def _layer_in_place_bwd(params, res, g):
    q, k, v, layer, visible, sink = res
    _, pullback = jax.vjp(lambda *a: _layer_in_place_xla(params, *a[:3], layer, visible, a[3]), q, k, v, sink)
    dq, dk, dv, dsink = pullback(g)
    return dq, dk, dv, None, None, dsink


_layer_in_place.defvjp(_layer_in_place_fwd, _layer_in_place_bwd)


# ---- batch-invariant: one query at a time, keys in fixed chunks -----------------------------------------------

INVARIANT_CHUNK = 128  # keys per step of `invariant_attention`'s online softmax


def invariant_attention(q, k, v, mask: AttentionMask, *, scale, sink=None, softcap=None, chunk=INVARIANT_CHUNK):
    """The reference's result computed so that each query's output does not depend on how many queries, rows or
    padded keys the call has: the float operations a query sees are the same in a one-token decode step over a
    paged cache and in a training forward pass over the whole sequence (RL's sampler/trainer logprob parity).

    XLA:CPU picks different kernels for the same maths at different shapes (a softmax over [1, S] and over
    [T, S] rows round differently, and a large fusion may run in another library with its own exp), so shape
    independence is built here, not hoped for: a sequential loop (`lax.map`) over the B*T queries, each attending
    one [N, H] query to its row's keys in chunks of `chunk` slots (zero-padded to a whole chunk), the chunks
    combined by the online-softmax recurrence in key order. A chunk whose keys are all masked changes nothing
    bitwise (its max is MASK_VALUE, the running max stays, the rescale factor is exp(0) = 1 and its terms are 0),
    so key widths that differ only by masked slots at the end (a page table's width, a padded batch) give equal
    bits; key s must be position s in both calls (a cache's slot view and a sequence starting at index 0 are).
    Slow for training (one query per loop step): a scoring mode, not the default."""
    B, T, N, H = q.shape
    S, K, Hv = k.shape[1], k.shape[2], v.shape[-1]
    G = N // K
    C = int(chunk)
    nc = -(-S // C)
    pad = nc * C - S
    kc = jnp.pad(k, [(0, 0), (0, pad), (0, 0), (0, 0)]).reshape(B, nc, C, K, H)
    vc = jnp.pad(v, [(0, 0), (0, pad), (0, 0), (0, 0)]).reshape(B, nc, C, K, Hv)
    vis = jnp.pad(mask.visible, [(0, 0), (0, 0), (0, pad)]).reshape(B, T, nc, C)
    sink_f = None if sink is None else sink.astype(jnp.float32).reshape(K, G)

    def one_query(args):
        qr, b, visr = jax.lax.optimization_barrier(args)  # [N, H], (), [nc, C]: fenced from the caller's fusions
        qr = qr.reshape(K, G, H)

        def step(carry, xs):
            m, den, acc = carry  # [K, G], [K, G], [K, G, Hv] float32
            kk, vv, vi = xs  # [C, K, H], [C, K, Hv], [C]
            s = jnp.einsum("kgh,ckh->kgc", qr, kk, preferred_element_type=jnp.float32) * jnp.float32(scale)
            if softcap:
                s = jnp.tanh(s / jnp.float32(softcap)) * jnp.float32(softcap)
            s = s + jnp.where(vi, jnp.float32(0), jnp.float32(MASK_VALUE))
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[..., None])
            pv = jnp.einsum("kgc,ckh->kgh", p.astype(vv.dtype), vv, preferred_element_type=jnp.float32)
            return (m_new, den * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv), None

        init = (
            jnp.full((K, G), -jnp.inf, jnp.float32),
            jnp.zeros((K, G), jnp.float32),
            jnp.zeros((K, G, Hv), jnp.float32),
        )
        m, den, acc = jax.lax.scan(step, init, (kc[b], vc[b], visr))[0]
        if sink_f is not None:
            m_all = jnp.maximum(m, sink_f)
            r = jnp.exp(m - m_all)
            den, acc, m = den * r + jnp.exp(sink_f - m_all), acc * r[..., None], m_all
        out = acc / jnp.maximum(den, jnp.finfo(jnp.float32).tiny)[..., None]
        out = out * jnp.any(visr).astype(out.dtype)  # a query that sees no key gets zeros, as in the reference
        return jax.lax.optimization_barrier(out.reshape(N, Hv))

    rows = jnp.repeat(jnp.arange(B, dtype=jnp.int32), T)
    out = jax.lax.map(one_query, (q.reshape(B * T, N, H), rows, vis.reshape(B * T, nc, C)))
    return out.reshape(B, T, N, Hv).astype(v.dtype)


# ---- XLA's fused attention ----------------------------------------------------------------------------------


def xla_dot_product_attention(q, k, v, mask: AttentionMask, *, scale, sink=None, softcap=None):
    """`jax.nn.dot_product_attention` with the dense mask (XLA picks the implementation for the platform).
    No sink logits, no softcapping and no zero-after-softmax (the config refuses those combinations)."""
    if sink is not None or softcap or mask.zero_after is not None:
        raise ValueError("jax.nn.dot_product_attention has no sink logit, softcapping or zero-after-softmax variant")
    out = jax.nn.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), mask=mask.visible[:, None], scale=scale)
    # A row with no visible key: defined as zeros (the library returns an average of V there).
    return out * jnp.any(mask.visible, axis=-1)[:, :, None, None].astype(out.dtype)


# ---- the dispatcher -----------------------------------------------------------------------------------------


def attention(
    q,
    k,
    v,
    mask: AttentionMask,
    *,
    impl: str = "xla",
    scale=None,
    sink=None,
    softcap=None,
    return_weights=False,
    keys_copied=False,
    invariant=False,
):
    """Attention output [B, T, N, Hv] and, with return_weights, the weights [B, N, T, S] (else None).

    The kernel is chosen from static facts only: the config's implementation family, the number of queries, the
    KV head count, the mask's structure and whether K/V are a fresh copy (`keys_copied`: a paged cache gathers
    each row's pages into one, so laying that copy out heads-major costs nothing). Every choice computes the
    reference's result (tests/test_kernels.py).
    """
    scale = default_scale(q.shape[-1]) if scale is None else scale
    if return_weights:
        return reference_attention(q, k, v, mask, scale=scale, sink=sink, softcap=softcap)
    if invariant:  # the scoring mode (`Decoder.forward(batch_invariant=True)`), whatever the family
        if mask.zero_after is not None:
            raise ValueError("batch-invariant attention has no zero-after-softmax variant")
        return invariant_attention(q, k, v, mask, scale=scale, sink=sink, softcap=softcap), None
    if impl not in ("xla", "dot_product_attention"):  # auto, cudnn, splash (a named one off its platform: raises)
        fused = backends.resolve(
            impl,
            backends.platform(),
            q.dtype,
            q.shape[-1],
            sink=sink is not None,
            softcap=bool(softcap),
            devices=jax.device_count(),
        )
        if fused is not None and backends.applies(mask, q, k):
            return backends.KERNELS[fused](q, k, v, mask, scale=scale, sink=sink, softcap=softcap), None
    kernel = select_kernel(q, k, mask, impl, keys_copied=keys_copied)
    return kernel(q, k, v, mask, scale=scale, sink=sink, softcap=softcap), None


def select_kernel(q, k, mask: AttentionMask, impl: str = "xla", *, keys_copied: bool = False):
    """The kernel `attention` uses for these shapes and this mask (a function of static facts)."""
    T, S, K = q.shape[1], k.shape[1], k.shape[2]
    if impl == "dot_product_attention":
        return xla_dot_product_attention
    # With one KV head (MQA) the heads-major transpose of K/V is free; when K/V were just gathered (a paged cache)
    # the gather writes them heads-major at no extra cost, and the batched matmuls then read each row once instead
    # of meeting every KV head with every query head (measured: 16 rows x 512 slots x 6 heads, 16.3 -> 7.8 ms).
    if T <= FEW_QUERIES and not keys_copied and _native_decode(q, k):
        return native_attention
    if T <= FEW_QUERIES and K > 1 and not keys_copied:
        return in_place_attention
    block = causal_query_block(T)
    if 0 < block < T:
        if mask.index_causal and S == T:
            return functools.partial(blocked_causal_attention, block=block)
        return functools.partial(query_blocked_attention, block=block)
    return heads_major_attention


def _native_decode(q, k) -> bool:
    return decode_attention.native_here(q.dtype, k.dtype)


def attention_weights(q, k, visible, *, sink=None, zero_after=None, scale=None, softcap=None):
    """Softmax attention weights [B, K, G, T, S] float32 of q [B, T, N, H] over k [B, S, K, H] under `visible`
    [B, T, S] (the reference's weights, before they meet V; for probes and tests)."""
    scale = default_scale(q.shape[-1]) if scale is None else scale
    return masked_softmax(grouped_scores(q, k, scale), visible, sink=sink, zero_after=zero_after, softcap=softcap)
