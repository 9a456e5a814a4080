"""The device check (`./launch/device_check.sh`, or `python -m causal_lm.device_check`): where this codebase
stands on the machine's accelerator, in one short run, written as one JSON summary.

Three parts, each in its own subprocess (so no part holds the accelerator's memory while another runs, and a
crash in one is reported without losing the others):

    tests    pytest -m accelerator: the tests that need a GPU/TPU: the forward pass against the CPU's, and the fused
             attention kernel of the platform (cuDNN on a GPU, splash on a TPU) against the reference kernel in
             bf16, outputs and gradients (tests/test_kernels.py, bounds stated there)
    train    `causal-lm bench train` at the GPT-2-small shape (configs/gpt2_124m.py, bf16 compute): tokens/s and
             MFU against the device's catalogued dense bf16 peak (causal_lm.train.metrics.DATASHEET)
    decode   `causal-lm bench decode` at batch 1, 8 and 64 (bf16 weights and cache): tokens/s against the
             HBM-bandwidth floor, i.e. the speed at which every weight and each row's K/V is read once per token at
             the catalogued HBM bandwidth (and at the bandwidth the benchmark measured)

On a machine without an accelerator it says so and runs the same parts on the CPU at a tiny shape (the tiny
preset; the accelerator tests skip themselves), which checks the pipeline, not the figures. Exit status 0 when
every part ran, 1 when one failed (its error is in the summary), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

from causal_lm.config import ConfigError, load_config
from causal_lm.train.metrics import datasheet

# Targets of issue 17, reported as met or not.
TARGET_TRAIN_MFU = 0.45  # of the dense bf16 peak, GPT-2 small shape
TARGET_DECODE_FLOOR = 0.60  # batch-1 decode, of the HBM-bandwidth floor

JAX_PLATFORM = {"gpu": "cuda", "tpu": "tpu", "cpu": "cpu"}

# Per platform: the benchmark settings (an accelerator gets the real shape, a CPU a smoke run of the pipeline).
DEFAULTS = {
    "accelerator": dict(
        config="gpt2_124m",
        train_steps=10,
        train_warmup=3,
        batches="1,8,64",
        context=1024,
        new_tokens=128,
        recompute_new_tokens=4,
        reps=2,
        quick=False,
    ),
    "cpu": dict(
        config="tiny",
        train_steps=2,
        train_warmup=1,
        batches="1",  # (the bench's --quick keeps one batch size anyway)
        context=32,
        new_tokens=4,
        recompute_new_tokens=1,
        reps=1,
        quick=True,
    ),
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="device_check",
        description="Accelerator tests, the training and decoding benchmarks at the GPT-2-small shape, one JSON.",
    )
    p.add_argument("--platform", choices=("auto", "gpu", "tpu", "cpu"), default="auto", help="default: what JAX sees")
    p.add_argument("--out", default="runs/device_check/summary.json", help="where the JSON summary goes")
    p.add_argument("--config", default=None, help="benchmark preset (default: gpt2_124m; tiny on a CPU)")
    p.add_argument("--train-steps", type=int, default=None, help="timed training steps")
    p.add_argument("--batches", default=None, help="decode batch sizes, comma-separated (default 1,8,64)")
    p.add_argument("--context", type=int, default=None, help="decode prompt length (default 1024)")
    p.add_argument("--new-tokens", type=int, default=None, help="decode steps timed with the cache (default 128)")
    p.add_argument("--tests", default="tests", help="where pytest looks for the accelerator tests")
    p.add_argument("--skip", default="", help="parts to leave out, comma-separated: tests, train, decode")
    p.add_argument("--part-timeout", type=float, default=300.0, help="seconds one part may take")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides for both benchmarks")
    return p


def detect_platform() -> str:
    """'gpu', 'tpu' or 'cpu': the platform of JAX's default backend, asked in a subprocess (so this process never
    takes the accelerator)."""
    out = subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.default_backend())"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    backend = out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else "cpu"
    return {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "tpu": "tpu"}.get(backend, "cpu")


def _run(cmd: list[str], env: dict, timeout: float) -> dict:
    """Run a part; {"cmd", "returncode", "seconds", "stdout", "stderr_tail"} (returncode None: timed out)."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc = None
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        stderr = (e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")) + f"\ntimed out ({timeout}s)"
    return {
        "cmd": " ".join(cmd),
        "returncode": rc,
        "seconds": round(time.perf_counter() - t0, 2),
        "stdout": stdout,
        "stderr_tail": stderr[-2000:],
    }


def _bench(kind: str, args: list[str], env: dict, timeout: float) -> dict:
    r = _run([sys.executable, "-m", "causal_lm.cli", "bench", kind, "--json", "--no-peer", *args], env, timeout)
    out = r.pop("stdout")
    r["ok"] = r["returncode"] == 0
    if r["ok"]:
        try:  # the JSON object is the last line of stdout (anything a library printed comes before it)
            r["result"] = json.loads(out.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            r["ok"], r["error"] = False, f"no JSON on stdout: {out[-500:]!r}"
    return r


def run_tests(tests: str, platform: str, env: dict, timeout: float) -> dict:
    """pytest -m accelerator over `tests`; counts from pytest's summary line."""
    env = dict(env, JAX_PLATFORMS=f"{JAX_PLATFORM[platform]},cpu" if platform != "cpu" else "cpu")
    env["CAUSAL_LM_TEST_OPTIMIZED"] = "1"  # the suite's CPU compile flags are not for accelerators
    r = _run([sys.executable, "-m", "pytest", "-m", "accelerator", "-q", "-p", "no:cacheprovider", tests], env, timeout)
    out = r.pop("stdout")
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", out)}
    r.update(counts=counts, summary=(out.strip().splitlines() or [""])[-1])
    # 0: all passed; 5: none collected (no accelerator tests exist yet) — neither is a failure of the device.
    r["ok"] = r["returncode"] in (0, 5)
    if not r["ok"]:
        r["output_tail"] = out[-3000:]
    return r


def summarize_train(result: dict) -> dict:
    """Tokens/s, the benchmark's MFU (against its measured float32 matmul) and the MFU against the datasheet peak
    of the compute dtype (bf16 at the GPT-2 shape), from `causal-lm bench train --json`."""
    machine, ours, model = result["machine"], result["ours"], result["model"]
    dtype = model.get("dtype", "float32")
    out = {
        "device": machine.get("device"),
        "model": model,
        "batch_size": result.get("batch_size"),
        "seq_len": result.get("seq_len"),
        "tokens_per_s": ours["tokens_per_s"],
        "step_s": ours["step_s"],
        "compile_s": ours.get("compile_s"),
        "train_flops_per_token": result["train_flops_per_token"],
        "mfu_vs_measured_matmul": ours["mfu"],
        "measured_matmul_flops": machine["matmul_flops"],
    }
    found = datasheet(machine.get("device") or "")
    if found is not None and dtype in found[1]:
        peak = found[1][dtype]
        mfu = ours["tokens_per_s"] * result["train_flops_per_token"] / peak
        out.update(datasheet_key=found[0], peak_flops=peak, peak_dtype=dtype, mfu=mfu)
        out["target_mfu"] = TARGET_TRAIN_MFU
        out["target_met"] = bool(dtype == "bfloat16" and mfu >= TARGET_TRAIN_MFU)
    else:
        out.update(mfu=None, note=f"no catalogued {dtype} peak for device {machine.get('device')!r}")
    return out


def summarize_decode(result: dict) -> dict:
    """Per batch: cached tokens/s, bytes read per token, the share of the HBM-bandwidth floor (catalogued
    bandwidth) and of the measured-bandwidth floor, from `causal-lm bench decode --json`."""
    machine = result["machine"]
    found = datasheet(machine.get("device") or "")
    hbm = found[1].get("hbm") if found else None
    rows = []
    for r in result["rows"]:
        row = {
            "context": r["context"],
            "batch": r["batch"],
            "cached_tokens_per_s": r["cached_tokens_per_s"],
            "recompute_tokens_per_s": r["recompute_tokens_per_s"],
            "bytes_per_token": r["bytes_per_token"],
            "floor_fraction_measured_bw": r["bandwidth_floor_fraction"],
            "hbm_floor_tokens_per_s": hbm / r["bytes_per_token"] if hbm else None,
            "hbm_floor_fraction": r["cached_tokens_per_s"] * r["bytes_per_token"] / hbm if hbm else None,
        }
        rows.append(row)
    out = {
        "device": machine.get("device"),
        "model": result["model"],
        "weight_bytes": result["weight_bytes"],
        "kv_bytes_per_token": result["kv_bytes_per_token"],
        "hbm_bytes_per_s": hbm,
        "measured_bw_bytes_per_s": machine["mem_bw_bytes_per_s"],
        "rows": rows,
    }
    batch1 = [r for r in rows if r["batch"] == 1 and r["hbm_floor_fraction"] is not None]
    if batch1:
        out["target_floor_fraction"] = TARGET_DECODE_FLOOR
        out["target_met"] = bool(batch1[0]["hbm_floor_fraction"] >= TARGET_DECODE_FLOOR)
    return out


def run(args, platform: str) -> dict:
    """Run the parts for `platform` ('gpu', 'tpu' or 'cpu') and return the summary."""

    accel = platform != "cpu"
    d = dict(DEFAULTS["accelerator" if accel else "cpu"])
    config = args.config or d["config"]
    steps = args.train_steps or d["train_steps"]
    batches = args.batches or d["batches"]
    context = args.context or d["context"]
    new_tokens = args.new_tokens or d["new_tokens"]
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    env = dict(os.environ, JAX_PLATFORMS=JAX_PLATFORM[platform], PYTHONUNBUFFERED="1")
    quick = ["--quick"] if d["quick"] else []
    overrides = list(args.overrides)
    if not accel:
        overrides = ["model.dtype=float32", *overrides]  # bf16 matmuls are slow on a CPU; this is a smoke run
    # room for the prompt and the new tokens (RoPE extends past the preset's length), and for train.seq_len;
    # a bad preset or override fails here, before any part runs
    decode_len = max(context + 1 + new_tokens, load_config(config, overrides).train.seq_len)

    summary: dict = {
        "platform": platform,
        "accelerator": platform if accel else None,
        "config": config,
        "overrides": overrides,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if not accel:
        summary["note"] = (
            "no accelerator found (JAX sees only a CPU): ran the CPU parts at a tiny shape to check the pipeline; "
            "the figures are not an accelerator's"
        )
    t0 = time.perf_counter()
    if "tests" not in skip:
        summary["tests"] = run_tests(args.tests, platform, env, args.part_timeout)
    if "train" not in skip:
        r = _bench(
            "train",
            [
                "--config",
                config,
                "--steps",
                str(steps),
                "--warmup",
                str(d["train_warmup"]),
                "--compile-layers",
                "",
                *quick,
                *overrides,
            ],
            env,
            args.part_timeout,
        )
        if r["ok"]:
            r["summary"] = summarize_train(r.pop("result"))
        summary["train"] = r
    if "decode" not in skip:
        decode_overrides = [f"model.max_seq_len={decode_len}"]
        if accel:  # inference holds bf16 weights; the floor counts the bytes actually stored
            decode_overrides.append("model.param_dtype=bfloat16")
        r = _bench(
            "decode",
            [
                "--config",
                config,
                "--contexts",
                str(context),
                "--batches",
                batches,
                "--new-tokens",
                str(new_tokens),
                "--recompute-new-tokens",
                str(d["recompute_new_tokens"]),
                "--reps",
                str(d["reps"]),
                *quick,
                *overrides,
                *decode_overrides,
            ],
            env,
            args.part_timeout,
        )
        if r["ok"]:
            r["summary"] = summarize_decode(r.pop("result"))
        summary["decode"] = r
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    summary["ok"] = all(summary[k]["ok"] for k in ("tests", "train", "decode") if k in summary)
    return summary


def _report(s: dict) -> str:
    lines = [f"device check: platform {s['platform']}" + ("" if s["accelerator"] else f" — {s['note']}")]
    t = s.get("tests")
    if t:
        lines.append(f"  tests  (-m accelerator): {t['summary'] or t['returncode']}" + ("" if t["ok"] else "  FAILED"))
    tr = s.get("train")
    if tr:
        if tr["ok"]:
            x = tr["summary"]
            mfu = "n/a" if x["mfu"] is None else f"{100 * x['mfu']:.1f}% of the {x['peak_dtype']} datasheet peak"
            lines.append(
                f"  train  {s['config']} on {x['device']}: {x['tokens_per_s']:,.0f} tokens/s, "
                f"step {x['step_s'] * 1e3:.1f} ms, MFU {mfu}"
            )
        else:
            lines.append(f"  train  FAILED: {tr.get('error') or tr['stderr_tail'][-300:]}")
    de = s.get("decode")
    if de:
        if de["ok"]:
            for r in de["summary"]["rows"]:
                floor = (
                    f"{100 * r['hbm_floor_fraction']:.0f}% of the HBM floor"
                    if r["hbm_floor_fraction"] is not None
                    else f"{100 * r['floor_fraction_measured_bw']:.0f}% of the measured-bandwidth floor"
                )
                lines.append(
                    f"  decode context {r['context']} batch {r['batch']}: {r['cached_tokens_per_s']:,.1f} tokens/s, "
                    f"{floor}"
                )
        else:
            lines.append(f"  decode FAILED: {de.get('error') or de['stderr_tail'][-300:]}")
    lines.append(f"  {s['seconds']} s; summary: {s.get('out')}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    bad = {s.strip() for s in args.skip.split(",") if s.strip()} - {"tests", "train", "decode"}
    if bad:
        parser.error(f"--skip takes tests, train, decode; got {', '.join(sorted(bad))}")
    if args.batches is not None and not re.fullmatch(r"\d+(,\d+)*", args.batches):
        parser.error(f"--batches must be comma-separated integers, got {args.batches!r}")

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)  # fails now, not after the run
    platform = detect_platform() if args.platform == "auto" else args.platform
    try:
        summary = run(args, platform)
    except ConfigError as e:
        print(f"device_check: error: {e}", file=sys.stderr)
        return 2
    summary["out"] = args.out
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=2)
    print(_report(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
