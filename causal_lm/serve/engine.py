"""The serving engine: continuous batching over a paged KV cache, exact per request.

    engine = Engine(model, max_seqs=8, page_size=16, num_pages=256, max_step_tokens=64)
    rid = engine.submit([3, 14, 15], max_tokens=20, temperature=0.0, logprobs=5)
    while engine.has_work():
        for event in engine.step(): ...            # new tokens (with logprobs) and finish reasons
    engine.run([dict(prompt_ids=[1, 2], max_tokens=8), ...])   # -> one RequestResult per request, in order

Each `step()` is one jitted program over the running sequences: every decoding sequence feeds its last token, and
sequences still reading their prompt feed a chunk of it, under a budget of `max_step_tokens` tokens (chunked
prefill). The program runs the unchanged model over a `PagedKVCache` view (causal_lm/model/paged_cache.py) and
samples each row with its own settings and key (`SamplingParams`). A request leaves the batch the step it
finishes or is cancelled, and its pages go back at once.

Exactness. A token's K/V under the causal mask depend on it and the tokens before it only, and each row's mask is
built from its own slots' positions, so a request's greedy tokens are those of `generate` of its prompt alone
(tests/test_engine.py checks it under churn: arrivals, cancellations, preemption, page sizes, every cache layout).
Sampling draws the n-th token of a request with fold_in(key(seed), n): the same tokens alone or in a busy batch.
`submit_samples(prompt, num_samples=n)` (or a `run` dict with num_samples) is n requests with seeds seed .. seed+n-1
that share the prompt: the first computes it, the others wait for it, then hold its full pages (refcounted).

Pages per layer group. Each layer group of the model (the layers of one sliding window, or the global layers) has
its own pages, page table per sequence and PageBook: a page of a group holds only that group's layers. A sequence's
tables have the same columns in every group; a local group gives back the pages wholly before the window of the
row's next query (the column stays, with no page), a global group keeps them. Growing, admission, preemption and
"can never fit" are checked group by group (`group_pages_needed`); a prefix hit needs its pages in every group
(in a local group only those not before the window of its first computed token).

Scheduler (host, each step):
  1. running sequences, oldest first: each feeds min(uncomputed tokens, budget left, largest token bucket) tokens;
     a sequence that needs a page when none is available (free, or cached and unreferenced) preempts the newest
     running sequence (its pages are released; it returns to the front of the queue and later recomputes its
     prompt and the tokens it already emitted, as prompt: nothing is sampled twice).
  2. waiting requests, first come first served, while a row, budget and pages for their first chunk remain; a
     prompt whose leading full pages are in the prefix cache holds those pages instead of computing them (at most
     (len - 1) // page_size pages: the last token is always computed, its logits give the first new token).
A step runs its decoding rows (one token each) as one call of the step program and its prompt chunks as calls
grouped by token bucket, each padded to its (rows, tokens, table width) bucket; kept apart, no decoding row pays for
a chunk's length and no short chunk for a long one. A chunk whose bucket would be mostly padding is cut to the
largest bucket it fills (the rest follows next step): a call's cost is its padded tokens. Logits are
projected at each row's last fed token only (all of them only for a request that asked for prompt logprobs).
Decode bursts. When every row of a step is decoding (no prompt chunk), the step runs up to `burst_steps` decode
steps in one dispatch: an on-device loop feeds each row's last token, draws the next exactly as a one-token step
(the same function, key fold_in(seed, n) for the row's n-th token), and stops a row at a stop id or its
max_tokens; the host books the tokens afterwards, step by step (events in that order), dropping any after a row's
end, and gives back its pages. Pages for the slots of the tokens a row may feed are allocated before dispatch
(only as many steps as the free pages cover; else a one-token step, which may preempt). The host's work per token
(building the batch, dispatch, reading back) is paid once per burst. Latency: a new request waits for at most one
burst before its prompt is fed (a step with a prompt chunk never bursts), and while requests wait a burst stops
where the first row reaches max_tokens, so a row frees its place the step it would without bursts (a stop id
mid-burst frees it at the burst's end). `step(max_burst=n)` caps a burst (EngineLoop's streaming pauses).
Weights per call: a call of at most matvec.MAX_ROWS (16) token slots (decoding rows and bursts of up to 16 rows, a
short chunk) runs every weight product through the C++ decode kernels, on the decode form in their tiles
(`Decoder.split_layers(rows=16)`); a larger call runs XLA's products on the model's own stacked weights, which it
multiplies faster than tiles. One decode copy of the weights, as before, and a tiled copy of a tied float32 head
(113 MB on the 135M shape; docs/performance.md measures both forms).
Compiled programs: one per (rows, tokens, table width) bucket met, at most len(batch_buckets) x len(token_buckets)
x len(width_buckets) (x 2 with prompt logprobs), and a burst program per (rows, table width) (its step count is
traced); by default rows 1, 2, 4, ... max_seqs, tokens 1, 4, 16, ...
max_step_tokens and table widths (pages) doubling from 256 tokens' worth up to max_seq_len's. A row's table is cut
to the call's width, so attention reads (and the view gathers) the pages the rows hold, not max_seq_len slots.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from causal_lm.decode.sampling import SamplingParams
from causal_lm.model import matvec
from causal_lm.model.paged_cache import PagePool, init_pool, layer_groups, page_bytes, pages_for
from causal_lm.serve.pages import PageBook

MAX_LOGPROBS = 20  # top alternatives a request may ask for per generated token

_traces = 0  # engine step programs traced in this process


class EngineError(ValueError):
    """Bad arguments to the engine or to a request, raised before anything runs."""


@dataclasses.dataclass(frozen=True)
class Event:
    """What one step reports for a request: a new token (with its log-probability and, when asked, the top
    alternatives as (id, logprob) pairs, most likely first), and/or that the request finished and why."""

    request_id: int
    token: int | None = None
    logprob: float | None = None
    top_logprobs: tuple | None = None
    finish_reason: str | None = None  # "stop" (a stop id was emitted), "length" (max_tokens), "cancelled"
    sample_logprob: float | None = None  # the token under the distribution it was drawn from (see RequestResult)


@dataclasses.dataclass
class RequestResult:
    """A request's output. logprobs[i] is the log-probability of tokens[i] under the model (log_softmax of its float32
    logits, before temperature, top-k and top-p); top_logprobs[i] its top alternatives when asked; prompt_logprobs
    (when asked) one entry per prompt token, the first None (it has no context). sample_logprobs[i] is tokens[i]'s
    log-probability under the distribution it was drawn from (temperature-scaled, truncated by top-k/top-p:
    `causal_lm.decode.sampling.sampled_logprobs`; greedy: the model's own), what RL's importance ratio needs."""

    request_id: int
    prompt: list
    tokens: list
    logprobs: list
    top_logprobs: list
    prompt_logprobs: list | None
    finish_reason: str | None  # None while running or waiting
    sample_logprobs: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class _Sequence:
    """A request's host state."""

    rid: int
    prompt: list
    max_tokens: int
    temperature: float
    top_k: int | None
    top_p: float | None
    seed: int
    stop: tuple
    logprobs: int
    want_prompt_logprobs: bool
    tokens: list  # prompt + generated
    generated: list = dataclasses.field(default_factory=list)
    token_logprobs: list = dataclasses.field(default_factory=list)
    token_sample_logprobs: list = dataclasses.field(default_factory=list)
    top: list = dataclasses.field(default_factory=list)
    prompt_lp: list = dataclasses.field(default_factory=lambda: [None])
    pages: list = dataclasses.field(default_factory=list)  # per layer group, its page table: page j holds j*ps ..
    computed: int = 0  # tokens whose K/V are in the pages
    keys: list = dataclasses.field(default_factory=list)  # prefix keys of pages 0 .. registered-1
    finish_reason: str | None = None
    leader: _Sequence | None = None  # num_samples > 1: the sample that computes the shared prompt


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    """One step's rows (right-padded to the bucket)."""

    tokens: jax.Array  # [B, T] int32
    n_valid: jax.Array  # [B] int32: real tokens of each row (0: a padding row)
    lengths: jax.Array  # [B] int32: tokens already cached
    table: jax.Array  # [G, B, NP] int32 each layer group's page tables (>= the group's num_pages: none)
    fresh: jax.Array  # [G, F] int32 pages of each group handed to a new owner since the last step (none: as above)
    targets: jax.Array  # [B, T] int32: the token after each fed token (-1: none), for prompt logprobs
    index: jax.Array  # [B] int32: each row's count of tokens sampled so far (its key's fold_in)
    sampling: SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutput:
    token: jax.Array  # [B] int32 sampled at each row's last fed token
    logprob: jax.Array  # [B] float32 its log-probability
    sample_logprob: jax.Array  # [B] float32 its log-probability under the (filtered) distribution it was drawn from
    top_ids: jax.Array  # [B, k] int32, most likely first
    top_logprobs: jax.Array  # [B, k] float32
    target_logprobs: jax.Array  # [B, T] float32: log-probability of `targets` after each fed token
    stopped: jax.Array  # [B] bool: the sampled token is one of the row's stop ids


@functools.partial(jax.jit, static_argnames=("graphdef", "all_logits", "invariant"), donate_argnames=("pool",))
def _step_program(state, layers, pool: PagePool, batch: StepBatch, *, graphdef, all_logits: bool, invariant=False):
    """The model over one call's rows through their page tables, then each row's next token and log-probabilities.
    Logits are projected at each row's last fed token only, unless `all_logits` (a row is scoring its prompt).
    invariant: the model's batch-invariant scoring mode and sample_logprob one row at a time (Engine's
    batch_invariant)."""
    global _traces
    _traces += 1
    model = nnx.merge(graphdef, state)
    B, T = batch.tokens.shape
    cache = pool.view(batch.table, batch.lengths, batch.fresh)
    segment = (jnp.arange(T, dtype=jnp.int32)[None, :] < batch.n_valid[:, None]).astype(jnp.int32)
    last = jnp.clip(batch.n_valid - 1, 0, T - 1)
    if all_logits:
        out = model.forward(batch.tokens, segment_ids=segment, cache=cache, layers=layers, batch_invariant=invariant)
        logits, cache = out.logits, out.cache  # [B, T, V] float32
        logp_all = jax.nn.log_softmax(logits, axis=-1)
        target = jnp.take_along_axis(logp_all, jnp.maximum(batch.targets, 0)[..., None], axis=-1)[..., 0]
        target_logprobs = jnp.where(batch.targets >= 0, target, 0.0)
        last_logits = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]  # [B, V]
    else:
        out = model.forward(
            batch.tokens,
            segment_ids=segment,
            cache=cache,
            logits_at=last[:, None],
            layers=layers,
            batch_invariant=invariant,
        )
        last_logits, cache = out.logits[:, 0], out.cache
        target_logprobs = jnp.zeros((B, T), jnp.float32)
    return cache.pool, _draw(last_logits, batch.sampling, batch.index, target_logprobs, invariant)


