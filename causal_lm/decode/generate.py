"""On-device generation: prefill (whole or chunked), then the whole decode loop in one jitted while_loop.

Prompts of different lengths are right-padded to a bucket length (a power of two), so a new prompt length
reuses the compiled program. Each row keeps its own length; rows stop independently at a stop token.

Sharded models run the same program: `generate` finds the mesh the weights are laid out on (or takes `mesh=`),
splits the prompts and the KV cache over its batch axes and the cached K/V heads over its tensor axis (the
partition rules of `causal_lm.parallel`), and returns the tokens replicated, so every host of a multi-host run
gets them.

Two paths share the loop and the sampling code and differ only in what they recompute:
  use_cache=True   prefill writes the prompt's K/V once; each step computes K/V for one new token.
  use_cache=False  each step runs the model over the whole sequence so far (every K/V recomputed).

`kv_computed` counts K/V vectors (per layer and KV head) for real tokens, the seed's unit: a 2-token prompt and
3 new tokens cost 2+3+4 = 9 without a cache and 2+1+1 = 4 with one.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from causal_lm import parallel
from causal_lm.decode.loop import Progress, drive
from causal_lm.decode.prefill import compile_count, count_trace, last_valid_logits, prefill, shard_cache
from causal_lm.decode.sampling import BatchSampling
from causal_lm.decode.speculative import SpeculativeLoop
from causal_lm.model.kv_cache import CACHE_DTYPES, init_cache, require_causal
from causal_lm.model.transformer import Decoder
from causal_lm.model.weights import check_weights

__all__ = ["GenerateError", "GenerateResult", "bucket_length", "compile_count", "generate"]


class GenerateError(ValueError):
    """Bad arguments to generate(), raised before anything runs."""


@dataclasses.dataclass
class GenerateResult:
    tokens: list  # per row: the generated ids, up to and including a stop token
    kv_computed: int  # K/V vectors computed for real tokens, per layer and KV head (all rows)
    kv_computed_per_row: list
    steps: int  # tokens emitted by the longest row (<= max_new_tokens)
    logits: np.ndarray | None = None  # [B, max_new_tokens, V] float32 when return_logits=True
    target_passes: int = 0  # forward passes of the model after prefill (one per token; speculative: one per check)
    draft_proposed: int = 0  # speculative decoding: draft tokens proposed, all rows together
    draft_accepted: int = 0  # ... and accepted
    draft_accepted_per_row: list = dataclasses.field(default_factory=list)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RecomputeState:
    """What the recompute path carries from step to step: the sequences so far and their lengths."""

    tokens: jax.Array  # [B, prompt bucket + new-token bucket] int32, right-padded
    lengths: jax.Array  # [B] int32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """The decode loop's carry."""

    step: jax.Array  # int32: tokens emitted so far (the next column of `out`)
    model_state: object  # the KVCache (cached path) or a RecomputeState
    token: jax.Array  # [B] int32: the last sampled token, the next step's input
    done: jax.Array  # [B] bool: the row emitted a stop token
    out: jax.Array  # [B, new-token bucket] int32, -1 after a row's stop or past max_new_tokens
    out_logits: jax.Array  # [B, new-token bucket, V] float32 with return_logits, else [0]
    kv_computed: jax.Array  # [B] int32


def bucket_length(n: int, minimum: int = 8) -> int:
    """Smallest power of two >= n (at least `minimum`)."""
    b = minimum
    while b < n:
        b *= 2
    return b


_STATIC = ("graphdef", "prompt_len", "max_new", "use_cache", "return_logits", "num_samples", "mesh")


