"""`causal-lm bench decode`: generation throughput with the KV cache and with recompute, next to the PyTorch
peer's `generate`, and against the bandwidth floor (weights and K/V read once per generated token)."""

from __future__ import annotations

import functools
import time
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
    settle,
    timed,
)
from causal_lm.bench.peer import build_peer, check_peer_shape, peer_runner
from causal_lm.config import Config, ModelConfig
from causal_lm.decode import generate
from causal_lm.interop.hf import model_from_params
from causal_lm.model.kv_cache import init_cache
from causal_lm.train.state import init_params

DEFAULT_CONTEXTS = (128, 512, 1024, 2048)


DEFAULT_BATCHES = (1, 8)


# ---- the machine -------------------------------------------------------------------------------------------


def _decode_seconds(run: Callable[[int], None], n: int, reps: int) -> float:
    """Seconds for n decode steps: best t(1 + n new tokens) - best t(1 new token) (prefill and the first token
    cancel). Each length runs once first (compiles, warms up); then the two alternate, so a burst of load on a
    shared machine tends to hit one rep of each rather than all of one."""
    run(1)
    run(1 + n)
    settle()
    t_one = t_all = float("inf")
    for _ in range(reps):
        t_one = min(t_one, timed(lambda: run(1)))
        t_all = min(t_all, timed(lambda: run(1 + n)))
    return max(t_all - t_one, 1e-9)


def _ours_runner(model, prompts: np.ndarray, use_cache: bool):
    rows = prompts.tolist()

    def run(k: int):
        generate(model, rows, max_new_tokens=k, use_cache=use_cache)  # returns host tokens: waits for the device

    return run


def decode_loop_comparison(model, context: int, batch: int = 1, n: int = 64, reps: int = 2) -> dict:
    """ms per generated token (greedy, cached) of generate's on-device while_loop vs a Python loop over a jitted
    one-token step (cache donated, the layers' weights sliced once, tokens kept on the device), and the same
    Python loop reading each token back to the host (what a streaming loop in Python does)."""
    graphdef, state = nnx.split(model)
    prompts = np.random.default_rng(1).integers(0, model.config.vocab_size, (batch, context), dtype=np.int32)
    device_loop = _decode_seconds(_ours_runner(model, prompts, True), n, reps) / n

    @jax.jit
    def split(state):
        return nnx.merge(graphdef, state).split_layers()

    @functools.partial(jax.jit, donate_argnames=("cache",))
    def prefill(state, tokens, cache):
        logits, cache = nnx.merge(graphdef, state)(tokens, cache=cache)
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache

    @functools.partial(jax.jit, donate_argnames=("cache",))
    def step(state, layers, tok, cache):
        logits, cache = nnx.merge(graphdef, state)(tok[:, None], cache=cache, layers=layers)
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache

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


