"""Speculative decoding: a cheap draft proposes k tokens, the target checks them all in one cached forward pass.

At batch 1 a decode step is memory-bound: scoring k + 1 tokens costs the target about what scoring one does. Each
pass of the loop

  1. proposes k_b <= k tokens per row: "ngram" (prompt lookup: the tokens that followed the most recent earlier
     occurrence of the row's last 3, else 2, else 1 tokens in its own prompt + output; none found, none proposed)
     or a draft model (any causal_lm model with the same vocabulary, decoding k tokens with its own cache);
  2. feeds [pending token, d_1 .. d_k] to the target as one chunk at each row's own offset (rows proposing fewer
     pad the chunk; padding is neither written nor counted) and gets its distributions p_0 .. p_k;
  3. accepts the longest agreeing prefix, a_b tokens: greedy, d_i equals the argmax of p_{i-1}; sampling, d_i is
     kept with probability min(1, p(d_i) / q(d_i)) where q is the draft's distribution (a point mass for "ngram");
  4. adds one token of the target's own: greedy, the argmax of p_a; sampling, a draw from the normalised
     max(0, p_a - q_a) after a rejection, or from p_a when every proposal was kept. So every pass emits at least
     one token, and the output distribution is exactly plain sampling's (temperature, top-k and top-p are applied
     to p and q alike, `sampling.probabilities`);
  5. rolls each row's cache back to its accepted length (`KVCache.rollback`): rows accept different counts.

Greedy decoding therefore emits exactly the tokens of plain decoding. The target's ring caches (local layers) keep
k extra slots (`lookahead`) so a rollback never needs a key a draft overwrote.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from causal_lm import parallel
from causal_lm.decode.loop import Progress
from causal_lm.decode.prefill import count_trace, prefill, shard_cache
from causal_lm.decode.sampling import BatchSampling, argmax_tokens, probabilities
from causal_lm.model.kv_cache import init_cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpeculativeState:
    """The speculative loop's carry."""

    passes: jax.Array  # int32: target forward passes so far (after prefill)
    target: object  # the target's KVCache: every row's tokens but its last (pending) one
    draft: object  # the draft model's KVCache, or None ("ngram")
    history: jax.Array  # [B, H] int32: prompt + emitted tokens, right-padded
    hist_len: jax.Array  # [B] int32: valid length of `history` (= target cache length + 1)
    count: jax.Array  # [B] int32: tokens emitted
    done: jax.Array  # [B] bool
    out: jax.Array  # [B, max_new + k + 1] int32, -1 where nothing was emitted
    out_logits: jax.Array  # [B, max_new + k + 1, V] float32 with return_logits, else [0]
    kv_computed: jax.Array  # [B] int32: the target's K/V vectors computed (rejected drafts included)
    proposed: jax.Array  # [B] int32: draft tokens proposed
    accepted: jax.Array  # [B] int32: draft tokens accepted


def ngram_proposals(history, hist_len, k: int, max_n: int = 3):
    """Prompt-lookup drafts: (tokens [B, k], how many of them are proposals [B]).

    For n = max_n .. 1, the most recent earlier occurrence of the row's last n tokens (one that ends before the
    last token) proposes the k tokens that follow it; the longest n that occurs wins. An occurrence that overlaps
    the suffix (a run of one repeated token, a repeated phrase) has fewer than k tokens after it: the history is
    periodic from there with period p = (the row's length - where the followers start), so its continuation is
    those p tokens repeated."""
    B, H = history.shape
    pos = jnp.arange(H, dtype=jnp.int32)
    start = jnp.zeros((B,), jnp.int32)
    found = jnp.zeros((B,), bool)
    for n in range(max_n, 0, -1):
        suffix = jnp.take_along_axis(history, jnp.clip(hist_len[:, None] - n + jnp.arange(n), 0, H - 1), axis=1)
        match = (pos[None, :] + n <= hist_len[:, None] - 1) & (hist_len[:, None] > n)  # [B, H]: occurrence at j
        for i in range(n):
            shifted = jnp.concatenate([history[:, i:], jnp.full((B, i), -1, history.dtype)], axis=1)  # h[j + i]
            match &= shifted == suffix[:, i : i + 1]
        last = jnp.max(jnp.where(match, pos[None, :], -1), axis=1)  # the most recent occurrence, -1 if none
        use = ~found & (last >= 0)
        start = jnp.where(use, last + n, start)
        found |= use
    period = jnp.maximum(hist_len - start, 1)[:, None]
    follow = start[:, None] + jnp.arange(k) % period
    drafts = jnp.take_along_axis(history, jnp.clip(follow, 0, H - 1), axis=1)
    return drafts, jnp.where(found, k, 0)


