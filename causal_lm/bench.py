"""Benchmarks: training and decoding speed next to the PyTorch stack people would use instead, and against the
machine's own measured ceilings, all in one process run.

    machine_ceilings()    matmul FLOP/s (a large float32 matmul through JAX) and memory read bandwidth (a jitted
                          reduction over a 256 MiB array): the peaks MFU and the decode floor are measured against
    bench_train(config)   tokens/s, median step time after warm-up, MFU, first-step compile time, compile time at 2
                          and 12 layers; the peer: the same step in transformers' LlamaForCausalLM (sdpa attention,
                          torch AdamW, the same weights and batch)
    bench_decode(config)  `generate` tokens/s with the KV cache and with recompute at context lengths x batch
                          sizes, bytes read per generated token and the share of the bandwidth floor reached; the
                          peer: transformers' `generate` with and without its cache

How things are timed (both sides alike):
  - train: `warmup` steps, then `steps` steps each timed to completion; the median is the step time. Compile
    time is lowering + compiling the first step (ahead of time, so it is not mixed with running it).
  - decode: a generated token's time is measured as t(1 + n new tokens) - t(1 new token), the best of `reps`
    calls each, so the prompt's prefill (and the first token) cancel out and only the n decode steps remain.
    Prompts are `context` random tokens; every row is as long as the others.
  - the peer runs with torch's default intra-op threads (one per core), in float32, in train mode without dropout.

Ratios are ours / peer: above 1 means faster than the peer. MFU uses the explicit FLOP count of
`causal_lm.train.metrics` (causal attention counted at half of full attention) against the measured matmul peak,
for both sides. Decode's bandwidth floor: a decode step must read every weight once and each row's K/V for its
context, so (weight bytes + batch x context x K/V bytes per token) / batch bytes per generated token at the
measured read bandwidth is the fastest it can be; small models whose weights fit in the last-level cache can beat
it (fraction > 1).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import platform
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from causal_lm.config import Config, ModelConfig

NOT_INSTALLED = "not installed"
DEFAULT_CONTEXTS = (128, 512, 1024, 2048)
DEFAULT_BATCHES = (1, 8)


# ---- the machine -------------------------------------------------------------------------------------------


def _best_time(fn: Callable[[], object], *, min_reps: int = 3, min_seconds: float = 0.5) -> float:
    """Fastest of repeated calls of fn (which blocks until done): at least min_reps calls and min_seconds."""
    fn()
    best, reps, t_start = float("inf"), 0, time.perf_counter()
    while reps < min_reps or time.perf_counter() - t_start < min_seconds:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        reps += 1
    return best


def machine_ceilings(*, quick: bool = False) -> dict:
    """{"matmul_flops", "mem_bw_bytes_per_s", ...}: the fastest a large float32 matmul and a large read ran.

    matmul: n x n float32 @ n x n through jax.jit (n = 2048 on a CPU, 8192 on an accelerator); bandwidth: a jitted
    sum and a jitted max over a float32 array far larger than any cache (256 MiB; 64 MiB with quick), the faster
    of the two. Both are the best of several runs, so a busy machine lowers them less than it lowers a mean.
    """
    dev = jax.devices()[0]
    n = 2048 if dev.platform == "cpu" else 8192
    if quick:
        n //= 2
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    mm = jax.jit(lambda x, y: x @ y)
    t_mm = _best_time(lambda: mm(a, b).block_until_ready(), min_seconds=0.3 if quick else 1.0)
    nbytes = (64 if quick else 256) * 2**20
    x = jnp.ones((2048, nbytes // 4 // 2048), jnp.float32)
    reads = [jax.jit(lambda x: jnp.sum(x, axis=1)), jax.jit(lambda x: jnp.max(x, axis=1))]
    t_bw = min(_best_time(lambda f=f: f(x).block_until_ready(), min_seconds=0.2 if quick else 0.5) for f in reads)
    return {
        "matmul_flops": 2.0 * n**3 / t_mm,
        "matmul_n": n,
        "mem_bw_bytes_per_s": nbytes / t_bw,
        "mem_bw_array_bytes": nbytes,
        "device": dev.device_kind,
        "platform": dev.platform,
        "device_count": jax.device_count(),
    }


def environment() -> dict:
    """What the numbers were measured on: CPU model, core count, library versions, date."""
    import os

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "jax_version": jax.__version__,
        "jaxlib_version": getattr(jax.lib, "__version__", None) or _version("jaxlib"),
        "torch_version": _version("torch"),
        "transformers_version": _version("transformers"),
        "date": datetime.date.today().isoformat(),
        "load_avg_1min": load,
    }


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def peer_status() -> str:
    """ "ok" when torch and transformers import, else why the peer columns are empty ("not installed")."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return NOT_INSTALLED
    return "ok"


