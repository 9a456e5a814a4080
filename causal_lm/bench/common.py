"""What every benchmark shares: the machine's measured ceilings, the environment, timing, table formatting."""

from __future__ import annotations

import datetime
import functools
import os
import platform
import time
from collections.abc import Callable
from importlib import metadata

import jax
import jax.numpy as jnp

from causal_lm.config import ModelConfig

NOT_INSTALLED = "not installed"


SETTLE_SECONDS = 1.0


def best_time(fn: Callable[[], object], *, min_reps: int = 3, min_seconds: float = 0.5) -> float:
    """Fastest of repeated calls of fn (which blocks until done): at least min_reps calls and min_seconds."""
    fn()
    best, reps, t_start = float("inf"), 0, time.perf_counter()
    while reps < min_reps or time.perf_counter() - t_start < min_seconds:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        reps += 1
    return best


def _read_bytes(quick: bool) -> int:
    return (64 if quick else 256) * 2**20


@functools.lru_cache(maxsize=1)
def _read_probe(nbytes: int):
    """The array and the two jitted reads of `read_bandwidth`, made once per process (no recompiles between rows)."""
    x = jnp.ones((2048, nbytes // 4 // 2048), jnp.float32)
    return x, (jax.jit(lambda x: jnp.sum(x, axis=1)), jax.jit(lambda x: jnp.max(x, axis=1)))


def read_bandwidth(*, quick: bool = False) -> float:
    """Bytes/s: the faster of a jitted sum and a jitted max over a float32 array far larger than any cache (256 MiB;
    64 MiB with quick), each the best of several runs. The benchmarks measure it once at the start
    (`machine_ceilings`) and again beside each decode row: on a shared VM the read speed moves within minutes, and
    a row's share of the floor means something only against the bandwidth of its own minutes."""
    nbytes = _read_bytes(quick)
    x, reads = _read_probe(nbytes)
    t = min(best_time(lambda f=f: f(x).block_until_ready(), min_seconds=0.2 if quick else 0.5) for f in reads)
    return nbytes / t


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
    t_mm = best_time(lambda: mm(a, b).block_until_ready(), min_seconds=0.3 if quick else 1.0)
    return {
        "matmul_flops": 2.0 * n**3 / t_mm,
        "matmul_n": n,
        "mem_bw_bytes_per_s": read_bandwidth(quick=quick),
        "mem_bw_array_bytes": _read_bytes(quick),
        "device": dev.device_kind,
        "platform": dev.platform,
        "device_count": jax.device_count(),
    }


def environment() -> dict:
    """What the numbers were measured on: CPU model, core count, library versions, date."""
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
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def peer_status() -> str:
    """ "ok" when torch and transformers import, else why the peer columns are empty ("not installed")."""
    try:  # optional dependencies: imported here, only when a peer is asked for
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return NOT_INSTALLED
    return "ok"


def ratio(ours: float | None, peer: float | None) -> float | None:
    return None if ours is None or peer is None or peer <= 0 else ours / peer


# ---- shared setup -------------------------------------------------------------------------------------------


def model_summary(m: ModelConfig) -> dict:
    return {
        "num_layers": m.num_layers,
        "d_model": m.d_model,
        "num_heads": m.num_heads,
        "kv_heads": m.num_kv_heads,
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


def settle() -> None:
    """A pause (SETTLE_SECONDS) before a timed section. torch's OpenMP threads spin-wait by default; on a busy
    2-core machine, the forward's and the backward's thread teams then stall each other (1 s per step of a model
    that takes 0.02 s) until the threads have idled once. Both sides get the same pause."""
    time.sleep(SETTLE_SECONDS)


def time_steps(run_step: Callable[[], None], steps: int, warmup: int) -> list:
    for _ in range(warmup):
        run_step()
    settle()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        run_step()
        times.append(time.perf_counter() - t0)
    return times


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def fmt(x, spec: str = ",.0f", missing: str = "-") -> str:
    return missing if x is None else format(x, spec)


def header(r: dict) -> list:
    e, mc = r["environment"], r["machine"]
    return [
        f"{e['cpu']} ({e['cores']} cores), JAX {r['jax_version']}, torch {e['torch_version'] or '-'}, "
        f"transformers {e['transformers_version'] or '-'}, {e['date']}, 1-min load at start "
        f"{fmt(e['load_avg_1min'], '.2f')}",
        f"machine: matmul {mc['matmul_flops'] / 1e9:,.1f} GFLOP/s (float32 {mc['matmul_n']}^3), "
        f"memory read {mc['mem_bw_bytes_per_s'] / 1e9:,.1f} GB/s",
    ]
