"""`causal-lm bench train`: training throughput next to the PyTorch peer and the measured matmul peak."""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from causal_lm import compile_cache
from causal_lm.bench.common import (
    environment,
    fmt,
    header,
    machine_ceilings,
    model_summary,
    peer_status,
    ratio,
    time_steps,
)
from causal_lm.bench.peer import peer_mismatch, train_peer
from causal_lm.config import Config
from causal_lm.model import build_model
from causal_lm.train.metrics import train_flops_per_token
from causal_lm.train.profile import profile_trace
from causal_lm.train.state import hyperparams, init_params, init_train_state, make_optimizer, split_params
from causal_lm.train.step import build_train_step, train_step_key


def _train_inputs(config: Config, seed: int = 0):
    """(graphdef, params, rest, batch) for config: fresh parameters and one batch of random tokens."""
    m, t = config.model, config.train
    graphdef, params, rest = init_params(m, t.seed)
    rng = np.random.default_rng(seed)
    B, T = t.batch_size, t.seq_len
    tokens = rng.integers(0, m.vocab_size, (B, T + 1), dtype=np.int32)
    batch = {
        "tokens": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "segment_ids": np.ones((B, T), np.int32),
        "weights": np.ones((B, T), np.float32),
    }
    return graphdef, params, rest, {k: jnp.asarray(v) for k, v in batch.items()}


def _compile_train_step(config: Config, graphdef, state, rest, batch):
    """(compiled step, seconds to lower + compile it). The compiled step is `step(state, rest, batch, hp)`."""
    t = config.train
    # A new jitted function, never one compiled earlier in this process (the training loop's cached one would hand
    # back its compiled program, and the compile time would read 0).
    jitted = build_train_step(*train_step_key(config.model, t, graphdef))
    with compile_cache.bypassed():  # the CLI's persistent cache would hand back a program compiled in an earlier run
        t0 = time.perf_counter()
        compiled = jitted.lower(state, rest, batch, hyperparams(t)).compile()
        return compiled, time.perf_counter() - t0


def compile_seconds(config: Config, num_layers: int | None = None) -> float:
    """Seconds to lower + compile the training step of `config` (with `num_layers` layers if given). Nothing is
    run and the state is abstract, so a deep model costs no memory."""
    m = config.model if num_layers is None else config.model.replace(num_layers=num_layers)
    config = dataclasses.replace(config, model=m)
    graphdef, params, rest = split_params(nnx.eval_shape(lambda: build_model(m, 0)))
    optimizer = make_optimizer(config.train)
    state = jax.eval_shape(lambda p: init_train_state(p, optimizer, 0), params)
    B, T = config.train.batch_size, config.train.seq_len
    batch = {
        "tokens": jax.ShapeDtypeStruct((B, T), jnp.int32),
        "targets": jax.ShapeDtypeStruct((B, T), jnp.int32),
        "segment_ids": jax.ShapeDtypeStruct((B, T), jnp.int32),
        "weights": jax.ShapeDtypeStruct((B, T), jnp.float32),
    }
    return _compile_train_step(config, graphdef, state, rest, batch)[1]


def memory(compiled) -> dict | None:
    """The compiled program's memory (`compiled.memory_analysis()`), in bytes: peak_bytes is arguments + outputs +
    temporaries - aliased (donated) buffers, or the backend's own peak where it reports a larger one (XLA:CPU's is
    not a peak); None where the backend gives no analysis."""
    ma = compiled.memory_analysis()
    if ma is None:
        return None
    out = {
        "argument_bytes": ma.argument_size_in_bytes,
        "output_bytes": ma.output_size_in_bytes,
        "temp_bytes": ma.temp_size_in_bytes,
        "alias_bytes": ma.alias_size_in_bytes,
    }
    derived = out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"] - out["alias_bytes"]
    out["peak_bytes"] = max(derived, getattr(ma, "peak_memory_in_bytes", 0))
    return out


def _train_ours(config: Config, graphdef, params, rest, batch, steps: int, warmup: int) -> dict:
    t = config.train
    state = init_train_state(jax.tree.map(jnp.copy, params), make_optimizer(t), t.seed)  # the step donates it
    compiled, compile_s = _compile_train_step(config, graphdef, state, rest, batch)
    mem = memory(compiled)
    hp = hyperparams(t)
    box = {"state": state}
    t0 = time.perf_counter()
    box["state"], metrics = compiled(box["state"], rest, batch, hp)
    first_loss = float(metrics["loss"])  # blocks: the first step, run
    first_step_s = time.perf_counter() - t0

    def run_step():
        box["state"], m = compiled(box["state"], rest, batch, hp)
        jax.block_until_ready(m)

    times = time_steps(run_step, steps, max(0, warmup - 1))
    return {
        "step_times_s": times,
        "compile_s": compile_s,
        "first_step_run_s": first_step_s,
        "first_loss": first_loss,
        "memory": mem,
    }