def _ratio(ours: float | None, peer: float | None) -> float | None:
    return None if ours is None or peer is None or peer <= 0 else ours / peer


# ---- shared setup -------------------------------------------------------------------------------------------


def _check_peer_shape(m: ModelConfig) -> None:
    """The peer runs our weights in LlamaForCausalLM: the shape must be one Llama expresses (raises if not)."""
    from causal_lm.interop.hf import hf_config_from_model

    hf_config_from_model(m, "llama")


def _peer_model(m: ModelConfig, params: dict):
    """transformers' LlamaForCausalLM with sdpa attention holding exactly `params` (float32, CPU)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from causal_lm.interop.hf import hf_config_from_model, hf_tensors_from_model, model_from_params

    cfg = hf_config_from_model(m, "llama")
    cfg = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "dtype", "torch_dtype")}
    hf_config = LlamaConfig(**cfg)
    hf_config._attn_implementation = "sdpa"
    peer = LlamaForCausalLM(hf_config).to(torch.float32)
    tensors = hf_tensors_from_model(model_from_params(m, params))
    state = {k: torch.from_numpy(np.array(v, np.float32)) for k, v in tensors.items()}
    missing, unexpected = peer.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and m.tie_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"peer weights do not match: missing {missing}, unexpected {unexpected}")
    if m.tie_embeddings:
        peer.tie_weights()
    return peer


def _model_summary(m: ModelConfig) -> dict:
    return {
        "num_layers": m.num_layers,
        "d_model": m.d_model,
        "num_heads": m.num_heads,
        "kv_heads": m.kv_heads,
        "mlp_dim": m.mlp_dim,
        "vocab_size": m.vocab_size,
        "tie_embeddings": m.tie_embeddings,
        "dtype": m.dtype,
        "param_dtype": m.param_dtype,
        "attention": m.attention_label,
        "scan_layers": m.scan_layers,
        "remat": m.remat,
        "attention_impl": m.attention_impl,
    }


# ---- training -----------------------------------------------------------------------------------------------


def _train_inputs(config: Config, seed: int = 0):
    """(graphdef, params, rest, batch) for config: fresh parameters and one batch of random tokens."""
    from causal_lm.train.state import init_params

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
    from causal_lm.train.state import hyperparams
    from causal_lm.train.step import _compiled_train_step

    t = config.train
    # __wrapped__: a new jitted function, never one compiled earlier in this process (the lru_cache would hand
    # back the same jit object, whose compiled program is cached, and the compile time would read 0).
    jitted = _compiled_train_step.__wrapped__(config.model, t.microbatches, t.grad_clip > 0, graphdef)
    t0 = time.perf_counter()
    compiled = jitted.lower(state, rest, batch, hyperparams(t)).compile()
    return compiled, time.perf_counter() - t0


def compile_seconds(config: Config, num_layers: int | None = None) -> float:
    """Seconds to lower + compile the training step of `config` (with `num_layers` layers if given). Nothing is
    run and the state is abstract, so a deep model costs no memory."""
    from flax import nnx

    from causal_lm.model import build_model
    from causal_lm.train.state import _jitted_init, init_train_state, make_optimizer, split_params

    m = config.model if num_layers is None else dataclasses.replace(config.model, num_layers=num_layers)
    config = dataclasses.replace(config, model=m)
    graphdef = split_params(nnx.eval_shape(lambda: build_model(m, 0)))[0]
    params, rest = jax.eval_shape(_jitted_init(m), 0)
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


SETTLE_SECONDS = 1.0


def _settle() -> None:
    """A pause (SETTLE_SECONDS) before a timed section. torch's OpenMP threads spin-wait by default; on a busy
    2-core machine, the forward's and the backward's thread teams then stall each other (1 s per step of a model
    that takes 0.02 s) until the threads have idled once. Both sides get the same pause."""
    time.sleep(SETTLE_SECONDS)


def _time_steps(run_step: Callable[[], None], steps: int, warmup: int) -> list:
    for _ in range(warmup):
        run_step()
    _settle()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        run_step()
        times.append(time.perf_counter() - t0)
    return times


def _train_ours(config: Config, graphdef, params, rest, batch, steps: int, warmup: int) -> dict:
    from causal_lm.train.state import hyperparams, init_train_state, make_optimizer

    t = config.train
    state = init_train_state(jax.tree.map(jnp.copy, params), make_optimizer(t), t.seed)  # the step donates it
    compiled, compile_s = _compile_train_step(config, graphdef, state, rest, batch)
    hp = hyperparams(t)
    box = {"state": state}
    t0 = time.perf_counter()
    box["state"], metrics = compiled(box["state"], rest, batch, hp)
    first_loss = float(metrics["loss"])  # blocks: the first step, run
    first_step_s = time.perf_counter() - t0

    def run_step():
        box["state"], m = compiled(box["state"], rest, batch, hp)
        jax.block_until_ready(m)

    times = _time_steps(run_step, steps, max(0, warmup - 1))
    return {"step_times_s": times, "compile_s": compile_s, "first_step_run_s": first_step_s, "first_loss": first_loss}


def _train_peer(config: Config, params, batch, steps: int, warmup: int) -> dict:
    """The same step in PyTorch: LlamaForCausalLM (sdpa) forward, float32 cross entropy over the same targets,
    backward, global-norm clipping, torch AdamW with our hyperparameters (weight decay on matrices only)."""
    import torch
    import torch.nn.functional as F

    m, t = config.model, config.train
    peer = _peer_model(m, params).train()
    decay = [p for n, p in peer.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in peer.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=t.learning_rate,
        betas=(t.beta1, t.beta2),
        eps=1e-8,
    )
    tokens = torch.from_numpy(np.array(batch["tokens"])).long()
    targets = torch.from_numpy(np.array(batch["targets"])).long()
    losses = []

    def run_step():
        logits = peer(input_ids=tokens).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(peer.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())

    times = _time_steps(run_step, steps, warmup)
    return {
        "step_times_s": times,
        "first_loss": losses[0],
        "threads": torch.get_num_threads(),
        "attn_implementation": peer.config._attn_implementation,
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
) -> dict:
    """Training throughput of `config` (its model and train.batch_size x train.seq_len) and of the peer.

    Returns the JSON object of `causal-lm bench train --json`: machine, jax_version, ours {tokens_per_s, step_s,
    mfu, compile_s, ...}, peer {tokens_per_s, step_s, mfu, ...} or None, ratio_vs_peer, compile_layers (compile
    seconds of the first step at each depth in compile_layers and their ratio) and the environment.
    """
    from causal_lm.train.metrics import train_flops_per_token

    env = environment()  # before any work: the load average then is other processes', not this run's
    steps = steps if steps is not None else (2 if quick else 5)
    warmup = warmup if warmup is not None else (1 if quick else 2)
    m, t = config.model, config.train
    status = peer_status() if peer else "skipped"
    if status == "ok":
        _check_peer_shape(m)
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

    r = _train_ours(config, graphdef, params, rest, batch, steps, warmup)
    ours = {**summary(r.pop("step_times_s")), **r}
    peer_result = None
    if status == "ok":
        r = _train_peer(config, params, batch, steps, warmup)
        peer_result = {**summary(r.pop("step_times_s")), **r}
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
        "model": _model_summary(m),
        "batch_size": t.batch_size,
        "seq_len": t.seq_len,
        "train_flops_per_token": flops_per_token,
        "ours": ours,
        "peer": peer_result,
        "peer_status": status,
        "ratio_vs_peer": _ratio(ours["tokens_per_s"], peer_result and peer_result["tokens_per_s"]),
        "compile_layers": depth,
    }


# ---- decoding -----------------------------------------------------------------------------------------------


def _decode_seconds(run: Callable[[int], None], n: int, reps: int) -> float:
    """Seconds for n decode steps: best t(1 + n new tokens) - best t(1 new token) (prefill and the first token
    cancel). Each length runs once first (compiles, warms up); then the two alternate, so a burst of load on a
    shared machine tends to hit one rep of each rather than all of one."""
    run(1)
    run(1 + n)
    _settle()
    t_one = t_all = float("inf")
    for _ in range(reps):
        t_one = min(t_one, _timed(lambda: run(1)))
        t_all = min(t_all, _timed(lambda: run(1 + n)))
    return max(t_all - t_one, 1e-9)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _ours_runner(model, prompts: np.ndarray, use_cache: bool):
    from causal_lm.decode import generate

    rows = prompts.tolist()

    def run(k: int):
        generate(model, rows, max_new_tokens=k, use_cache=use_cache)  # returns host tokens: waits for the device

    return run


def _peer_runner(peer, prompts: np.ndarray, use_cache: bool):
    import torch

    ids = torch.from_numpy(prompts).long()
    mask = torch.ones_like(ids)

    def run(k: int):
        with torch.no_grad():
            out = peer.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=k,
                min_new_tokens=k,
                do_sample=False,
                use_cache=use_cache,
                pad_token_id=0,
            )
        assert out.shape[1] == ids.shape[1] + k

    return run


def decode_loop_comparison(model, context: int, batch: int = 1, n: int = 64, reps: int = 2) -> dict:
    """ms per generated token (greedy, cached) of generate's on-device while_loop vs a Python loop over a jitted
    one-token step (cache donated, the layers' weights sliced once, tokens kept on the device), and the same
    Python loop reading each token back to the host (what a streaming loop in Python does)."""
    from flax import nnx

    from causal_lm.model.kv_cache import init_cache

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
    _settle()
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
    from flax import nnx

    from causal_lm.interop.hf import model_from_params
    from causal_lm.train.state import init_params

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
        _check_peer_shape(m)
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    machine = ceilings or machine_ceilings(quick=quick)
    _, params, _ = init_params(m, config.train.seed)
    model = model_from_params(m, params)
    weight_bytes = int(sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param))))
    peer_model = _peer_model(m, params).eval() if status == "ok" else None
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
                    batch * n / _decode_seconds(_peer_runner(peer_model, prompts, True), n, reps)
                )
                row["peer_recompute_tokens_per_s"] = (
                    batch * n_re / _decode_seconds(_peer_runner(peer_model, prompts, False), n_re, reps)
                )
            row["cached_ratio_vs_peer"] = _ratio(row["cached_tokens_per_s"], row["peer_cached_tokens_per_s"])
            row["recompute_ratio_vs_peer"] = _ratio(row["recompute_tokens_per_s"], row["peer_recompute_tokens_per_s"])
            rows.append(row)
    loop = None
    if compare_loops:
        loop = decode_loop_comparison(model, 512 if 512 in contexts else contexts[0], 1, n=min(n, 64), reps=reps)
    return {
        "benchmark": "decode",
        "machine": machine,
        "jax_version": jax.__version__,
        "environment": env,
        "model": _model_summary(m),
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": m.kv_bytes_per_token(jnp.dtype(m.dtype).itemsize),
        "peer_status": status,
        "rows": rows,
        "decode_loop": loop,
    }


# ---- tables -------------------------------------------------------------------------------------------------


def _fmt(x, spec: str = ",.0f", missing: str = "-") -> str:
    return missing if x is None else format(x, spec)


def _header(r: dict) -> list:
    e, mc = r["environment"], r["machine"]
    return [
        f"{e['cpu']} ({e['cores']} cores), JAX {r['jax_version']}, torch {e['torch_version'] or '-'}, "
        f"transformers {e['transformers_version'] or '-'}, {e['date']}, 1-min load at start "
        f"{_fmt(e['load_avg_1min'], '.2f')}",
        f"machine: matmul {mc['matmul_flops'] / 1e9:,.1f} GFLOP/s (float32 {mc['matmul_n']}^3), "
        f"memory read {mc['mem_bw_bytes_per_s'] / 1e9:,.1f} GB/s",
    ]


def format_train(r: dict) -> str:
    """The train result as a text table (what `causal-lm bench train` prints)."""
    m, o, p = r["model"], r["ours"], r["peer"]
    peer_missing = r["peer_status"] if p is None else None
    lines = _header(r) + [
        f"model: {m['num_layers']} layers, d_model {m['d_model']}, {m['num_heads']} heads ({m['attention']}), "
        f"mlp {m['mlp_dim']}, vocab {m['vocab_size']}, {m['dtype']}; batch {r['batch_size']} x {r['seq_len']} "
        f"tokens; {r['train_flops_per_token'] / 1e6:,.1f} MFLOP per token (causal attention halved)",
        "",
        f"{'':22s}{'ours (JAX)':>14s}{'peer (PyTorch)':>16s}{'ours / peer':>13s}",
    ]

    def row(label, a, b, spec, ratio=True):
        pb = peer_missing if b is None and peer_missing else _fmt(b, spec)
        rt = _fmt(_ratio(a, b), ".2f") + "x" if ratio and b is not None else ""
        lines.append(f"{label:22s}{_fmt(a, spec):>14s}{pb:>16s}{rt:>13s}")

    row("tokens/s", o["tokens_per_s"], p and p["tokens_per_s"], ",.0f")
    row("step time (s)", o["step_s"], p and p["step_s"], ".3f", ratio=False)
    row("MFU (%, measured peak)", o["mfu"] * 100, p and p["mfu"] * 100, ".1f", ratio=False)
    lines.append(f"{'first-step compile (s)':22s}{o['compile_s']:>14.1f}")
    d = r.get("compile_layers") or {}
    if "ratio" in d:
        depths = sorted(int(k) for k in d if k != "ratio")
        lines.append(
            "compile time by depth: "
            + ", ".join(f"{k} layers {d[str(k)]:.1f} s" for k in depths)
            + f" (ratio {d['ratio']:.2f})"
        )
    return "\n".join(lines)


def format_decode(r: dict) -> str:
    """The decode result as a text table (what `causal-lm bench decode` prints)."""
    m = r["model"]
    lines = _header(r) + [
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
            f"{w['bandwidth_floor_fraction'] * 100:>7.0f}% {_fmt(w['peer_cached_tokens_per_s'], ',.1f', miss):>12s} "
            f"{_fmt(w['peer_recompute_tokens_per_s'], ',.1f', miss):>12s} "
            f"{_fmt(w['cached_ratio_vs_peer'], '.2f', miss):>12s} "
            f"{_fmt(w['recompute_ratio_vs_peer'], '.2f', miss):>12s}"
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
