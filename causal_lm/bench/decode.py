"""`causal-lm bench decode`: generation throughput with the KV cache and with recompute, next to the PyTorch
peer's `generate`, and against the bandwidth floor (weights and K/V read once per generated token)."""

from __future__ import annotations

import contextlib
import functools
import time
import warnings
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from causal_lm.bench.common import (
    environment,
    fmt,
    header,
    machine_ceilings,
    model_summary,
    peer_status,
    ratio,
    read_bandwidth,
    settle,
    timed,
)
from causal_lm.bench.first_call import first_call_latency
from causal_lm.bench.peer import build_peer, peer_forward, peer_mismatch, peer_runner
from causal_lm.config import Config, ModelConfig
from causal_lm.decode import generate
from causal_lm.decode.sampling import argmax_tokens
from causal_lm.interop.gguf import load_gguf
from causal_lm.interop.hf_weights import model_from_params
from causal_lm.model.kv_cache import CACHE_DTYPES, cache_bytes, init_cache
from causal_lm.model.quant import WEIGHTS, quantize
from causal_lm.train import Note, load_for_inference
from causal_lm.train.profile import profile_trace
from causal_lm.train.state import init_params

DEFAULT_CONTEXTS = (128, 512, 1024, 2048)


DEFAULT_BATCHES = (1, 8)


# ---- the machine -------------------------------------------------------------------------------------------


def _same_program(n: int) -> dict:
    """generate arguments that compile t(1) and t(1 + n) into one program (the same room for new tokens), so their
    difference is the n decode steps and nothing else. The room is exactly 1 + n, not rounded up to the next power
    of two as `generate` would round 1 + n = 129 to 256: a decode step attends over every slot of the cache, so the
    rounded room would time a cache longer than the one a call for n = 128 new tokens runs over (room 128)."""
    return {"max_new_bucket": 1 + n}


def _decode_seconds(run: Callable[[int], None], n: int, reps: int) -> float:
    """Seconds for n decode steps: best t(1 + n new tokens) - best t(1 new token) (prefill and the first token
    cancel). Each length runs once first (compiles, warms up); then the two alternate, so a burst of load on a
    shared machine tends to hit one rep of each rather than all of one."""
    return _decode_seconds_alternating([run], n, reps)[0]


def alternated_calls(runs: Sequence[Callable[[int], object]], n: int, reps: int) -> list:
    """Per runner, (best t(1), best t(1 + n), [what each timed call returned]), the runners' reps alternating: a's
    t(1) and t(1 + n), then b's, then a's again, so that a ratio between them (speculative against plain, int8
    against float32, ours against llama.cpp) compares times taken under the same load. Each length runs once first
    (compiles, warms up). With several runners each turn starts with an untimed t(1): the first call of a program
    that needs more memory than the other left free gets its new pages slowly (on huge pages, the 135M float32
    `generate` after an int4 one with 128 decode steps: t(1) 1.0-1.2 s instead of 0.55-0.63), which would shorten
    t(1 + n) - t(1) and overstate the rate (105% of the floor, on VM E)."""
    for run in runs:
        run(1)
        run(1 + n)
    settle()
    best = [[float("inf"), float("inf"), []] for _ in runs]
    for _ in range(reps):
        for run, b in zip(runs, best, strict=True):
            if len(runs) > 1:
                run(1)  # untimed: the switch from the other program's memory
            for i, k in enumerate((1, 1 + n)):
                t0 = time.perf_counter()
                b[2].append(run(k))
                b[i] = min(b[i], time.perf_counter() - t0)
    return [tuple(b) for b in best]


def _decode_seconds_alternating(runs: Sequence[Callable[[int], object]], n: int, reps: int) -> list:
    """`_decode_seconds` of several runners, timed by `alternated_calls`."""
    return [_steps_seconds(t_one, t_all, n) for t_one, t_all, _ in alternated_calls(runs, n, reps)]


NOISE_FRACTION = 0.02  # n steps taking less than this fraction of the whole call are lost in its timing noise