def _draft_proposals(draft, layers, cache, history, hist_len, active, k, key, sampling: BatchSampling, mesh):
    """Draft-model proposals: feed the draft the 1 or 2 history tokens its cache lacks, then let it decode k tokens.
    Returns (drafts [B, k], their distributions q [B, k, V], the draft cache)."""
    D = cache.lengths
    idx = D[:, None] + jnp.arange(2, dtype=jnp.int32)
    chunk = jnp.take_along_axis(history, jnp.clip(idx, 0, history.shape[1] - 1), axis=1)  # [B, 2]
    seg = ((idx < hist_len[:, None]) & active[:, None]).astype(jnp.int32)
    logits, cache = draft(chunk, segment_ids=seg, cache=cache, layers=layers)
    last = jnp.take_along_axis(logits, jnp.clip(hist_len - D - 1, 0, 1)[:, None, None], axis=1)[:, 0]
    cache = shard_cache(cache, mesh)
    seg_active = active[:, None].astype(jnp.int32)

    def propose(last, j):
        return sampling.draw(last, jax.random.fold_in(key, j)), sampling.probabilities(last)

    def step(carry, j):  # one draft token decoded: one program body for all k - 1 steps (compile time)
        cache, last = carry
        tok, q = propose(last, j)
        logits, cache = draft(tok[:, None], segment_ids=seg_active, cache=cache, layers=layers)
        return (shard_cache(cache, mesh), logits[:, 0]), (tok, q)

    (cache, last), (tokens, qs) = jax.lax.scan(step, (cache, last), jnp.arange(k - 1))
    tok, q = propose(last, k - 1)
    tokens = jnp.concatenate([tokens, tok[None]], axis=0).transpose(1, 0)  # [B, k]
    qs = jnp.concatenate([qs, q[None]], axis=0).transpose(1, 0, 2)  # [B, k, V]
    return tokens, qs, cache