def decode_bytes_per_token(m: ModelConfig, weight_bytes: int, context: float, batch: int) -> float:
    """Bytes a decode step must read per generated token: every weight once per step (shared by the batch) plus
    each row's cached K/V for `context` tokens."""
    kv = m.kv_bytes_per_token(jnp.dtype(m.dtype).itemsize)
    return (weight_bytes + batch * context * kv) / batch


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
) -> dict:
    """Decode throughput of `generate` with and without the KV cache, per (context, batch), and of the peer.

    new_tokens (cached) and recompute_new_tokens are the decode steps timed after the prompt (a recompute step
    costs a whole forward pass over the context, so it gets fewer). Returns the JSON object of
    `causal-lm bench decode --json`: machine, jax_version and rows [{context, batch, cached_tokens_per_s,
    recompute_tokens_per_s, bandwidth_floor_fraction, peer_cached_tokens_per_s, peer_recompute_tokens_per_s,
    ...}], and decode_loop: `decode_loop_comparison` at context 512 (or the first), batch 1.
    """
    env = environment()  # before any work: the load average then is other processes', not this run's
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
    status = peer_status() if peer else "skipped"
    if status == "ok":
        check_peer_shape(m)
        from transformers.utils import logging as hf_logging  # optional dependency

        hf_logging.set_verbosity_error()
    machine = ceilings or machine_ceilings(quick=quick)
    _, params, _ = init_params(m, config.train.seed)
    model = model_from_params(m, params)
    weight_bytes = int(sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param))))
    peer_model = build_peer(m, params).eval() if status == "ok" else None
    rng = np.random.default_rng(0)
    rows = []
    for context in contexts:
        for batch in batches:
            prompts = rng.integers(0, m.vocab_size, (batch, context), dtype=np.int64)
            row = {"context": context, "batch": batch, "new_tokens": n, "recompute_new_tokens": n_re}
            row["cached_tokens_per_s"] = batch * n / _decode_seconds(_ours_runner(model, prompts, True), n, reps)
            row["recompute_tokens_per_s"] = (
                batch * n_re / _decode_seconds(_ours_runner(model, prompts, False), n_re, reps)
            )
            row["cache_speedup"] = row["cached_tokens_per_s"] / row["recompute_tokens_per_s"]
            bpt = decode_bytes_per_token(m, weight_bytes, context + 1 + n / 2, batch)
            row["bytes_per_token"] = bpt
            row["bandwidth_floor_tokens_per_s"] = machine["mem_bw_bytes_per_s"] / bpt
            row["bandwidth_floor_fraction"] = row["cached_tokens_per_s"] / row["bandwidth_floor_tokens_per_s"]
            row["peer_cached_tokens_per_s"] = row["peer_recompute_tokens_per_s"] = None
            if peer_model is not None:
                row["peer_cached_tokens_per_s"] = (
                    batch * n / _decode_seconds(peer_runner(peer_model, prompts, True), n, reps)
                )
                row["peer_recompute_tokens_per_s"] = (
                    batch * n_re / _decode_seconds(peer_runner(peer_model, prompts, False), n_re, reps)
                )
            row["cached_ratio_vs_peer"] = ratio(row["cached_tokens_per_s"], row["peer_cached_tokens_per_s"])
            row["recompute_ratio_vs_peer"] = ratio(row["recompute_tokens_per_s"], row["peer_recompute_tokens_per_s"])
            rows.append(row)
    loop = None
    if compare_loops:
        loop = decode_loop_comparison(model, 512 if 512 in contexts else contexts[0], 1, n=min(n, 64), reps=reps)
    return {
        "benchmark": "decode",
        "machine": machine,
        "jax_version": jax.__version__,
        "environment": env,
        "model": model_summary(m),
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": m.kv_bytes_per_token(jnp.dtype(m.dtype).itemsize),
        "peer_status": status,
        "rows": rows,
        "decode_loop": loop,
    }


# ---- tables -------------------------------------------------------------------------------------------------


def format_decode(r: dict) -> str:
    """The decode result as a text table (what `causal-lm bench decode` prints)."""
    m = r["model"]
    lines = header(r) + [
        f"model: {m['num_layers']} layers, d_model {m['d_model']}, {m['attention']}, {m['dtype']}; weights "
        f"{r['weight_bytes'] / 2**20:,.1f} MiB, K/V {r['kv_bytes_per_token'] / 1024:,.1f} KiB per token; "
        f"peer: {r['peer_status'] if r['peer_status'] != 'ok' else 'transformers generate'}",
        "tokens/s of generated tokens after the prompt (prefill excluded); floor = bandwidth floor",
        "",
        f"{'context':>7s} {'batch':>5s} {'cached':>9s} {'recompute':>10s} {'cache x':>8s} {'MB/token':>9s} "
        f"{'floor %':>8s} {'peer cached':>12s} {'peer recomp':>12s} {'cached/peer':>12s} {'recomp/peer':>12s}",
    ]
    for w in r["rows"]:
        miss = "-" if r["peer_status"] == "ok" else r["peer_status"]
        lines.append(
            f"{w['context']:>7d} {w['batch']:>5d} {w['cached_tokens_per_s']:>9,.1f} "
            f"{w['recompute_tokens_per_s']:>10,.1f} {w['cache_speedup']:>7,.1f}x {w['bytes_per_token'] / 1e6:>9.2f} "
            f"{w['bandwidth_floor_fraction'] * 100:>7.0f}% {fmt(w['peer_cached_tokens_per_s'], ',.1f', miss):>12s} "
            f"{fmt(w['peer_recompute_tokens_per_s'], ',.1f', miss):>12s} "
            f"{fmt(w['cached_ratio_vs_peer'], '.2f', miss):>12s} "
            f"{fmt(w['recompute_ratio_vs_peer'], '.2f', miss):>12s}"
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
    return "\n".join(lines)