def _steps_seconds(t_one: float, t_all: float, n: int) -> float:
    """t(1 + n) - t(1); when that is within the call's timing noise (too few steps timed), the whole call's share
    of n steps instead, t(1 + n) * n / (1 + n): it charges them the prefill too, so the rate is a lower bound."""
    if t_all - t_one > NOISE_FRACTION * t_all:
        return t_all - t_one
    warnings.warn(
        f"{n} decode steps took no measurable time beyond the 1-token call (t(1) = {t_one * 1e3:.2f} ms, "
        f"t(1 + {n}) = {t_all * 1e3:.2f} ms): that rate is a lower bound from the whole call; time more new tokens",
        Note,
        stacklevel=2,
    )
    return t_all * n / (1 + n)


IMPLAUSIBLE_FLOOR = 1.10  # a decode rate this far above its bandwidth floor is a timing artifact, not the machine


def above_the_floor(
    seconds: float, again: Callable[[int], float], reps: int, floor_seconds: float, what: str
) -> tuple[float, bool, bool]:
    """(seconds, retimed, implausible) for n decode steps that took `seconds`, timed as t(1 + n) - t(1) with `reps`
    reps. A t(1) slowed in every rep by a burst of load makes that difference too small: on a shared VM a row once
    read 133% of the bandwidth floor. When the steps beat `floor_seconds` (the same steps reading their bytes at the
    measured bandwidth) by more than IMPLAUSIBLE_FLOOR, they are timed again, again(2 * reps), and the slower of the
    two counts (a burst can only make the difference smaller); still above, the figure is kept, marked implausible,
    and a note says so."""
    s = seconds
    if floor_seconds <= 0 or s * IMPLAUSIBLE_FLOOR >= floor_seconds:
        return s, False, False
    s = max(s, again(2 * reps))
    implausible = s * IMPLAUSIBLE_FLOOR < floor_seconds
    if implausible:
        warnings.warn(
            f"{what}: {floor_seconds / s:.0%} of the bandwidth floor even when timed again: a timing artifact of a "
            "busy machine (t(1) slower than in the longer call); rerun, or time more new tokens",
            Note,
            stacklevel=2,
        )
    return s, True, implausible


def _ours_runner(model, prompts: np.ndarray, use_cache: bool, **kw):
    rows = prompts.tolist()

    def run(k: int):  # returns host tokens: waits for the device
        return generate(model, rows, max_new_tokens=k, use_cache=use_cache, **kw)

    return run


def _best(fn, reps: int) -> float:
    fn()
    return min(timed(fn) for _ in range(max(1, reps)))


def decode_loop_comparison(model, context: int, batch: int = 1, n: int = 64, reps: int = 2) -> dict:
    """ms per generated token (greedy, cached) of generate's on-device while_loop vs a Python loop over a jitted
    one-token step (cache donated, the layers' weights sliced once, tokens kept on the device), and the same
    Python loop reading each token back to the host (what a streaming loop in Python does)."""
    graphdef, state = nnx.split(model)
    prompts = np.random.default_rng(1).integers(0, model.config.vocab_size, (batch, context), dtype=np.int32)
    device_loop = _decode_seconds(_ours_runner(model, prompts, True, **_same_program(n)), n, reps) / n

    @jax.jit
    def split(state):
        return nnx.merge(graphdef, state).split_layers(rows=batch)

    @functools.partial(jax.jit, donate_argnames=("cache",))
    def prefill(state, tokens, cache):
        logits, cache = nnx.merge(graphdef, state)(tokens, cache=cache)
        return argmax_tokens(logits[:, -1]), cache

    @functools.partial(jax.jit, donate_argnames=("cache",))
    def step(state, layers, tok, cache):
        logits, cache = nnx.merge(graphdef, state)(tok[:, None], cache=cache, layers=layers)
        return argmax_tokens(logits[:, -1]), cache

    layers = split(state)
    tokens = jnp.asarray(prompts)

    def python_loop(sync: bool) -> float:
        tok, cache = prefill(state, tokens, init_cache(model.config, batch, context + n + 1))
        tok, cache = step(state, layers, tok, cache)  # compiled and warm
        jax.block_until_ready(tok)
        t0 = time.perf_counter()
        for _ in range(n):
            tok, cache = step(state, layers, tok, cache)
            if sync:
                np.asarray(tok)
        jax.block_until_ready(tok)
        return (time.perf_counter() - t0) / n

    python_loop(False)
    settle()
    async_loop = min(python_loop(False) for _ in range(reps))
    sync_loop = min(python_loop(True) for _ in range(reps))
    return {
        "context": context,
        "batch": batch,
        "new_tokens": n,
        "while_loop_ms_per_step": 1e3 * device_loop,
        "python_loop_ms_per_step": 1e3 * async_loop,
        "python_loop_host_sync_ms_per_step": 1e3 * sync_loop,
    }