def _accept(logits, drafts, q, n_prop, key, temperature, top_k, top_p):
    """(accepted count a [B], the target's own next token [B]) from the target's logits [B, k+1, V] over the chunk
    [pending, d_1 .. d_k]. q: the draft's distributions [B, k, V], or None for point-mass ("ngram") drafts."""
    B, k = drafts.shape
    V = logits.shape[-1]
    p = probabilities(logits, temperature, top_k, top_p)  # [B, k+1, V]
    onehot = jax.nn.one_hot(drafts, V, dtype=jnp.float32)  # [B, k, V]
    q = onehot if q is None else q
    p_d = jnp.sum(p[:, :k] * onehot, -1)  # [B, k]: target probability of each draft token
    q_d = jnp.sum(q * onehot, -1)
    k_accept, k_next = jax.random.split(key)
    u = jax.random.uniform(k_accept, (B, k))
    greedy_ok = drafts == argmax_tokens(logits[:, :k])
    ok = jnp.where(temperature > 0, u * q_d < p_d, greedy_ok) & (jnp.arange(k)[None] < n_prop[:, None])
    a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # leading accepted run
    p_a = jnp.take_along_axis(p, a[:, None, None], axis=1)[:, 0]  # [B, V]
    q_a = jnp.take_along_axis(jnp.concatenate([q, jnp.zeros_like(q[:, :1])], 1), a[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_a - q_a, 0.0)
    rejected = a < n_prop
    dist = jnp.where(rejected[:, None] & (residual.sum(-1, keepdims=True) > 0), residual, p_a)
    drawn = jax.random.categorical(k_next, jnp.log(dist), axis=-1).astype(jnp.int32)
    greedy_next = argmax_tokens(jnp.take_along_axis(logits, a[:, None, None], axis=1)[:, 0])
    return a, jnp.where(temperature > 0, drawn, greedy_next)


_STATIC = ("graphdef", "draft_graphdef", "prompt_len", "max_new", "k", "num_samples", "return_logits", "mesh")


@functools.partial(jax.jit, static_argnames=(*_STATIC, "chunk", "cache_dtype"))
def speculative_start_jit(
    state,
    draft_state,
    tokens,
    lengths,
    sampling: BatchSampling,
    limit,
    until_passes,
    *,
    graphdef,
    draft_graphdef,
    prompt_len,
    chunk,
    max_new,
    k,
    num_samples,
    return_logits,
    cache_dtype,
    mesh=None,
) -> SpeculativeState:
    """Prefill the target (and the draft model), the first token, then speculative passes until every row has
    `limit` tokens or is done, or `until_passes` passes have run (a streaming caller's pause). draft_graphdef None
    means prompt-lookup drafting."""
    count_trace()
    model = nnx.merge(graphdef, state)
    c = model.config
    B0 = tokens.shape[0]
    B = B0 * num_samples
    total = prompt_len + max_new + k + 1  # a pass writes up to k + 1 tokens past the last emitted one
    target = shard_cache(init_cache(c, B0, total, cache_dtype, lookahead=k), mesh)
    target, first_logits = prefill(model, tokens, lengths, chunk, target, mesh)
    dcache = None
    if draft_graphdef is not None:
        draft = nnx.merge(draft_graphdef, draft_state)
        dcache = shard_cache(init_cache(draft.config, B0, total, cache_dtype, lookahead=k), mesh)
        dcache, _ = prefill(draft, tokens, lengths, chunk, dcache, mesh)
    if num_samples > 1:  # the prompts' K/V computed once, shared by the samples of each prompt
        target = shard_cache(target.repeat_rows(num_samples), mesh)
        first_logits = jnp.repeat(first_logits, num_samples, axis=0)
        tokens, lengths = jnp.repeat(tokens, num_samples, axis=0), jnp.repeat(lengths, num_samples, axis=0)
        if dcache is not None:
            dcache = shard_cache(dcache.repeat_rows(num_samples), mesh)

    width = max_new + k + 1
    first = sampling.draw(first_logits, jax.random.fold_in(sampling.key, 0))
    history = jnp.zeros((B, total), jnp.int32).at[:, :prompt_len].set(tokens)
    history = jax.vmap(lambda h, i, t: h.at[i].set(t))(history, lengths, first)
    out_logits = jnp.zeros((B, width, c.vocab_size) if return_logits else (0,), jnp.float32)
    if return_logits:
        out_logits = out_logits.at[:, 0].set(first_logits)
    start = SpeculativeState(
        passes=jnp.int32(0),
        target=target,
        draft=dcache,
        history=history,
        hist_len=lengths + 1,
        count=jnp.ones((B,), jnp.int32),
        done=sampling.stopped(first) | (limit <= 1),
        out=jnp.full((B, width), -1, jnp.int32).at[:, 0].set(first),
        out_logits=out_logits,
        # the prompt's K/V were computed once per prompt: counted on its first sample's row
        kv_computed=jnp.where(jnp.arange(B) % num_samples == 0, lengths, 0).astype(jnp.int32),
        proposed=jnp.zeros((B,), jnp.int32),
        accepted=jnp.zeros((B,), jnp.int32),
    )
    return _passes(
        model,
        draft_graphdef,
        draft_state,
        start,
        sampling,
        limit,
        until_passes,
        k=k,
        total=total,
        return_logits=return_logits,
        mesh=mesh,
    )


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("s",))
def speculative_resume_jit(
    state,
    draft_state,
    s,
    sampling: BatchSampling,
    limit,
    until_passes,
    *,
    graphdef,
    draft_graphdef,
    prompt_len,
    max_new,
    k,
    num_samples,
    return_logits,
    mesh=None,
) -> SpeculativeState:
    """Continue a paused speculative loop until `until_passes` passes (or every row is done)."""
    count_trace()
    model = nnx.merge(graphdef, state)
    total = prompt_len + max_new + k + 1
    return _passes(
        model,
        draft_graphdef,
        draft_state,
        s,
        sampling,
        limit,
        until_passes,
        k=k,
        total=total,
        return_logits=return_logits,
        mesh=mesh,
    )