def _advance_fn(model, use_cache: bool, total: int, mesh, rows: int):
    """The loop's model step: (state, tokens [B], active [B]) -> (logits [B, V], state, K/V computed per row)."""
    if use_cache:
        # Each layer's weights sliced out of the stacked arrays once per program: the loop's steps then read them
        # in place instead of copying every layer's weights out of the stack at every step.
        layers = model.split_layers(fuse=mesh is None, rows=rows)  # one token a row: `rows` rows a product

        def advance(cache, tok, active):
            """One token per active row through the cache."""
            seg = active[:, None].astype(jnp.int32)
            logits, cache = model(tok[:, None], segment_ids=seg, cache=cache, layers=layers)
            return logits[:, 0], shard_cache(cache, mesh), active.astype(jnp.int32)

        return advance

    def advance(rs: RecomputeState, tok, active):
        """Append each active row's token and recompute every row's whole sequence (every K/V again)."""
        col = jnp.where(active, rs.lengths, total)  # finished rows: dropped
        buf = jax.vmap(lambda row, i, t: row.at[i].set(t, mode="drop"))(rs.tokens, col, tok)
        rs = RecomputeState(buf, rs.lengths + active.astype(jnp.int32))
        return _recompute_logits(model, rs), rs, jnp.where(active, rs.lengths, 0)

    return advance


def _recompute_logits(model, rs: RecomputeState):
    """The model over every row's whole sequence so far: logits [B, V] at each row's last token."""
    positions = jnp.arange(rs.tokens.shape[1], dtype=jnp.int32)
    seg = (positions[None, :] < rs.lengths[:, None]).astype(jnp.int32)
    logits, _ = model(rs.tokens, segment_ids=seg)
    return last_valid_logits(logits, rs.lengths - 1)


def _run(
    model, s: DecodeState, sampling: BatchSampling, until, *, use_cache, total, return_logits, mesh
) -> DecodeState:
    """Decode until every row is done or `until` tokens are out (a traced count: max_new_tokens, or where a
    streaming caller pauses to show what came so far)."""
    advance = _advance_fn(model, use_cache, total, mesh, s.token.shape[0])

    def cond(s: DecodeState):
        return (s.step < until) & ~jnp.all(s.done)

    def body(s: DecodeState) -> DecodeState:
        active = ~s.done
        logits, model_state, kv_step = advance(s.model_state, s.token, active)
        new_tok = sampling.at_step(logits, s.step)
        new_tok = jnp.where(s.done, s.token, new_tok)
        s = dataclasses.replace(s, model_state=model_state, kv_computed=s.kv_computed + kv_step)
        return _emit(s, new_tok, logits, sampling, return_logits)

    return jax.lax.while_loop(cond, body, s)


def _emit(s: DecodeState, tok, logits, sampling: BatchSampling, return_logits: bool) -> DecodeState:
    """Record the step's token (-1 for rows already finished) and, when asked, its logits."""
    out_logits = s.out_logits.at[:, s.step].set(logits) if return_logits else s.out_logits
    done = s.done | sampling.stopped(tok)
    shown = jnp.where(s.done, -1, tok)
    return dataclasses.replace(
        s, step=s.step + 1, token=tok, done=done, out=s.out.at[:, s.step].set(shown), out_logits=out_logits
    )


def _replicate_out(s: DecodeState, mesh) -> DecodeState:
    """On a mesh, the tokens and logits come back replicated, so every process of a multi-host run can read them."""
    if mesh is None:
        return s
    rep = parallel.replicated(mesh)
    return dataclasses.replace(
        s,
        out=jax.lax.with_sharding_constraint(s.out, rep),
        out_logits=jax.lax.with_sharding_constraint(s.out_logits, rep),
        kv_computed=jax.lax.with_sharding_constraint(s.kv_computed, rep),
        step=jax.lax.with_sharding_constraint(s.step, rep),
        done=jax.lax.with_sharding_constraint(s.done, rep),
    )