def decode_bytes_per_token(
    m: ModelConfig, weight_bytes: int, context: float, batch: int, cache_dtype: str | None = None
) -> float:
    """Bytes a decode step must read per generated token: every weight once per step (shared by the batch) plus
    each row's cached K/V for `context` tokens, as the cache stores them (local layers: their ring; int8: the
    scales too)."""
    kv = cache_bytes(m, max(1, int(round(context))), dtype=cache_dtype or m.dtype)["kv_bytes"]
    return (weight_bytes + batch * kv) / batch


# Prompts for the speculative rows: one whose continuation repeats what came before (code with repeated
# structure: drafts can hit), one of plain prose (they mostly cannot).
SPECULATIVE_PROMPTS = {
    "code": (
        "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
        "    return a * b\n\n\ndef div(a, b):\n    return a / b\n\n\ndef mod(a, b):\n"
    ),
    "prose": (
        "The interpreter reads a program, turns it into a sequence of instructions and carries them out one by one, "
        "keeping track of the names it has seen and the values they refer to. When "
    ),
}


def _prompt_ids(text: str, tokenizer, vocab_size: int) -> list:
    if tokenizer is not None:
        return tokenizer.encode(text)
    ids = list(text.encode("utf-8"))  # a byte-level vocabulary without a tokenizer: the bytes are the ids
    return [i % vocab_size for i in ids]


def speculative_rows(model, tokenizer, speculative, draft_tokens: int, n: int, reps: int) -> list:
    """Plain cached decoding against speculative decoding on the same prompts (batch 1): tokens/s of each,
    target passes per generated token, the share of proposals accepted, the speed-up."""
    rows = []
    for kind, text in SPECULATIVE_PROMPTS.items():
        ids = _prompt_ids(text, tokenizer, model.config.vocab_size)
        ids = np.asarray([ids[-(model.config.max_seq_len - n - 2) :]])  # the end of it, if the model is short
        plain = _ours_runner(model, ids, True, **_same_program(n))
        spec = _ours_runner(model, ids, True, speculative=speculative, draft_tokens=draft_tokens, **_same_program(n))
        t_plain, t_spec = _decode_seconds_alternating([plain, spec], n, reps)  # the same load on both
        res = spec(1 + n)
        same = res.tokens == plain(1 + n).tokens
        rows.append(
            {
                "prompt": kind,
                "prompt_tokens": int(ids.shape[1]),
                "new_tokens": n,
                "plain_tokens_per_s": n / t_plain,
                "speculative_tokens_per_s": n / t_spec,
                "speedup": t_plain / t_spec,
                "target_passes_per_token": res.target_passes / (1 + n),
                "acceptance": res.draft_accepted / max(1, res.draft_proposed),
                "draft_proposed": res.draft_proposed,
                "same_tokens_as_plain": same,
            }
        )
    return rows