def _passes(
    model,
    draft_graphdef,
    draft_state,
    start,
    sampling: BatchSampling,
    limit,
    until_passes,
    *,
    k,
    total,
    return_logits,
    mesh,
) -> SpeculativeState:
    """The speculative loop (see the module docstring) from `start` until done or `until_passes` passes."""
    B = start.count.shape[0]
    width = start.out.shape[1]
    layers = model.split_layers(fuse=mesh is None)
    draft = draft_layers = None
    if draft_graphdef is not None:
        draft = nnx.merge(draft_graphdef, draft_state)
        draft_layers = draft.split_layers(fuse=mesh is None)

    def cond(s: SpeculativeState):
        return ~jnp.all(s.done) & (s.passes < limit) & (s.passes < until_passes)

    def body(s: SpeculativeState) -> SpeculativeState:
        active = ~s.done
        key_pass = jax.random.fold_in(sampling.key, s.passes + 1)
        k_draft, k_accept = jax.random.split(key_pass)
        budget = jnp.clip(limit - s.count - 1, 0, k)  # proposals beyond max_new_tokens would be thrown away
        if draft is None:
            drafts, n_prop = ngram_proposals(s.history, s.hist_len, k)
            q, dcache = None, None
        else:
            drafts, q, dcache = _draft_proposals(
                draft, draft_layers, s.draft, s.history, s.hist_len, active, k, k_draft, sampling, mesh
            )
            n_prop = jnp.full((B,), k, jnp.int32)
        n_prop = jnp.where(active, jnp.minimum(n_prop, budget), 0)
        pending = jnp.take_along_axis(s.history, (s.hist_len - 1)[:, None], axis=1)  # [B, 1]
        chunk_tokens = jnp.concatenate([pending, drafts], axis=1)  # [B, k + 1]
        seg = ((jnp.arange(k + 1)[None] <= n_prop[:, None]) & active[:, None]).astype(jnp.int32)
        logits, target = model(chunk_tokens, segment_ids=seg, cache=s.target, layers=layers)
        a, nxt = _accept(logits, drafts, q, n_prop, k_accept, sampling.temperature, sampling.top_k, sampling.top_p)
        a = jnp.where(active, a, 0)
        # emitted: d_1 .. d_a, then the target's own token; cut at the first stop token and at max_new
        emitted = jnp.where(
            jnp.arange(k + 1)[None] < a[:, None], jnp.concatenate([drafts, drafts[:, :1]], 1), nxt[:, None]
        )  # [B, k + 1]
        m = jnp.minimum(a + 1, limit - s.count)
        is_stop = sampling.stopped(emitted) & (jnp.arange(k + 1)[None] < m[:, None])
        first_stop = jnp.argmax(is_stop, axis=1)
        stopped = jnp.any(is_stop, axis=1)
        m = jnp.where(stopped, jnp.minimum(m, first_stop + 1), m)
        m = jnp.where(active, m, 0)
        cols = s.count[:, None] + jnp.arange(k + 1)[None]
        cols = jnp.where(jnp.arange(k + 1)[None] < m[:, None], cols, width)  # past the end: dropped
        out = jax.vmap(lambda o, i, t: o.at[i].set(t, mode="drop"))(s.out, cols, emitted)
        out_logits = s.out_logits
        if return_logits:
            out_logits = jax.vmap(lambda o, i, x: o.at[i].set(x, mode="drop"))(out_logits, cols, logits)
        hcols = jnp.where(jnp.arange(k + 1)[None] < m[:, None], s.hist_len[:, None] + jnp.arange(k + 1), total)
        history = jax.vmap(lambda h, i, t: h.at[i].set(t, mode="drop"))(s.history, hcols, emitted)
        count = s.count + m
        done = s.done | stopped | (count >= limit)
        # the caches keep the pending token and the accepted drafts; the target's own token is the next pending one
        kept = s.hist_len + a  # = old cache length + 1 + a
        target = shard_cache(target.rollback(jnp.where(active, kept, target.lengths)), mesh)
        new = dataclasses.replace(
            s,
            passes=s.passes + 1,
            target=target,
            history=history,
            hist_len=s.hist_len + m,
            count=count,
            done=done,
            out=out,
            out_logits=out_logits,
            kv_computed=s.kv_computed + jnp.sum(seg, axis=1),
            proposed=s.proposed + n_prop,
            accepted=s.accepted + jnp.minimum(a, n_prop),
        )
        if draft is not None:
            new = dataclasses.replace(new, draft=shard_cache(dcache.rollback(jnp.minimum(kept, dcache.lengths)), mesh))
        return new

    end = jax.lax.while_loop(cond, body, start)
    if mesh is None:
        return end
    # the tokens and counts come back replicated, so every process of a multi-host run can read them
    rep = parallel.replicated(mesh)
    fields = ("passes", "count", "done", "out", "out_logits", "kv_computed", "proposed", "accepted")
    return dataclasses.replace(end, **{f: jax.lax.with_sharding_constraint(getattr(end, f), rep) for f in fields})