@functools.partial(jax.jit, static_argnames=(*_STATIC, "chunk", "cache_dtype"))
def _start_jit(
    state,
    tokens,
    lengths,
    sampling: BatchSampling,
    until,
    *,
    graphdef,
    prompt_len,
    chunk,
    max_new,
    use_cache,
    return_logits,
    cache_dtype,
    num_samples=1,
    mesh=None,
) -> DecodeState:
    """Prefill (or the first recompute), the first token, then decode until `until` tokens are out."""
    count_trace()
    model = nnx.merge(graphdef, state)
    c = model.config
    B = tokens.shape[0] * num_samples
    total = prompt_len + max_new
    # the prompt: computed once per prompt on the cached path (counted on its first sample's row)
    first_sample = (jnp.arange(B) % num_samples == 0) | (not use_cache)
    if use_cache:
        cache = shard_cache(init_cache(c, tokens.shape[0], total, cache_dtype), mesh)
        model_state, first_logits = prefill(model, tokens, lengths, chunk, cache, mesh)
        if num_samples > 1:  # the prompts' K/V computed once, shared by the samples of each prompt
            model_state = shard_cache(model_state.repeat_rows(num_samples), mesh)
            first_logits = jnp.repeat(first_logits, num_samples, axis=0)
            lengths = jnp.repeat(lengths, num_samples, axis=0)
    else:
        if num_samples > 1:  # nothing to share without a cache: every sample recomputes its prompt
            tokens, lengths = jnp.repeat(tokens, num_samples, axis=0), jnp.repeat(lengths, num_samples, axis=0)
        model_state = RecomputeState(jnp.zeros((B, total), jnp.int32).at[:, :prompt_len].set(tokens), lengths)
        first_logits = _recompute_logits(model, model_state)
    tok = sampling.at_step(first_logits, 0)
    start = DecodeState(
        step=jnp.int32(0),
        model_state=model_state,
        token=tok,
        done=jnp.zeros((B,), bool),
        out=jnp.full((B, max_new), -1, jnp.int32),
        out_logits=jnp.zeros((B, max_new, c.vocab_size) if return_logits else (0,), jnp.float32),
        kv_computed=jnp.where(first_sample, lengths, 0).astype(jnp.int32),
    )
    start = _emit(start, tok, first_logits, sampling, return_logits)
    end = _run(
        model,
        start,
        sampling,
        until,
        use_cache=use_cache,
        total=total,
        return_logits=return_logits,
        mesh=mesh,
    )
    return _replicate_out(end, mesh)


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("s",))
def _resume_jit(
    state,
    s,
    sampling: BatchSampling,
    until,
    *,
    graphdef,
    prompt_len,
    max_new,
    use_cache,
    return_logits,
    num_samples=1,
    mesh=None,
) -> DecodeState:
    """Continue a paused decode (a streaming caller showed what came so far) until `until` tokens are out."""
    count_trace()
    model = nnx.merge(graphdef, state)
    end = _run(
        model,
        s,
        sampling,
        until,
        use_cache=use_cache,
        total=prompt_len + max_new,
        return_logits=return_logits,
        mesh=mesh,
    )
    return _replicate_out(end, mesh)


@functools.lru_cache(maxsize=4)
def _replicated_key(mesh):
    """jax.random.key(seed) made on every device of `mesh` (the same key as on one device)."""
    return jax.jit(jax.random.key, out_shardings=parallel.replicated(mesh))


def _check_prompts(prompts, vocab_size: int) -> list:
    if isinstance(prompts, np.ndarray):
        prompts = prompts.tolist()
    if not isinstance(prompts, list | tuple) or not prompts:
        raise GenerateError("prompts must be a non-empty list of token-id lists")
    if isinstance(prompts[0], int | np.integer):
        raise GenerateError("prompts must be a list of token-id lists (wrap a single prompt in a list)")
    lens = [len(p) for p in prompts]
    if min(lens) == 0:
        raise GenerateError(f"prompt {lens.index(0)} is empty: generation needs at least one token to condition on")
    for r, p in enumerate(prompts):
        arr = np.asarray(p)
        if not np.issubdtype(arr.dtype, np.integer):
            raise GenerateError(f"prompt {r} holds non-integer values")
        if arr.min() < 0 or arr.max() >= vocab_size:
            bad = int(arr[(arr < 0) | (arr >= vocab_size)][0])
            raise GenerateError(f"prompt {r} has token id {bad} outside the vocabulary [0, {vocab_size})")
    return prompts