def _draw(last_logits, sampling: SamplingParams, index, target_logprobs, invariant=False) -> StepOutput:
    """Each row's next token from its last fed token's logits [B, V] (its own settings, key fold_in(seed, index)),
    its log-probabilities and top alternatives: one function for the one-step and the burst programs."""
    logp = jax.nn.log_softmax(last_logits, axis=-1)
    token = sampling.sample(last_logits, index)
    top_logprobs, top_ids = jax.lax.top_k(logp, min(MAX_LOGPROBS, logp.shape[-1]))
    return StepOutput(
        token=token,
        logprob=jnp.take_along_axis(logp, token[:, None], axis=1)[:, 0],
        sample_logprob=sampling.logprob(last_logits, token, invariant),
        top_ids=top_ids.astype(jnp.int32),
        top_logprobs=top_logprobs,
        target_logprobs=target_logprobs,
        stopped=sampling.stopped(token),
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BurstBatch:
    """A burst's rows (right-padded to the bucket): every row decoding, one token per step for up to `steps` steps."""

    token: jax.Array  # [B] int32: each row's last token (its only uncomputed one)
    limit: jax.Array  # [B] int32: tokens the row may emit in this burst (its pages reach that far; 0: a padding row)
    lengths: jax.Array  # [B] int32: tokens already cached
    table: jax.Array  # [G, B, NP] int32 as StepBatch's
    fresh: jax.Array  # [G, F] int32 as StepBatch's
    index: jax.Array  # [B] int32: each row's count of tokens sampled before the burst
    steps: jax.Array  # [] int32: decode steps to run (at most the program's max_steps)
    sampling: SamplingParams


@functools.partial(jax.jit, static_argnames=("graphdef", "max_steps", "invariant"), donate_argnames=("pool",))
def _burst_program(state, layers, pool: PagePool, batch: BurstBatch, *, graphdef, max_steps: int, invariant=False):
    """Up to `batch.steps` decode steps in one on-device loop: each step feeds every live row's last token, draws
    its next one exactly as `_step_program` does (`_draw`, key index + step), and stops a row once it emitted a stop
    id or its `limit`; the loop ends early when no row is live. Returns the pool, the steps run and the StepOutput
    of each step stacked [max_steps, B, ...] (a row's entries after it stopped are not tokens: the host drops
    them). The number of steps is traced: one program per (rows, table width) bucket, whatever the burst's length."""
    global _traces
    _traces += 1
    model = nnx.merge(graphdef, state)
    B = batch.token.shape[0]
    cache = pool.view(batch.table, batch.lengths, batch.fresh)
    at = jnp.zeros((B, 1), jnp.int32)
    no_targets = jnp.zeros((B, 1), jnp.float32)

    def one(cache, token, alive, i):
        seg = alive[:, None].astype(jnp.int32)  # a stopped row feeds nothing: no K/V written, length unchanged
        out = model.forward(
            token[:, None], segment_ids=seg, cache=cache, logits_at=at, layers=layers, batch_invariant=invariant
        )
        return out.cache, _draw(out.logits[:, 0], batch.sampling, batch.index + i, no_targets, invariant)

    K, top = max_steps, min(MAX_LOGPROBS, model.config.vocab_size)
    f32 = functools.partial(jnp.zeros, dtype=jnp.float32)
    i32 = functools.partial(jnp.zeros, dtype=jnp.int32)
    no = jnp.zeros((K, B), bool)
    outs = StepOutput(i32((K, B)), f32((K, B)), f32((K, B)), i32((K, B, top)), f32((K, B, top)), f32((K, B, 1)), no)

    def cond(carry):
        i, _, _, alive, _ = carry
        return (i < batch.steps) & jnp.any(alive)

    def body(carry):
        i, cache, token, alive, outs = carry
        cache, out = one(cache, token, alive, i)
        outs = jax.tree.map(lambda buf, x: buf.at[i].set(x), outs, out)
        token = jnp.where(alive, out.token, token)
        alive = alive & ~out.stopped & (i + 1 < batch.limit)
        return i + 1, cache, token, alive, outs

    carry = (jnp.int32(0), cache, batch.token, batch.limit > 0, outs)
    ran, cache, _, _, outs = jax.lax.while_loop(cond, body, carry)
    return cache.pool, ran, outs


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(size) -> int:
    """'1GiB', '512MiB', '2GB', or an integer number of bytes -> bytes."""
    if isinstance(size, int | np.integer) and not isinstance(size, bool):
        return int(size)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(size))
    if m is None or m.group(2).lower() not in _UNITS:
        raise EngineError(f"kv_memory must be a size such as '1GiB', '512MiB' or a number of bytes, got {size!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _powers(base: int, limit: int) -> tuple:
    """1, base, base**2, ... below limit, then limit."""
    out, b = [], 1
    while b < limit:
        out.append(b)
        b *= base
    return tuple(out) + (limit,)


def _positive_int(name, v, minimum=1):
    if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < minimum:
        raise EngineError(f"{name} must be an integer >= {minimum}, got {v!r}")
    return int(v)


class Engine:
    """Continuous batching over a paged KV cache (see the module docstring).

    max_seqs: rows running at once. page_size: slots per page. kv_memory ("1GiB", "512MiB", bytes) or num_pages:
    the pool's size. max_step_tokens: tokens one step feeds (decode tokens plus prompt chunks; at least max_seqs,
    so every running sequence advances each step). cache_dtype: the pages' storage type (float32, bfloat16,
    float16, int8, float8_e4m3fn; default the model's compute dtype). batch_buckets / token_buckets / width_buckets:
    the compiled programs' row counts, chunk lengths and page-table widths in pages (default: powers of two up to
    max_seqs; 1, 4, 16, ... up to max_step_tokens; doubling from 256 tokens' worth of pages up to max_seq_len's;
    max_seqs and the whole table are always buckets).
    prefix_cache: share the full pages of common prompt prefixes between requests.
    batch_invariant: run the model in its batch-invariant scoring mode (`Decoder.forward(batch_invariant=True)`)
    and compute sample_logprobs one row at a time, so a token's logprobs are the bits a trainer's forward pass
    over the whole sequence in the same mode computes (RL's importance ratio exactly 1; docs/post-training.md).
    Slower decoding (attention one query at a time): off by default.
    burst_steps: decode steps one `step()` may run on the device in one dispatch when no prompt chunk is fed
    (default 1, one token per step: on a CPU a step inside the on-device loop costs more than the host work it
    saves, docs/performance.md; at most the largest token bucket).
    """

    def __init__(
        self,
        model,
        *,
        max_seqs: int = 16,
        page_size: int = 16,
        kv_memory=None,
        num_pages: int | None = None,
        max_step_tokens: int | None = None,
        cache_dtype: str | None = None,
        batch_buckets=None,
        token_buckets=None,
        width_buckets=None,
        prefix_cache: bool = True,
        batch_invariant: bool = False,
        burst_steps: int = 1,
    ):
        c = model.config
        self.batch_invariant = bool(batch_invariant)
        self.config = c
        self.max_seqs = _positive_int("max_seqs", max_seqs)
        self.page_size = _positive_int("page_size", page_size)
        self.max_step_tokens = _positive_int("max_step_tokens", max_step_tokens or max(256, self.max_seqs))
        if self.max_step_tokens < self.max_seqs:
            raise EngineError(
                f"max_step_tokens={self.max_step_tokens} < max_seqs={self.max_seqs}: every running sequence must be "
                "able to feed its token in each step"
            )
        if kv_memory is not None and num_pages is not None:
            raise EngineError("give kv_memory or num_pages, not both")
        self.batch_buckets = self._buckets("batch_buckets", batch_buckets, _powers(2, self.max_seqs), keep_limit=True)
        self.token_buckets = self._buckets("token_buckets", token_buckets, _powers(4, self.max_step_tokens))
        self.max_chunk = self.token_buckets[-1]
        # decode steps one dispatch may run when every row is decoding; at most a chunk's tokens, so a local group's
        # pages of a row stay within `group_pages_needed`
        self.burst_steps = min(_positive_int("burst_steps", burst_steps), self.max_chunk)
        self.prefix_cache = bool(prefix_cache)
        self.table_width = pages_for(c.max_seq_len, self.page_size)  # pages a row's table reaches
        # A call's page tables are as wide as its rows need (rounded up to a bucket), not max_seq_len: attention
        # reads (and the view gathers) only those pages' slots.
        narrowest = min(self.table_width, pages_for(min(256, c.max_seq_len), self.page_size))
        self.width_buckets = self._buckets(
            "width_buckets",
            width_buckets,
            tuple(w for w in _powers(2, self.table_width) if w >= narrowest),
            keep_limit=True,
        )
        # Each layer group (one per window; 0: global) pages independently: its own pages, page tables and book. A
        # local group returns a row's pages wholly before the window of its next query; a global group keeps them.
        self._group_layout = layer_groups(c)
        self.windows = tuple(w for w, _ in self._group_layout)
        self.group_page_bytes = tuple(
            page_bytes(c, self.page_size, cache_dtype, layers=len(layers)) for _, layers in self._group_layout
        )
        if num_pages is None:
            counts = self.pages_for_budget(parse_bytes("1GiB" if kv_memory is None else kv_memory))
            if min(counts) < 1:
                raise EngineError(
                    f"kv_memory={kv_memory!r} holds no page of {sum(self.group_page_bytes)} bytes (one per layer group)"
                )
        elif isinstance(num_pages, list | tuple):
            if len(num_pages) != len(self.windows):
                raise EngineError(f"num_pages needs one count per layer group ({len(self.windows)}), got {num_pages!r}")
            counts = tuple(_positive_int("num_pages", n) for n in num_pages)
        else:
            counts = (_positive_int("num_pages", num_pages),) * len(self.windows)
        self.group_pages = tuple(int(n) for n in counts)  # pages of each layer group
        self.num_pages = sum(self.group_pages)

        self._graphdef, self._state = nnx.split(model)
        # The weights each call runs on (`_layers_for`; "Weights per call" in the module docstring). In the
        # batch-invariant mode every call runs the XLA decode form that mode's scoring reproduces.
        if self.batch_invariant:
            self._layers = self._chunk_layers = model.split_layers(native=False)
        else:
            self._layers, self._chunk_layers = model.split_layers(rows=matvec.MAX_ROWS), None
        self._pool = init_pool(c, self.group_pages, self.page_size, cache_dtype)
        self.cache_dtype = self._pool.storage
        self._books = [PageBook(n) for n in self.group_pages]
        self._fresh = [[] for _ in self._books]  # pages of each group handed to a new owner since the last step
        self._requests = {}  # rid -> _Sequence
        self._running = []  # admission order, oldest first
        self._waiting = collections.deque()
        self._events = []  # cancellations, reported by the next step
        self._next_id = 0
        self._counts = collections.Counter()
        self._shapes = set()
        self._widths = set()  # page-table widths (pages) the step programs ran with
        self._burst_shapes = set()  # (rows, table width) buckets the burst programs ran with

    def _buckets(self, name, given, default, *, keep_limit=False):
        """Sorted distinct positive sizes, each at most default[-1]; keep_limit: default[-1] is always one (the
        largest rows or table a step may need)."""
        limit = default[-1]
        if given is None:
            return default
        b = tuple(sorted({_positive_int(name, x) for x in given} | ({limit} if keep_limit else set())))
        if not b or b[-1] > limit:
            raise EngineError(f"{name} must be non-empty, each at most {limit}, got {given!r}")
        return b

    # ---- requests -------------------------------------------------------------------------------------------
    def submit(
        self,
        prompt_ids,
        max_tokens: int = 16,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        stop=(),
        logprobs: int = 0,
        prompt_logprobs: bool = False,
    ) -> int:
        """Queue a request; returns its id. Every argument is checked here, before any compute: a request that can
        never fit (its prompt + max_tokens exceeds the model's max_seq_len or the whole page pool) is refused."""
        c = self.config
        prompt = self._check_ids("prompt_ids", prompt_ids)
        if not prompt:
            raise EngineError("prompt_ids is empty: generation needs at least one token to condition on")
        max_tokens = _positive_int("max_tokens", max_tokens)
        if len(prompt) + max_tokens > c.max_seq_len:
            raise EngineError(
                f"prompt length {len(prompt)} + max_tokens {max_tokens} = {len(prompt) + max_tokens} exceeds "
                f"model.max_seq_len={c.max_seq_len}"
            )
        need = self.group_pages_needed(len(prompt) + max_tokens)
        for g, (n, have) in enumerate(zip(need, self.group_pages, strict=True)):
            if n > have:
                raise EngineError(
                    f"request needs up to {n} pages of {self.page_size} tokens (prompt {len(prompt)} + max_tokens "
                    f"{max_tokens}) but the pool has {have}{self._group_name(g)}: it could never run"
                )
        if isinstance(temperature, bool) or not isinstance(temperature, int | float | np.number):
            raise EngineError(f"temperature must be a number >= 0, got {temperature!r}")
        if not math.isfinite(temperature) or temperature < 0:
            raise EngineError(f"temperature must be a finite number >= 0, got {temperature}")
        if top_k is not None:
            _positive_int("top_k", top_k)
        if top_p is not None and (
            isinstance(top_p, bool)
            or not isinstance(top_p, int | float | np.number)
            or not math.isfinite(top_p)
            or not 0.0 < top_p <= 1.0
        ):
            raise EngineError(f"top_p must be a number in (0, 1] or None, got {top_p!r}")
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or not 0 <= seed < 2**32:
            raise EngineError(f"seed must be an integer in [0, 2**32), got {seed!r}")
        stop = tuple(self._check_ids("stop", stop))
        if isinstance(logprobs, bool) or not isinstance(logprobs, int | np.integer) or not 0 <= logprobs <= 20:
            raise EngineError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {logprobs!r}")
        rid = self._next_id
        self._next_id += 1
        seq = _Sequence(
            rid=rid,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=float(temperature),
            top_k=None if top_k is None else int(top_k),
            top_p=None if top_p is None else float(top_p),
            seed=int(seed),
            stop=stop,
            logprobs=min(int(logprobs), c.vocab_size),
            want_prompt_logprobs=bool(prompt_logprobs),
            tokens=list(prompt),
        )
        self._requests[rid] = seq
        self._waiting.append(seq)
        return rid

    def group_pages_needed(self, tokens: int) -> tuple:
        """The most pages of each layer group a sequence of `tokens` tokens (prompt + max_tokens) holds at once:
        what `submit` checks against each group's pages, and what a fixed KV budget divided by it says about how
        many such sequences fit."""
        # the last token's K/V is never written: tokens - 1 at most are cached
        need = pages_for(tokens - 1, self.page_size)
        # a local group: the pages of the window before a step's first query and of its chunk, + a partial one
        return tuple(
            min(need, pages_for(w - 1 + self.max_chunk, self.page_size) + 1) if w else need for w in self.windows
        )

    def pages_needed(self, tokens: int) -> int:
        """`group_pages_needed` summed over the layer groups (one group: its count), to compare with `num_pages`
        (the sum of every group's pages); a request fits when each group's count fits its own pages."""
        return sum(self.group_pages_needed(tokens))

    def fits(self, token_counts) -> bool:
        """Whether sequences of these lengths (prompt + max_tokens each) can hold their pages at once, in every
        layer group."""
        need = [sum(n) for n in zip(*(self.group_pages_needed(t) for t in token_counts), strict=True)]
        return all(n <= have for n, have in zip(need, self.group_pages, strict=True)) if need else True

    def pages_for_budget(self, budget: int, tokens: int | None = None) -> tuple:
        """Each layer group's pages in `budget` bytes: split so that every group holds its pages for equally many
        sequences of `tokens` tokens (default max_seq_len: how `kv_memory` is split; a local group needs only the
        window's pages, a global one all of them). An engine for shorter sequences is sized with
        `num_pages=engine.pages_for_budget(budget, tokens)`."""
        need = self.group_pages_needed(self.config.max_seq_len if tokens is None else tokens)
        per_sequence = sum(n * b for n, b in zip(need, self.group_page_bytes, strict=True))
        return tuple(int(budget * n * b // per_sequence // b) for n, b in zip(need, self.group_page_bytes, strict=True))

    def _group_name(self, g: int) -> str:
        if len(self.windows) == 1:
            return ""
        w = self.windows[g]
        return f" for layers {list(self._group_layout[g][1])} ({f'window {w}' if w else 'global'})"

    def submit_samples(self, prompt_ids, num_samples: int, seed: int = 0, **kwargs) -> list:
        """`num_samples` requests for one prompt that share its pages; returns their ids. Sample i is the request
        submit(prompt_ids, seed=seed + i, **kwargs) would be (the same tokens), but only sample 0 computes the prompt:
        the others wait until it has, then hold its full pages (refcounted, as prefix-cache hits, with or without
        the prefix cache) and compute only the prompt's last partial page."""
        n = _positive_int("num_samples", num_samples)
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or not 0 <= seed or seed + n > 2**32:
            raise EngineError(f"seed must be an integer in [0, 2**32 - num_samples], got {seed!r}")
        ids = [self.submit(prompt_ids, seed=int(seed) + i, **kwargs) for i in range(n)]
        leader = self._requests[ids[0]]
        for rid in ids[1:]:
            self._requests[rid].leader = leader
        return ids

    def _check_ids(self, name, ids) -> list:
        if isinstance(ids, np.ndarray):
            ids = ids.tolist()
        if not isinstance(ids, list | tuple) or not all(
            isinstance(t, int | np.integer) and not isinstance(t, bool) for t in ids
        ):
            raise EngineError(f"{name} must be a list of token ids, got {ids!r}")
        V = self.config.vocab_size
        bad = [int(t) for t in ids if not 0 <= t < V]
        if bad:
            raise EngineError(f"{name} has token id {bad[0]} outside the vocabulary [0, {V})")
        return [int(t) for t in ids]

    def cancel(self, request_id: int) -> bool:
        """Stop a request now (its pages go back at once); the next step reports it. False if it had finished."""
        seq = self._requests.get(request_id)
        if seq is None:
            raise EngineError(f"no request with id {request_id!r}")
        if seq.finish_reason is not None:
            return False
        self._finish(seq, "cancelled")
        self._events.append(Event(request_id, finish_reason="cancelled"))
        return True

    def result(self, request_id: int) -> RequestResult:
        seq = self._requests.get(request_id)
        if seq is None:
            raise EngineError(f"no request with id {request_id!r}")
        return RequestResult(
            request_id=seq.rid,
            prompt=list(seq.prompt),
            tokens=list(seq.generated),
            logprobs=list(seq.token_logprobs),
            top_logprobs=list(seq.top),
            prompt_logprobs=list(seq.prompt_lp) if seq.want_prompt_logprobs else None,
            finish_reason=seq.finish_reason,
            sample_logprobs=list(seq.token_sample_logprobs),
        )

    def forget(self, request_id: int) -> None:
        """Drop a finished request's record (its result is no longer needed): a long-running server's memory stays
        bounded. A request still running or waiting is refused."""
        seq = self._requests.get(request_id)
        if seq is not None and seq.finish_reason is None:
            raise EngineError(f"request {request_id} has not finished: cancel it first")
        self._requests.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self._running or self._waiting or self._events)

    def run(self, requests, *, progress: bool = True) -> list:
        """Submit every request (dicts of submit's arguments) and step until all finish; one RequestResult per
        request, in order. A dict with num_samples=n goes to `submit_samples` and gets a list of n results.
        A tqdm bar counts finished requests."""
        groups = []
        for r in requests:
            r = dict(r)
            n = r.pop("num_samples", None)
            groups.append(self.submit(**r) if n is None else self.submit_samples(num_samples=n, **r))
        ids = [i for g in groups for i in (g if isinstance(g, list) else [g])]
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="requests", unit="req")
        try:
            while self.has_work():
                finished = sum(e.finish_reason is not None for e in self.step())
                if bar is not None:
                    bar.update(finished)
        finally:
            if bar is not None:
                bar.close()
        return [[self.result(i) for i in g] if isinstance(g, list) else self.result(g) for g in groups]

    def stats(self) -> dict:
        """Pages held, cached (unreferenced, kept for the prefix cache) and free; requests running and waiting;
        prefix-cache hits; preemptions; K/V vectors computed (tokens fed, per layer and KV head); prompt-chunk
        tokens fed and the slots their calls were padded to (chunk_tokens, chunk_slots); programs. Page counts are
        summed over the layer groups; "groups" has each group's own (window 0: global)."""
        books = self._books
        groups = [
            {
                "window": w,
                "layers": list(layers),
                "pages_total": book.num_pages,
                "pages_used": book.held,
                "pages_peak": self._counts[f"pages_peak_{g}"],
                "pages_cached": len(book.cached),
                "pages_free": len(book.free),
            }
            for g, ((w, layers), book) in enumerate(zip(self._group_layout, books, strict=True))
        ]
        return {
            "pages_total": self.num_pages,
            "pages_used": sum(b.held for b in books),
            "pages_peak": self._counts["pages_peak"],
            "decoding_peak": self._counts["decoding_peak"],
            "pages_cached": sum(len(b.cached) for b in books),
            "pages_free": sum(len(b.free) for b in books),
            "running": len(self._running),
            "waiting": len(self._waiting),
            "prefix_hit_pages": self._counts["prefix_hit_pages"],
            "prefix_hit_tokens": self._counts["prefix_hit_tokens"],
            "preemptions": self._counts["preemptions"],
            "pages_out_of_window": self._counts["pages_out_of_window"],
            "kv_computed": self._counts["kv_computed"],
            "chunk_tokens": self._counts["chunk_tokens"],
            "chunk_slots": self._counts["chunk_slots"],
            "steps": self._counts["steps"],
            "programs_compiled": self._counts["traces"],
            "program_shapes": sorted(self._shapes),
            "burst_shapes": sorted(self._burst_shapes),
            "bursts": self._counts["bursts"],
            "burst_tokens": self._counts["burst_tokens"],
            "table_widths": sorted(self._widths),
            "groups": groups,
        }

    def refcounts(self) -> np.ndarray:
        """Each page's holder count (a copy), the layer groups' pages one after another."""
        return np.concatenate([b.refcount for b in self._books])

    # ---- one step ------------------------------------------------------------------------------------------
    def step(self, max_burst: int | None = None) -> list:
        """Run one engine step; returns its events (new tokens, finished and cancelled requests). A step whose rows
        all decode may run up to min(burst_steps, max_burst) decode steps in one dispatch (a burst: several tokens
        per request, in order)."""
        events, self._events = self._events, []
        rows = self._schedule()
        self._count_peaks()
        decoding = sum(len(seq.tokens) - seq.computed <= 1 for seq, _ in rows)
        self._counts["decoding_peak"] = max(self._counts["decoding_peak"], decoding)
        if not rows:
            if self._waiting and not self._running:
                raise RuntimeError("the scheduler could not admit a request into an empty engine")
            return events
        # Decoding rows and prompt chunks run as separate calls: padded to one [rows, tokens] program, every
        # decoding row would cost as much as the longest chunk.
        burst = self._burst_length(rows, self.burst_steps if max_burst is None else min(max_burst, self.burst_steps))
        if burst > 1:
            events.extend(self._burst(rows, burst))
            return events
        calls = self._calls(rows)
        fresh, self._fresh = self._fresh, [[] for _ in self._books]
        outputs = []
        before = _traces
        for i, group in enumerate(calls):
            batch, shape, all_logits = self._batch(group, fresh if i == 0 else [[] for _ in fresh])
            self._shapes.add(shape)
            if shape[1] > 1:
                self._counts["chunk_tokens"] += sum(n for _, n in group)
                self._counts["chunk_slots"] += shape[0] * shape[1]
            self._pool, out = _step_program(
                self._state,
                self._layers_for(shape[0] * shape[1]),
                self._pool,
                batch,
                graphdef=self._graphdef,
                all_logits=all_logits,
                invariant=self.batch_invariant,
            )
            outputs.append((group, out))
        self._counts["traces"] += _traces - before
        self._counts["steps"] += 1
        for group, out in outputs:
            out = jax.device_get(out)
            for b, (seq, n) in enumerate(group):
                events.extend(self._advance(seq, n, b, out))
        return events

    def _layers_for(self, tokens: int):
        """The weights of a call feeding `tokens` token slots (rows x chunk length, padding included): the decode
        form where every product goes to the decode kernels (at most matvec.MAX_ROWS), else the stacked weights
        (None: `forward` reads the model's own)."""
        return self._layers if tokens <= matvec.MAX_ROWS else self._chunk_layers

    def _count_peaks(self) -> None:
        self._counts["pages_peak"] = max(self._counts["pages_peak"], sum(b.held for b in self._books))
        for g, book in enumerate(self._books):
            self._counts[f"pages_peak_{g}"] = max(self._counts[f"pages_peak_{g}"], book.held)

    def _burst_length(self, rows, cap: int) -> int:
        """Decode steps this step runs in one dispatch: 1 unless every row is decoding (its only uncomputed token is
        its last). At most `cap`; while requests wait, no more than the fewest tokens a row has left, so a row that
        ends by max_tokens frees its place the step it would without bursts (a stop id may end one earlier: its
        place frees at the burst's end); and only as many steps as the free pages cover for every row."""
        if cap < 2 or any(len(seq.tokens) - seq.computed != 1 for seq, _ in rows):
            return 1
        left = [seq.max_tokens - len(seq.generated) for seq, _ in rows]
        longest = min(cap, min(left)) if self._waiting else cap
        for k in range(longest, 1, -1):
            need = sum(
                pages_for(seq.computed + min(k, r), self.page_size) - len(seq.pages[0])
                for (seq, _), r in zip(rows, left, strict=True)
            )
            if all(need <= book.available for book in self._books):
                return k
        return 1

    def _burst(self, rows, k: int) -> list:
        """Run a burst of up to k decode steps over `rows` (all decoding) and book its tokens, step by step: each
        row's tokens after its stop id or its max_tokens are dropped, and its pages go back as it finishes."""
        seqs = [seq for seq, _ in rows]
        limits = [min(k, seq.max_tokens - len(seq.generated)) for seq in seqs]
        for seq, n in zip(seqs, limits, strict=True):  # the pages for the slots of the tokens each row may feed
            self._allocate(seq, pages_for(seq.computed + n, self.page_size) - len(seq.pages[0]))
        self._count_peaks()
        fresh, self._fresh = self._fresh, [[] for _ in self._books]
        batch, shape = self._burst_batch(seqs, limits, k, fresh)
        self._burst_shapes.add(shape)
        before = _traces
        self._pool, ran, out = _burst_program(
            self._state,
            self._layers_for(shape[0]),
            self._pool,
            batch,
            graphdef=self._graphdef,
            max_steps=self.burst_steps,
            invariant=self.batch_invariant,
        )
        self._counts["traces"] += _traces - before
        self._counts["steps"] += 1
        self._counts["bursts"] += 1
        ran, out = int(ran), jax.device_get(out)
        events = []
        for i in range(ran):
            out_i = jax.tree.map(lambda a, i=i: a[i], out)
            for b, seq in enumerate(seqs):
                if seq.finish_reason is None and i < limits[b]:
                    events.extend(self._advance(seq, 1, b, out_i))
                    self._counts["burst_tokens"] += 1
        return events

    def _schedule(self) -> list:
        """[(sequence, tokens to feed)] for this step (see the module docstring)."""
        budget, rows, scheduled = self.max_step_tokens, [], set()
        # decoding sequences first (one token each), then those reading a prompt; each group oldest first
        for seq in sorted(self._running, key=lambda s: len(s.tokens) - s.computed > 1):
            if budget == 0:
                break
            if seq not in scheduled and seq in self._running:
                n = self._chunk(min(len(seq.tokens) - seq.computed, budget, self.max_chunk))
                self._return_out_of_window(seq)
                if self._grow(seq, seq.computed + n, scheduled):
                    rows.append((seq, n))
                    scheduled.add(seq)
                    budget -= n
        while self._waiting and len(self._running) < self.max_seqs and budget > 0:
            seq = next((s for s in self._waiting if not self._waits_for_leader(s)), None)
            if seq is None:
                break
            keys, hits = self._prefix_hits(seq)  # hits: per group, a page (None: not needed) per hit column
            start = len(keys) * self.page_size
            n = self._chunk(min(len(seq.tokens) - start, budget, self.max_chunk))
            new_pages = pages_for(start + n, self.page_size) - len(keys)
            if any(
                new_pages > book.available - sum(1 for p in h if p is not None and book.refcount[p] == 0)
                for book, h in zip(self._books, hits, strict=True)
            ):
                break
            self._waiting.remove(seq)
            for book, h in zip(self._books, hits, strict=True):
                for p in h:
                    if p is not None:
                        book.hold(p)
            seq.pages, seq.keys, seq.computed = [list(h) for h in hits], list(keys), start
            self._allocate(seq, new_pages)
            self._counts["prefix_hit_pages"] += len(keys)
            self._counts["prefix_hit_tokens"] += start
            self._running.append(seq)
            rows.append((seq, n))
            budget -= n
        return rows

    def _chunk(self, n: int) -> int:
        """A prompt chunk of up to n tokens cut so that its token bucket is not mostly padding: when the bucket n
        falls in is over 1.5 n and a smaller bucket fits in n, feed that many now and the rest next step (a 70-token
        chunk runs as 64 + 6 rather than padded to 256; a step's cost is its padded tokens)."""
        T = next(t for t in self.token_buckets if t >= n)
        if 2 * T > 3 * n:
            n = max((t for t in self.token_buckets if t <= n), default=n)
        return n

    def _calls(self, rows) -> list:
        """The step's rows as calls of the step program: decoding rows (one token each) together, prompt chunks
        grouped by token bucket, each group split into whole row buckets (the largest that fits first; padded only
        when no row bucket fits), so no call pays for another's chunk length or for empty rows."""
        calls = [[r for r in rows if r[1] == 1]]
        by_bucket = collections.defaultdict(list)
        for r in rows:
            if r[1] > 1:
                by_bucket[next(t for t in self.token_buckets if t >= r[1])].append(r)
        for _, group in sorted(by_bucket.items()):
            while group:
                b = max((b for b in self.batch_buckets if b <= len(group)), default=len(group))
                calls.append(group[:b])
                group = group[b:]
        return [c for c in calls if c]

    @staticmethod
    def _waits_for_leader(seq) -> bool:
        """A sample of a num_samples group waits until its leader has computed the shared prompt (or finished)."""
        lead = seq.leader
        return lead is not None and lead.finish_reason is None and lead.computed < len(lead.prompt)

    def _prefix_hits(self, seq) -> tuple:
        """(keys, pages per layer group) of the sequence's leading full pages found in the prefix cache; never the
        page of its last token, whose logits must be computed (and requests asking for prompt logprobs compute
        every token). m pages are a hit when every global group has all m and every local group has those of them
        not wholly before the window of the first query after them (the others are not held at all: None)."""
        G = len(self._books)
        if (not self.prefix_cache and seq.leader is None) or seq.want_prompt_logprobs:
            return [], [[] for _ in range(G)]
        ps, keys, found, key = self.page_size, [], [[] for _ in range(G)], b""
        for j in range((len(seq.tokens) - 1) // ps):
            key = PageBook.chain(key, seq.tokens[j * ps : (j + 1) * ps])
            pages = [book.lookup(key) for book in self._books]
            if all(p is None for p in pages):
                break
            keys.append(key)
            for g, p in enumerate(pages):
                found[g].append(p)
        for m in range(len(keys), -1, -1):  # the longest prefix every group can hold
            outside = [max(0, m * ps - w + 1) // ps if w else 0 for w in self.windows]
            if all(p is not None for g in range(G) for p in found[g][outside[g] : m]):
                return keys[:m], [[None] * outside[g] + found[g][outside[g] : m] for g in range(G)]
        raise AssertionError("unreachable: m = 0 always holds")

    def _grow(self, seq, tokens: int, scheduled) -> bool:
        """Give `seq` the pages for `tokens` tokens, preempting the newest running sequence not yet scheduled in
        this step while none are available. False if `seq` itself was preempted."""
        need = pages_for(tokens, self.page_size) - len(seq.pages[0])  # every group's table has the same columns
        while any(need > book.available for book in self._books):
            victim = next(s for s in reversed(self._running) if s not in scheduled)
            self._preempt(victim)
            if victim is seq:
                return False
        self._allocate(seq, need)
        return True

    def _return_out_of_window(self, seq) -> None:
        """Give back each local group's pages wholly before the window of the row's next query: their slots are
        masked for every query to come (a global group keeps its pages). The table keeps the column (no page: its
        slots read as empty)."""
        for g, window in enumerate(self.windows):
            if not window:
                continue
            pages = seq.pages[g]
            first_needed = seq.computed - window + 1  # the oldest position the next query sees
            for j in range(max(0, first_needed) // self.page_size):
                if pages[j] is not None:
                    self._books[g].release(pages[j])
                    pages[j] = None
                    self._counts["pages_out_of_window"] += 1

    def _allocate(self, seq, n: int) -> None:
        """n more columns in the row's page table: a new page in each layer group."""
        for book, pages, fresh in zip(self._books, seq.pages, self._fresh, strict=True):
            for _ in range(n):
                page = book.allocate()
                pages.append(page)
                fresh.append(page)

    def _release(self, seq) -> None:
        for book, pages in zip(self._books, seq.pages, strict=False):  # [] when it never ran
            for page in pages:
                if page is not None:
                    book.release(page)
        seq.pages, seq.keys, seq.computed = [[] for _ in self._books], [], 0

    def _preempt(self, seq) -> None:
        """Free a running sequence's pages; it waits at the front of the queue and recomputes later (its emitted
        tokens are replayed as prompt, not sampled again)."""
        self._release(seq)
        self._running.remove(seq)
        self._waiting.appendleft(seq)
        self._counts["preemptions"] += 1

    def _finish(self, seq, reason: str) -> None:
        seq.finish_reason = reason
        self._release(seq)
        if seq in self._running:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)

    def _batch(self, rows, fresh) -> tuple:
        """One call's StepBatch, padded to its (rows, tokens, table width) bucket; its (rows, tokens) bucket; and
        whether it needs every fed token's logits (a row scoring its prompt). `fresh`: pages handed out since the
        last step (their slots are emptied before this call writes or reads)."""
        B = next(b for b in self.batch_buckets if b >= len(rows))
        T = next(t for t in self.token_buckets if t >= max(n for _, n in rows))
        NP = next(w for w in self.width_buckets if w >= max(len(seq.pages[0]) for seq, _ in rows))
        self._widths.add(NP)
        tokens = np.zeros((B, T), np.int32)
        targets = np.full((B, T), -1, np.int32)
        n_valid = np.zeros(B, np.int32)
        lengths = np.zeros(B, np.int32)
        table = self._table([s for s, _ in rows], B, NP)
        index = np.zeros(B, np.int32)
        for b, (seq, n) in enumerate(rows):
            fed = seq.tokens[seq.computed : seq.computed + n]
            tokens[b, :n] = fed
            nxt = seq.tokens[seq.computed + 1 : seq.computed + n + 1]
            targets[b, : len(nxt)] = nxt
            n_valid[b], lengths[b] = n, seq.computed
            index[b] = len(seq.generated)
        seqs = [s for s, _ in rows]
        sampling = self._sampling(seqs, B)
        all_logits = any(s.want_prompt_logprobs and len(s.prompt_lp) < len(s.prompt) for s in seqs)
        batch = StepBatch(tokens, n_valid, lengths, table, self._fresh_ids(fresh), targets, index, sampling)
        return batch, (B, T), all_logits

    def _burst_batch(self, seqs, limits, k: int, fresh) -> tuple:
        """A burst's BurstBatch, padded to its (rows, table width) bucket, and that bucket."""
        B = next(b for b in self.batch_buckets if b >= len(seqs))
        NP = next(w for w in self.width_buckets if w >= max(len(seq.pages[0]) for seq in seqs))
        self._widths.add(NP)
        token, limit, lengths, index = (np.zeros(B, np.int32) for _ in range(4))
        table = self._table(seqs, B, NP)
        for b, seq in enumerate(seqs):
            token[b], limit[b], lengths[b], index[b] = seq.tokens[-1], limits[b], seq.computed, len(seq.generated)
        sampling = self._sampling(seqs, B)
        batch = BurstBatch(token, limit, lengths, table, self._fresh_ids(fresh), index, np.int32(k), sampling)
        return batch, (B, NP)

    def _table(self, seqs, B: int, NP: int) -> np.ndarray:
        """[G, B, NP] page tables of the rows (no page: the group's page count)."""
        none = np.asarray(self.group_pages, np.int32)
        table = np.broadcast_to(none[:, None, None], (len(self._books), B, NP)).copy()
        for b, seq in enumerate(seqs):
            for g, pages in enumerate(seq.pages):
                table[g, b, : len(pages)] = [none[g] if p is None else p for p in pages]
        return table

    def _fresh_ids(self, fresh) -> np.ndarray:
        """[G, F] pages of each group handed out since the last call (padded with the group's page count)."""
        none = np.asarray(self.group_pages, np.int32)
        F = self.max_seqs * (pages_for(self.max_chunk, self.page_size) + 1)  # the most pages one step hands out
        fresh_ids = np.broadcast_to(none[:, None], (len(self._books), F)).copy()
        for g, pages in enumerate(fresh):
            if len(pages) > F:
                raise RuntimeError(f"{len(pages)} pages handed out in one step, more than {F}")
            fresh_ids[g, : len(pages)] = pages
        return fresh_ids

    def _sampling(self, seqs, B: int) -> SamplingParams:
        pad = B - len(seqs)
        return SamplingParams.make(
            [s.temperature for s in seqs] + [0.0] * pad,
            [s.top_k for s in seqs] + [None] * pad,
            [s.top_p for s in seqs] + [None] * pad,
            [s.seed for s in seqs] + [0] * pad,
            [s.stop for s in seqs] + [()] * pad,
        )

    def _advance(self, seq, n: int, b: int, out: StepOutput) -> list:
        """Book a row's step: its K/V are in its pages (full pages join the prefix cache), its prompt logprobs, and
        the token sampled when the row fed its last uncomputed token."""
        ps = self.page_size
        if seq.want_prompt_logprobs:
            for i in range(n):
                t = seq.computed + i + 1  # the prompt token scored at this fed position
                if t < len(seq.prompt) and t == len(seq.prompt_lp):
                    seq.prompt_lp.append(float(out.target_logprobs[b, i]))
        seq.computed += n
        self._counts["kv_computed"] += n
        while (len(seq.keys) + 1) * ps <= seq.computed:
            j = len(seq.keys)
            key = PageBook.chain(seq.keys[-1] if seq.keys else b"", seq.tokens[j * ps : (j + 1) * ps])
            for book, pages in zip(self._books, seq.pages, strict=True):
                if pages[j] is not None:
                    book.register(pages[j], key)
            seq.keys.append(key)
        if seq.computed < len(seq.tokens):
            return []  # still reading its prompt (or replaying after preemption)
        token = int(out.token[b])
        seq.generated.append(token)
        seq.tokens.append(token)
        seq.token_logprobs.append(float(out.logprob[b]))
        seq.token_sample_logprobs.append(float(out.sample_logprob[b]))
        top = None
        if seq.logprobs:
            k = seq.logprobs
            top = tuple(zip(out.top_ids[b, :k].tolist(), out.top_logprobs[b, :k].tolist(), strict=True))
            seq.top.append(top)
        reason = None
        if bool(out.stopped[b]):
            reason = "stop"
        elif len(seq.generated) >= seq.max_tokens:
            reason = "length"
        if reason is not None:
            self._finish(seq, reason)
        return [Event(seq.rid, token, seq.token_logprobs[-1], top, reason, seq.token_sample_logprobs[-1])]