@dataclasses.dataclass
class SpeculativeLoop:
    """Speculative decoding as a `DecodeLoop` (causal_lm/decode/loop.py): a step is one draft-and-check pass, and
    `until` counts passes (a pass emits at least one token per running row, so `limit` passes always suffice)."""

    state: object  # the target's weights (nnx state)
    graphdef: object
    draft_graphdef: object  # None: prompt-lookup ("ngram") drafts
    draft_state: object
    prompt_rows: tuple  # (tokens [B, prompt bucket], lengths [B]) on the device
    sampling: BatchSampling
    limit: int  # max_new_tokens
    host: Callable
    static: dict
    k: int
    chunk: int
    cache_dtype: str | None
    first_pause: int = 0  # prefill and the first token only

    def _spec(self) -> dict:
        return dict(graphdef=self.graphdef, draft_graphdef=self.draft_graphdef, k=self.k, **self.static)

    def start(self, until: int) -> SpeculativeState:
        return speculative_start_jit(
            self.state,
            self.draft_state,
            *self.prompt_rows,
            self.sampling,
            self.host(np.int32(self.limit)),
            self.host(np.int32(until)),
            chunk=self.chunk,
            cache_dtype=self.cache_dtype,
            **self._spec(),
        )

    def resume(self, s: SpeculativeState, until: int) -> SpeculativeState:
        return speculative_resume_jit(
            self.state,
            self.draft_state,
            s,
            self.sampling,
            self.host(np.int32(self.limit)),
            self.host(np.int32(until)),
            **self._spec(),
        )

    def step(self, s: SpeculativeState) -> SpeculativeState:
        return self.resume(s, int(s.passes) + 1)

    def progress(self, s: SpeculativeState) -> Progress:
        return Progress(np.asarray(s.out), np.asarray(s.count), np.asarray(s.done), int(s.passes))