def bench_train(
    config: Config,
    *,
    steps: int | None = None,
    warmup: int | None = None,
    peer: bool = True,
    quick: bool = False,
    compile_layers: Sequence[int] = (2, 12),
    ceilings: dict | None = None,
    profile: str | None = None,
    remat: Sequence[str] = (),
) -> dict:
    """Training throughput of `config` (its model and train.batch_size x train.seq_len) and of the peer.

    profile: write a jax.profiler trace of our timed steps into this directory.
    remat: also time the step under each of these `model.remat` policies (rows of step time and peak memory).

    Returns the JSON object of `causal-lm bench train --json`: machine, jax_version, ours {tokens_per_s, step_s,
    mfu, compile_s, ...}, peer {tokens_per_s, step_s, mfu, ...} or None, ratio_vs_peer, compile_layers (compile
    seconds of the first step at each depth in compile_layers and their ratio) and the environment.
    """
    env = environment()  # before any work: the load average then is other processes', not this run's
    steps = steps if steps is not None else (2 if quick else 5)
    warmup = warmup if warmup is not None else (1 if quick else 2)
    m, t = config.model, config.train
    status = peer_status() if peer else "skipped"
    if status == "ok" and peer_mismatch(m):
        status = f"not comparable ({peer_mismatch(m)})"
    machine = ceilings or machine_ceilings(quick=quick)
    graphdef, params, rest, batch = _train_inputs(config)
    tokens_per_step = t.batch_size * t.seq_len
    flops_per_token = train_flops_per_token(m, params, t.seq_len)

    def summary(times):
        step_s = statistics.median(times)
        tps = tokens_per_step / step_s
        return {
            "tokens_per_s": tps,
            "step_s": step_s,
            "mfu": tps * flops_per_token / machine["matmul_flops"],
            "step_times_s": times,
        }

    with profile_trace(profile) if profile else contextlib.nullcontext():
        r = _train_ours(config, graphdef, params, rest, batch, steps, warmup)
    ours = {**summary(r.pop("step_times_s")), **r}
    peer_result = None
    if status == "ok":
        r = train_peer(config, params, batch, steps, warmup)
        peer_result = {**summary(r.pop("step_times_s")), **r}
    remat_rows = []
    for policy in remat:
        c = dataclasses.replace(config, model=m.replace(remat=policy))
        # the model's graph carries its config (and so the policy): a new one, with the same parameters
        policy_graphdef, _, _ = split_params(nnx.eval_shape(lambda c=c: build_model(c.model, 0)))
        r = _train_ours(c, policy_graphdef, params, rest, batch, steps, warmup)
        row = summary(r.pop("step_times_s"))
        remat_rows.append({"remat": policy, "step_s": row["step_s"], "tokens_per_s": row["tokens_per_s"], **r})
    depth = {}
    for n in compile_layers:
        depth[str(n)] = compile_seconds(config, n)
    if len(compile_layers) >= 2:
        lo, hi = min(compile_layers), max(compile_layers)
        depth["ratio"] = depth[str(hi)] / depth[str(lo)]
    return {
        "benchmark": "train",
        "machine": machine,
        "jax_version": jax.__version__,
        "environment": env,
        "model": model_summary(m),
        "batch_size": t.batch_size,
        "seq_len": t.seq_len,
        "train_flops_per_token": flops_per_token,
        "ours": ours,
        "peer": peer_result,
        "peer_status": status,
        "ratio_vs_peer": ratio(ours["tokens_per_s"], peer_result and peer_result["tokens_per_s"]),
        "compile_layers": depth,
        "remat": remat_rows,
        "profile": profile,
    }


# ---- decoding -----------------------------------------------------------------------------------------------


def format_train(r: dict) -> str:
    """The train result as a text table (what `causal-lm bench train` prints)."""
    m, o, p = r["model"], r["ours"], r["peer"]
    peer_missing = ("n/a" if r["peer_status"].startswith("not comparable") else r["peer_status"]) if p is None else None
    lines = header(r) + [
        f"model: {m['num_layers']} layers, d_model {m['d_model']}, {m['num_heads']} heads ({m['attention']}), "
        f"mlp {m['mlp_dim']}, vocab {m['vocab_size']}, {m['dtype']}; batch {r['batch_size']} x {r['seq_len']} "
        f"tokens; {r['train_flops_per_token'] / 1e6:,.1f} MFLOP per token (causal attention halved)",
        "",
        f"{'':22s}{'ours (JAX)':>14s}{'peer (PyTorch)':>16s}{'ours / peer':>13s}",
    ]

    def row(label, a, b, spec, with_ratio=True):
        pb = peer_missing if b is None and peer_missing else fmt(b, spec)
        rt = fmt(ratio(a, b), ".2f") + "x" if with_ratio and b is not None else ""
        lines.append(f"{label:22s}{fmt(a, spec):>14s}{pb:>16s}{rt:>13s}")

    row("tokens/s", o["tokens_per_s"], p and p["tokens_per_s"], ",.0f")
    row("step time (s)", o["step_s"], p and p["step_s"], ".3f", with_ratio=False)
    row("MFU (%, measured peak)", o["mfu"] * 100, p and p["mfu"] * 100, ".1f", with_ratio=False)
    lines.append(f"{'first-step compile (s)':22s}{o['compile_s']:>14.1f}")
    d = r.get("compile_layers") or {}
    if "ratio" in d:
        depths = sorted(int(k) for k in d if k != "ratio")
        lines.append(
            "compile time by depth: "
            + ", ".join(f"{k} layers {d[str(k)]:.1f} s" for k in depths)
            + f" (ratio {d['ratio']:.2f})"
        )
    if o.get("memory"):
        lines.append(f"{'peak memory (MiB)':22s}{o['memory']['peak_bytes'] / 2**20:>14.1f}")
    if r.get("remat"):
        lines += ["", f"{'model.remat':22s}{'step time (s)':>14s}{'peak (MiB)':>16s}{'temp (MiB)':>13s}"]
        for row in r["remat"]:
            mem = row["memory"] or {}
            peak, temp = mem.get("peak_bytes"), mem.get("temp_bytes")
            lines.append(
                f"{row['remat']:22s}{row['step_s']:>14.3f}{fmt(peak and peak / 2**20, '.1f'):>16s}"
                f"{fmt(temp and temp / 2**20, '.1f'):>13s}"
            )
    if r["peer_status"].startswith("not comparable"):
        lines.append(f"peer: {r['peer_status']}")
    return "\n".join(lines)