def _check_sampling(temperature, top_k, top_p) -> None:
    """NaN and infinity pass `< 0`-style checks silently (every comparison with NaN is False): test finiteness."""
    if isinstance(temperature, bool) or not isinstance(temperature, int | float | np.number):
        raise GenerateError(f"temperature must be a number >= 0, got {temperature!r}")
    if not math.isfinite(temperature) or temperature < 0:
        raise GenerateError(f"temperature must be a finite number >= 0, got {temperature}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int | np.integer) or top_k < 1):
        raise GenerateError(f"top_k must be an integer >= 1 or None, got {top_k!r}")
    if top_p is not None:
        if isinstance(top_p, bool) or not isinstance(top_p, int | float | np.number):
            raise GenerateError(f"top_p must be a number in (0, 1] or None, got {top_p!r}")
        if not math.isfinite(top_p) or not 0.0 < top_p <= 1.0:
            raise GenerateError(f"top_p must be a finite number in (0, 1] or None, got {top_p}")


def generate(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    use_cache: bool = True,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    chunk_size: int | None = None,
    stop_tokens: Sequence[int] = (),
    return_logits: bool = False,
    cache_dtype: str | None = None,
    on_step: Callable[[int, np.ndarray], None] | None = None,
    speculative=None,
    draft_tokens: int = 4,
    num_samples: int = 1,
    max_new_bucket: int | None = None,
    mesh=None,
    check_finite: bool = True,
) -> GenerateResult:
    """Generate up to `max_new_tokens` for each prompt (lists of token ids, any lengths) on the device.

    chunk_size: prefill the prompts in chunks of this many tokens (default: one chunk). on_step(step, tokens[B])
    is called on the host as tokens are produced (-1 for finished rows), for streaming: the loop shows the first
    token as soon as it exists, then pauses every few tokens to hand over the new ones.
    cache_dtype: the KV cache's storage type (see `init_cache`): float32, bfloat16, float16, int8, float8_e4m3fn.
    speculative: None, "ngram" (prompt-lookup drafts) or a draft model with the same vocabulary; the target checks
    up to `draft_tokens` proposals per forward pass (see `causal_lm.decode.speculative`). Greedy output is the
    same as without it; sampled output has the same distribution.
    max_new_bucket: the room for new tokens the program is compiled for (default: max_new_tokens rounded up to a
    power of two, at least 16, on the cached path): calls whose prompts share a bucket and whose max_new_tokens
    share this one reuse one compiled program; the loop still stops at max_new_tokens.
    num_samples: n continuations per prompt, rows ordered prompt-major (prompt 0's samples first). Each prompt is
    prefilled once and its cached K/V shared by its samples. Seed policy: the rows draw exactly what a batch of n
    copies of each prompt (in that order) draws with the same seed.
    mesh: run on this `causal_lm.parallel` mesh (weights placed by the partition rules if they are not on it
    already). Default: the mesh the model's weights are laid out on, if any, else one device.
    check_finite: refuse (WeightError, before anything runs) a model or draft whose parameters hold NaN or
    infinity, naming the parameter; False: warn once and go on. Each array is reduced once, not per call.
    """
    c = model.config
    prompts = _check_prompts(prompts, c.vocab_size)
    lens = [len(p) for p in prompts]
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int | np.integer) or max_new_tokens < 1:
        raise GenerateError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if max(lens) + max_new_tokens > c.max_seq_len:
        raise GenerateError(
            f"prompt length {max(lens)} + max_new_tokens {max_new_tokens} = "
            f"{max(lens) + max_new_tokens} exceeds model.max_seq_len={c.max_seq_len}"
        )
    _check_sampling(temperature, top_k, top_p)
    if chunk_size is not None and (not isinstance(chunk_size, int | np.integer) or chunk_size < 1):
        raise GenerateError(f"chunk_size must be an integer >= 1 or None, got {chunk_size!r}")
    if cache_dtype is not None and cache_dtype not in CACHE_DTYPES:
        raise GenerateError(f"cache_dtype must be one of {tuple(CACHE_DTYPES)} or None, got {cache_dtype!r}")
    if isinstance(num_samples, bool) or not isinstance(num_samples, int | np.integer) or num_samples < 1:
        raise GenerateError(f"num_samples must be a positive integer, got {num_samples!r}")
    draft = _check_speculative(speculative, draft_tokens, c, use_cache, max(lens) + max_new_tokens)
    # The recompute path's every step runs over the whole buffer, so it is not padded beyond what was asked.
    new_bucket = int(max_new_bucket or (bucket_length(max_new_tokens, 16) if use_cache else max_new_tokens))
    if new_bucket < max_new_tokens:
        raise GenerateError(f"max_new_bucket={max_new_bucket} is smaller than max_new_tokens={max_new_tokens}")
    if use_cache:
        require_causal(c)

    prompt_len = bucket_length(max(lens))
    chunk = prompt_len if chunk_size is None else int(chunk_size)
    prompt_len = -(-prompt_len // chunk) * chunk  # whole chunks
    tokens = np.zeros((len(prompts), prompt_len), np.int32)
    for r, p in enumerate(prompts):
        tokens[r, : len(p)] = p
    sampling = BatchSampling.make(seed, temperature, top_k, top_p, stop_tokens)

    graphdef, state = nnx.split(model)
    check_weights(state, warn=not check_finite)
    draft_graphdef = draft_state = None
    if isinstance(draft, Decoder):
        draft_graphdef, draft_state = nnx.split(draft)
        check_weights(draft_state, what="the draft model", warn=not check_finite)
    if mesh is None:
        mesh = parallel.mesh_of(state)
    if mesh is None:
        prompt_rows = (jnp.asarray(tokens), jnp.asarray(lens, jnp.int32))
        sampling = dataclasses.replace(jax.tree.map(jnp.asarray, sampling), key=jax.random.key(seed))
    else:
        if parallel.mesh_of(state) != mesh:
            state = parallel.shard_tree(state, parallel.tree_shardings(state, mesh))
        if draft_state is not None and parallel.mesh_of(draft_state) != mesh:
            draft_state = parallel.shard_tree(draft_state, parallel.tree_shardings(draft_state, mesh))
        # Built from host values on every process (arrays of one process's device cannot join a global jit).
        rows = parallel.shard_global_batch({"tokens": tokens, "lengths": np.asarray(lens, np.int32)}, mesh)
        key = _replicated_key(mesh)(parallel.replicate(np.uint32(seed), mesh))
        prompt_rows = (rows["tokens"], rows["lengths"])
        sampling = dataclasses.replace(jax.tree.map(lambda a: parallel.replicate(a, mesh), sampling), key=key)
    static = dict(
        prompt_len=prompt_len, max_new=new_bucket, return_logits=return_logits, num_samples=int(num_samples), mesh=mesh
    )
    host = (lambda x: x) if mesh is None else (lambda x: parallel.replicate(x, mesh))
    loop_args = dict(
        state=state, prompt_rows=prompt_rows, sampling=sampling, limit=int(max_new_tokens), host=host, static=static
    )
    if draft is None:
        loop = PlainLoop(graphdef=graphdef, use_cache=use_cache, chunk=chunk, cache_dtype=cache_dtype, **loop_args)
    else:
        loop = SpeculativeLoop(
            graphdef=graphdef,
            draft_graphdef=draft_graphdef,
            draft_state=draft_state,
            k=int(draft_tokens),
            chunk=chunk,
            cache_dtype=cache_dtype,
            **loop_args,
        )
    end = drive(loop, on_step)
    out = np.asarray(end.out)
    rows = [[int(t) for t in row[:max_new_tokens] if t >= 0] for row in out]
    steps = max(len(r) for r in rows)
    kv = [int(x) for x in np.asarray(end.kv_computed)]
    speculative_run = draft is not None
    accepted = np.asarray(end.accepted) if speculative_run else np.zeros(len(rows), np.int64)
    return GenerateResult(
        tokens=rows,
        kv_computed=sum(kv),
        kv_computed_per_row=kv,
        steps=steps,
        logits=np.asarray(end.out_logits)[:, :steps] if return_logits else None,
        target_passes=int(end.passes) if speculative_run else int(end.step) - 1,
        draft_proposed=int(np.sum(end.proposed)) if speculative_run else 0,
        draft_accepted=int(np.sum(accepted)),
        draft_accepted_per_row=[int(x) for x in accepted],
    )


@dataclasses.dataclass
class PlainLoop:
    """Plain decoding as a `DecodeLoop` (causal_lm/decode/loop.py): one token per row per step, counted in tokens."""

    state: object  # the model's weights (nnx state)
    graphdef: object
    prompt_rows: tuple  # (tokens [B, prompt bucket], lengths [B]) on the device
    sampling: BatchSampling
    limit: int  # max_new_tokens
    host: Callable  # host value -> an argument the programs accept (replicated on a mesh)
    static: dict  # the programs' static arguments shared by start and resume
    use_cache: bool
    chunk: int
    cache_dtype: str | None
    first_pause: int = 1

    def start(self, until: int) -> DecodeState:
        return _start_jit(
            self.state,
            *self.prompt_rows,
            self.sampling,
            self.host(np.int32(until)),
            graphdef=self.graphdef,
            use_cache=self.use_cache,
            chunk=self.chunk,
            cache_dtype=self.cache_dtype,
            **self.static,
        )

    def resume(self, s: DecodeState, until: int) -> DecodeState:
        return _resume_jit(
            self.state,
            s,
            self.sampling,
            self.host(np.int32(until)),
            graphdef=self.graphdef,
            use_cache=self.use_cache,
            **self.static,
        )

    def step(self, s: DecodeState) -> DecodeState:
        return self.resume(s, int(s.step) + 1)

    def progress(self, s: DecodeState) -> Progress:
        step, done = int(s.step), np.asarray(s.done)
        return Progress(np.asarray(s.out), np.full(done.shape, step), done, step)


def _check_speculative(speculative, draft_tokens, config, use_cache: bool, longest: int):
    """None (no speculation), "ngram", or the draft model; errors for anything else."""
    if speculative is None:
        return None
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int | np.integer) or not 1 <= draft_tokens <= 16:
        raise GenerateError(f"draft_tokens must be an integer in [1, 16], got {draft_tokens!r}")
    if not use_cache:
        raise GenerateError("speculative decoding checks drafts through the KV cache: it needs use_cache=True")
    if isinstance(speculative, str):
        if speculative != "ngram":
            raise GenerateError(f"speculative must be None, 'ngram' or a draft model, got {speculative!r}")
        return "ngram"
    if not isinstance(speculative, Decoder):
        raise GenerateError(f"speculative must be None, 'ngram' or a draft model, got {type(speculative).__name__}")
    d = speculative.config
    if d.vocab_size != config.vocab_size:
        raise GenerateError(
            f"the draft model's vocabulary ({d.vocab_size} ids) differs from the target's ({config.vocab_size}): "
            "its proposals would be other tokens"
        )
    if d.attention_mask != "causal":
        raise GenerateError("the draft model decodes through its own KV cache: it needs attention_mask='causal'")
    if longest > d.max_seq_len:  # (drafts past the last token are generated but never used)
        raise GenerateError(
            f"the draft model's max_seq_len={d.max_seq_len} is shorter than prompt + max_new_tokens = {longest}"
        )
    return speculative