def bench_decode(
    config: Config,
    *,
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    batches: Sequence[int] = DEFAULT_BATCHES,
    new_tokens: int | None = None,
    recompute_new_tokens: int | None = None,
    reps: int | None = None,
    peer: bool = True,
    quick: bool = False,
    ceilings: dict | None = None,
    compare_loops: bool = True,
    cache_dtypes: Sequence[str] = (),
    workdir: str | None = None,
    speculative=None,
    draft_tokens: int = 4,
    profile: str | None = None,
    first_call: bool = True,
    weights: Sequence[str] = ("float32",),
    gguf: str | None = None,
    bandwidth_beside: bool | None = None,
) -> dict:
    """Decode throughput of `generate` with and without the KV cache, per (context, batch), and of the peer.

    new_tokens (cached) and recompute_new_tokens are the decode steps timed after the prompt (a recompute step
    costs a whole forward pass over the context, so it gets fewer). cache_dtypes: more rows with the cache stored
    in these types (ours only). workdir: time a trained model (and its tokenizer) instead of a random-init one of
    `config`'s shape. speculative: "ngram" or a draft model (or a workdir to load one from): rows comparing plain
    and speculative decoding on a prompt where drafts can hit and one where they mostly cannot. profile: write a
    jax.profiler trace of the timed generation calls into this directory. first_call: time the first token of a
    fresh process at the first (context, batch), compiling and then with a persistent compilation cache filled by
    the first (`causal_lm.bench.first_call`; random-init weights of the shape, also with a workdir).

    Returns the JSON object of `causal-lm bench decode --json`: machine, jax_version, rows [{context, batch,
    cache_dtype, cached_tokens_per_s, recompute_tokens_per_s, prefill_tokens_per_s, bandwidth_floor_fraction,
    peer_cached_tokens_per_s, peer_recompute_tokens_per_s, peer_prefill_tokens_per_s, ...}], speculative rows,
    decode_loop: `decode_loop_comparison` at context 512 (or the first), batch 1, and first_call:
    `first_call_latency` (first_call_first_token_s, cached_compile_first_token_s, ...) or None.
    weights: rows for the model's weights stored as each of these (float32, and int8 / int4 through
    `causal_lm.quantize`, default group sizes); each row's "weights", its "weight_bytes" (what the floor counts)
    and "ratio_vs_float32" (cached tokens/s against the float32 row of the same context and batch; the cached
    timings of a context and batch's rows, every weights and cache storage, alternate rep by rep).
    gguf: time a GGUF file's model with its Q8_0 / Q4_0 / Q4_1 weights kept quantized (no peer; weights ignored).
    bandwidth_beside: measure the read bandwidth (`read_bandwidth`) just before and just after each context and
    batch's alternated cached timings and set its rows' floor at the faster of the two (their "mem_bw_bytes_per_s"),
    rather than at the figure measured once at the start; default: when the machine is measured (no ceilings given).
    """
    weights = tuple(weights)
    for w in weights:
        if w not in WEIGHTS:
            raise ValueError(f"--weights: {w!r} is not one of {', '.join(WEIGHTS)}")
    env = environment()  # before any work: the load average then is other processes', not this run's
    tokenizer = None
    if gguf is not None:
        model, tokenizer = load_gguf(gguf, dequantize=False)
        m, peer, first_call, weights = model.config, False, False, (model.config.weights,)
    elif workdir is not None:
        model, tokenizer, trained = load_for_inference(workdir)
        m = trained.model
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    else:
        m = config.model
    if quick:
        contexts, batches = tuple(c for c in contexts if c <= 512) or tuple(contexts)[:1], tuple(batches)[:1]
    n = new_tokens if new_tokens is not None else (8 if quick else 128)
    n_re = recompute_new_tokens if recompute_new_tokens is not None else (2 if quick else 4)
    reps = reps if reps is not None else (1 if quick else 3)
    longest = max(contexts) + 1 + max(n, n_re)
    if longest > m.max_seq_len:
        raise ValueError(
            f"context {max(contexts)} + {1 + max(n, n_re)} new tokens exceeds model.max_seq_len="
            f"{m.max_seq_len}; raise it (e.g. model.max_seq_len={longest})"
        )
    for d in cache_dtypes:
        if d not in CACHE_DTYPES:
            raise ValueError(f"--cache-dtypes: {d!r} is not one of {tuple(CACHE_DTYPES)}")
    if speculative is not None:  # checked here, not after the other rows have run
        if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or not 1 <= draft_tokens <= 16:
            raise ValueError(f"--draft-tokens must be in 1..16, got {draft_tokens!r}")
        if isinstance(speculative, str) and speculative != "ngram":
            speculative = load_for_inference(speculative)[0]  # a draft model's workdir
        if not isinstance(speculative, str) and speculative.config.vocab_size != m.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({speculative.config.vocab_size} ids) differs from the model's "
                f"({m.vocab_size}): its proposals would mean other tokens"
            )
    status = peer_status() if peer else "skipped"
    if status == "ok":
        why = peer_mismatch(m)
        if why:
            status = f"not comparable ({why})"
        else:
            from transformers.utils import logging as hf_logging  # optional dependency

            hf_logging.set_verbosity_error()
    machine = ceilings or machine_ceilings(quick=quick)
    if bandwidth_beside is None:  # measured when the machine is: given ceilings (the tests') spend no time on it
        bandwidth_beside = ceilings is None
    beside = functools.partial(read_bandwidth, quick=quick) if bandwidth_beside else None
    latency = None
    if first_call:  # before this process compiles anything, while the machine is as quiet as it will be
        shape = config if workdir is None else trained
        latency = first_call_latency(shape, context=contexts[0], batch=batches[0], new_tokens=n)
    if workdir is None and gguf is None:
        _, params, _ = init_params(m, config.train.seed)
        model = model_from_params(m, params)

    def nbytes(model):
        return int(sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param))))

    weight_bytes = nbytes(model)
    variants = {
        w: model if w == model.config.weights else (quantize(model, w) if w != "float32" else None) for w in weights
    }
    if any(v is None for v in variants.values()):
        raise ValueError(f"--weights float32: the model's weights are {model.config.weights}, not float")
    variant_bytes = {w: nbytes(v) for w, v in variants.items()}  # what each row's floor counts
    peer_model = build_peer(m, params).eval() if status == "ok" else None
    rng = np.random.default_rng(0)
    rows = []
    trace = profile_trace(profile) if profile else contextlib.nullcontext()
    with trace:
        for context in contexts:
            for batch in batches:
                prompts = rng.integers(0, m.vocab_size, (batch, context), dtype=np.int64)
                # every (weights, cache) row of this context and batch: their cached timings alternate
                combos = [(w, v, d) for w, v in variants.items() for d in (None, *cache_dtypes)]
                cached = [_ours_runner(v, prompts, True, cache_dtype=d, **_same_program(n)) for _, v, d in combos]
                before = beside() if beside else None
                seconds = _decode_seconds_alternating(cached, n, reps)
                # the floor at the read bandwidth of the rows' own minutes: the faster of the reads just before
                # and after their alternated timings
                bw = max(before, beside()) if beside else machine["mem_bw_bytes_per_s"]
                group = []
                for (w, variant, cache_dtype), run, steps_s in zip(combos, cached, seconds, strict=True):
                    row = _decode_row(
                        variant,
                        m,
                        peer_model if cache_dtype is None and w == "float32" else None,
                        prompts,
                        n,
                        n_re if w == "float32" else 0,
                        reps,
                        variant_bytes[w],
                        cache_dtype,
                        run,
                        steps_s,
                        bw,
                    )
                    row["weights"], row["weight_bytes"] = w, variant_bytes[w]
                    group.append(row)
                for row in group:
                    base = [r for r in group if r["weights"] == "float32" and r["cache_dtype"] == row["cache_dtype"]]
                    row["ratio_vs_float32"] = ratio(
                        row["cached_tokens_per_s"], base[0]["cached_tokens_per_s"] if base else None
                    )
                rows += group
        spec = []
        if speculative is not None:
            spec = speculative_rows(model, tokenizer, speculative, draft_tokens, n, reps)
    loop = None
    if compare_loops:
        loop = decode_loop_comparison(model, 512 if 512 in contexts else contexts[0], 1, n=min(n, 64), reps=reps)
    return {
        "benchmark": "decode",
        "machine": machine,
        "jax_version": jax.__version__,
        "environment": env,
        "model": model_summary(m),
        "workdir": workdir,
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": m.kv_bytes_per_token(jnp.dtype(m.dtype).itemsize),
        "peer_status": status,
        "rows": rows,
        "speculative": {
            "draft": "ngram" if speculative == "ngram" else "model",
            "draft_tokens": draft_tokens,
            "rows": spec,
        }
        if speculative is not None
        else None,
        "decode_loop": loop,
        "first_call": latency,
        "profile": profile,
    }


def _decode_row(model, m, peer_model, prompts, n, n_re, reps, weight_bytes, cache_dtype, cached, steps_s, bw) -> dict:
    """One row of the table, given its cached runner, the seconds its n decode steps took (timed alternated with
    the other rows of its context and batch) and the read bandwidth of those minutes (bytes/s)."""
    batch, context = prompts.shape
    row = {
        "context": context,
        "batch": batch,
        "cache_dtype": cache_dtype or m.dtype,
        "new_tokens": n,
        "recompute_new_tokens": n_re,
        "mem_bw_bytes_per_s": bw,
    }
    bpt = decode_bytes_per_token(m, weight_bytes, context + 1 + n / 2, batch, cache_dtype)
    steps_s, row["retimed"], row["implausible"] = above_the_floor(
        steps_s,
        lambda k: _decode_seconds(cached, n, k),
        reps,
        batch * n * bpt / row["mem_bw_bytes_per_s"],
        f"context {context}, batch {batch}, {row['cache_dtype']} cache",
    )
    row["cached_tokens_per_s"] = batch * n / steps_s
    first = _ours_runner(model, prompts, True, cache_dtype=cache_dtype)  # the smallest room for new tokens
    row["prefill_tokens_per_s"] = batch * context / _best(lambda: first(1), reps)
    row["recompute_tokens_per_s"] = None
    if cache_dtype is None and n_re:  # recomputing is independent of how a cache would store K/V
        row["recompute_tokens_per_s"] = batch * n_re / _decode_seconds(_ours_runner(model, prompts, False), n_re, reps)
    row["cache_speedup"] = ratio(row["cached_tokens_per_s"], row["recompute_tokens_per_s"])
    row["bytes_per_token"] = bpt
    row["bandwidth_floor_tokens_per_s"] = row["mem_bw_bytes_per_s"] / bpt
    row["bandwidth_floor_fraction"] = row["cached_tokens_per_s"] / row["bandwidth_floor_tokens_per_s"]
    row["peer_cached_tokens_per_s"] = row["peer_recompute_tokens_per_s"] = row["peer_prefill_tokens_per_s"] = None
    if peer_model is not None:
        row["peer_cached_tokens_per_s"] = batch * n / _decode_seconds(peer_runner(peer_model, prompts, True), n, reps)
        if n_re:  # --recompute-new-tokens 0: no recompute row, ours or the peer's
            row["peer_recompute_tokens_per_s"] = (
                batch * n_re / _decode_seconds(peer_runner(peer_model, prompts, False), n_re, reps)
            )
        row["peer_prefill_tokens_per_s"] = batch * context / _best(peer_forward(peer_model, prompts), reps)
    row["cached_ratio_vs_peer"] = ratio(row["cached_tokens_per_s"], row["peer_cached_tokens_per_s"])
    row["recompute_ratio_vs_peer"] = ratio(row["recompute_tokens_per_s"], row["peer_recompute_tokens_per_s"])
    row["prefill_ratio_vs_peer"] = ratio(row["prefill_tokens_per_s"], row["peer_prefill_tokens_per_s"])
    return row


# ---- tables -------------------------------------------------------------------------------------------------


def format_decode(r: dict) -> str:
    """The decode result as a text table (what `causal-lm bench decode` prints)."""
    m = r["model"]
    peer = r["peer_status"] if r["peer_status"] != "ok" else "transformers generate"
    lines = header(r) + [
        f"model: {m['num_layers']} layers, d_model {m['d_model']}, {m['attention']}, {m['dtype']}; weights "
        f"{r['weight_bytes'] / 2**20:,.1f} MiB, K/V {r['kv_bytes_per_token'] / 1024:,.1f} KiB per token; "
        f"peer: {peer}",
        "tokens/s of generated tokens after the prompt (prefill excluded); floor = bandwidth floor (at the read "
        "bandwidth measured beside each row); "
        "prefill = prompt tokens/s of the first call's prompt pass",
        "",
        f"{'context':>7s} {'batch':>5s} {'weights':>7s} {'cache':>8s} {'cached':>9s} {'x f32':>6s} "
        f"{'recompute':>10s} {'cache x':>8s} "
        f"{'MB/token':>9s} {'floor %':>8s} {'at GB/s':>8s} {'prefill':>9s} {'peer cached':>12s} {'peer recomp':>12s} "
        f"{'peer prefill':>13s} {'cached/peer':>12s} {'recomp/peer':>12s} {'prefill/peer':>13s}",
    ]
    miss = "-" if r["peer_status"] == "ok" else "n/a"
    for w in r["rows"]:
        lines.append(
            f"{w['context']:>7d} {w['batch']:>5d} {w.get('weights', 'float32'):>7s} {w['cache_dtype']:>8s} "
            f"{w['cached_tokens_per_s']:>9,.1f} {fmt(w.get('ratio_vs_float32'), '.2f'):>6s} "
            f"{fmt(w['recompute_tokens_per_s'], ',.1f'):>10s} {fmt(w['cache_speedup'], ',.1f'):>7s}x "
            f"{w['bytes_per_token'] / 1e6:>9.2f} "
            f"{format(w['bandwidth_floor_fraction'], '.0%') + ('!' if w.get('implausible') else ''):>8s} "
            f"{w.get('mem_bw_bytes_per_s', r['machine']['mem_bw_bytes_per_s']) / 1e9:>8.1f} "
            f"{w['prefill_tokens_per_s']:>9,.0f} {fmt(w['peer_cached_tokens_per_s'], ',.1f', miss):>12s} "
            f"{fmt(w['peer_recompute_tokens_per_s'], ',.1f', miss):>12s} "
            f"{fmt(w['peer_prefill_tokens_per_s'], ',.0f', miss):>13s} "
            f"{fmt(w['cached_ratio_vs_peer'], '.2f', miss):>12s} "
            f"{fmt(w['recompute_ratio_vs_peer'], '.2f', miss):>12s} {fmt(w['prefill_ratio_vs_peer'], '.2f', miss):>13s}"
        )
    if any(w.get("implausible") for w in r["rows"]):
        lines.append(f"!: above {IMPLAUSIBLE_FLOOR:.0%} of the floor even when timed again: a timing artifact; rerun")
    sp = r.get("speculative")
    if sp:
        lines += [
            "",
            f"speculative decoding ({sp['draft']} drafts, up to {sp['draft_tokens']} per pass), batch 1, greedy:",
            f"{'prompt':>7s} {'plain tok/s':>12s} {'spec tok/s':>11s} {'speed-up':>9s} {'passes/token':>13s} "
            f"{'accepted':>9s} {'same tokens':>12s}",
        ]
        for w in sp["rows"]:
            lines.append(
                f"{w['prompt']:>7s} {w['plain_tokens_per_s']:>12,.1f} {w['speculative_tokens_per_s']:>11,.1f} "
                f"{w['speedup']:>8.2f}x {w['target_passes_per_token']:>13.2f} {w['acceptance'] * 100:>8.0f}% "
                f"{str(w['same_tokens_as_plain']):>12s}"
            )
    lp = r.get("decode_loop")
    if lp:
        lines += [
            "",
            f"decode loop, context {lp['context']}, batch {lp['batch']}, ms per step: on-device while_loop "
            f"{lp['while_loop_ms_per_step']:.2f}; Python loop over a jitted step "
            f"{lp['python_loop_ms_per_step']:.2f} (reading each token on the host: "
            f"{lp['python_loop_host_sync_ms_per_step']:.2f})",
        ]
    fc = r.get("first_call")
    if fc:
        lines += [
            "",
            f"first token of a fresh process (context {fc['context']}, batch {fc['batch']}): "
            f"{fc['first_call_first_token_s']:.2f} s compiling ({fc['first_call_cache_entries_added']} programs "
            f"cached), {fc['cached_compile_first_token_s']:.2f} s with them loaded from the persistent compilation "
            f"cache ({fc['cached_compile_cache_entries_added']} added)",
        ]
    return "\n".join(lines)
