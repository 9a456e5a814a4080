"""The device check: the datasheet lookup it measures against, its summary arithmetic, its CPU path end to end
(`./launch/device_check.sh` on a machine without an accelerator), and the accelerator test it runs (skipped
here)."""

import glob
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from variants import tiny_config

from causal_lm.device_check import main as device_check
from causal_lm.device_check import summarize_decode, summarize_train
from causal_lm.train.metrics import datasheet

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_datasheet_finds_the_most_specific_entry():
    """A variant must not get its family's figures (a PCIe H100 has 756, not 989, TFLOP/s): the order of the
    table matters, and jax's device_kind strings must find their entry."""
    cases = {
        "NVIDIA H100 80GB HBM3": ("H100", 989e12, 3.35e12),
        "NVIDIA H100 PCIe": ("H100 PCIe", 756e12, 2.0e12),
        "NVIDIA H100 NVL": ("H100 NVL", 835e12, 3.9e12),
        "NVIDIA H200": ("H200", 989e12, 4.8e12),
        "NVIDIA H200 NVL": ("H200 NVL", 835e12, 4.8e12),
        "NVIDIA GH200 480GB": ("GH200", 989e12, 4.0e12),
        "NVIDIA B200": ("B200", 2.25e15, 8.0e12),
        "NVIDIA GB200": ("GB200", 2.5e15, 8.0e12),
        "NVIDIA A100-SXM4-80GB": ("A100", 312e12, 2.039e12),
        "TPU v4": ("TPU v4", 275e12, 1.2e12),
        "TPU v5 lite": ("TPU v5 lite", 197e12, 819e9),
        "TPU v5p": ("TPU v5p", 459e12, 2.765e12),
        "TPU v6 lite": ("TPU v6", 918e12, 1.64e12),
    }
    for kind, (key, bf16, hbm) in cases.items():
        found = datasheet(kind)
        assert found is not None and found[0] == key, (kind, found)
        assert (found[1]["bfloat16"], found[1]["hbm"]) == (bf16, hbm), kind
    assert datasheet("cpu") is None and datasheet("") is None


def test_summaries_measure_against_the_datasheet():
    """MFU = tokens/s x FLOPs per token / the dense bf16 peak; the decode floor fraction = tokens/s x bytes read
    per token / the HBM bandwidth (not the measured matmul or bandwidth, which the benchmark reports beside)."""
    model = {"dtype": "bfloat16", "num_layers": 12}
    train = summarize_train(
        {
            "machine": {"device": "NVIDIA H200", "matmul_flops": 5e14, "mem_bw_bytes_per_s": 4e12},
            "ours": {"tokens_per_s": 5e5, "step_s": 0.06, "mfu": 0.75, "compile_s": 20.0},
            "model": model,
            "batch_size": 32,
            "seq_len": 1024,
            "train_flops_per_token": 8e8,
        }
    )
    assert train["mfu"] == pytest.approx(5e5 * 8e8 / 989e12) and train["peak_flops"] == 989e12
    assert train["target_met"] is False and train["mfu_vs_measured_matmul"] == 0.75
    rows = [
        {
            "context": 1024,
            "batch": b,
            "cached_tokens_per_s": tps,
            "recompute_tokens_per_s": 1.0,
            "bytes_per_token": bpt,
            "bandwidth_floor_fraction": 0.5,
        }
        for b, tps, bpt in [(1, 9000.0, 3e8), (8, 40000.0, 5e7)]
    ]
    decode = summarize_decode(
        {
            "machine": {"device": "NVIDIA H200", "mem_bw_bytes_per_s": 4e12},
            "model": model,
            "weight_bytes": 2.5e8,
            "kv_bytes_per_token": 36864,
            "rows": rows,
        }
    )
    assert decode["rows"][0]["hbm_floor_fraction"] == pytest.approx(9000 * 3e8 / 4.8e12)
    assert decode["rows"][0]["hbm_floor_tokens_per_s"] == pytest.approx(4.8e12 / 3e8)
    assert decode["target_met"] is False  # batch 1 at 56% of the floor: below the 60% target
    cpu = summarize_train(
        {
            "machine": {"device": "cpu", "matmul_flops": 2e11},
            "ours": {"tokens_per_s": 1e3, "step_s": 1.0, "mfu": 0.5},
            "model": {"dtype": "float32"},
            "train_flops_per_token": 1e8,
        }
    )
    assert cpu["mfu"] is None and "no catalogued" in cpu["note"]


def test_bad_arguments_fail_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "summary.json"
    with pytest.raises(SystemExit) as e:
        device_check(["--platform", "cpu", "--skip", "bogus", "--out", str(out)])
    assert e.value.code == 2 and "--skip takes tests, train, decode" in capsys.readouterr().err
    assert device_check(["--platform", "cpu", "--config", "no_such_preset", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "no_such_preset" in err
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.skipif(
    bool(shutil.which("nvidia-smi") or glob.glob("/dev/accel*")), reason="this machine has an accelerator"
)
def test_the_script_on_a_machine_without_an_accelerator(tmp_path):
    """./launch/device_check.sh detects no accelerator, says so, runs the three parts at the tiny shape on the
    CPU (the accelerator tests skip themselves) and writes the JSON summary; exit status 0."""
    out = tmp_path / "summary.json"
    env = dict(os.environ, CAUSAL_LM_PYTHON=sys.executable, PYTHONPATH=ROOT)  # this interpreter, no .venv setup
    env.pop("DEVICE_CHECK_PLATFORM", None)
    proc = subprocess.run(
        [os.path.join(ROOT, "launch", "device_check.sh"), "--out", str(out), "--tests", "tests/test_device_check.py"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "[device_check] platform: cpu" in proc.stdout and "no accelerator found" in proc.stdout
    s = json.loads(out.read_text())
    assert s["platform"] == "cpu" and s["accelerator"] is None and s["ok"] is True
    assert s["tests"]["counts"].get("skipped") == 1 and "passed" not in s["tests"]["counts"]
    train = s["train"]["summary"]
    assert train["tokens_per_s"] > 0 and train["mfu"] is None and train["model"]["num_layers"] == 2
    rows = s["decode"]["summary"]["rows"]
    assert [(r["context"], r["batch"]) for r in rows] == [(32, 1)]
    assert all(r["cached_tokens_per_s"] > 0 and r["hbm_floor_fraction"] is None for r in rows)


@pytest.mark.accelerator
def test_forward_on_the_accelerator_matches_the_cpu():
    """On a GPU/TPU: the tiny model's logits (magnitude up to 4.5) in float32 equal the CPU's within 1e-4, and
    in bf16 compute stay within 0.25 of them (three times the 0.083 that bf16 against float32 gives on a CPU).
    Run by ./launch/device_check.sh with JAX_PLATFORMS=<accelerator>,cpu."""
    if jax.default_backend() == "cpu":
        pytest.skip("no accelerator: JAX's default backend is the CPU")
    import dataclasses

    from flax import nnx

    from causal_lm.model import build_model

    cpu = jax.devices("cpu")[0]
    config = tiny_config("gqa", "rope_partial", gate=True)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 48)).astype(np.int32)
    with jax.default_device(cpu):
        model = build_model(config, seed=0)
        reference = np.asarray(model(tokens)[0])
    state = nnx.state(model)
    for dtype, atol in (("float32", 1e-4), ("bfloat16", 0.25)):
        on_device = build_model(dataclasses.replace(config, dtype=dtype), seed=0)
        nnx.update(on_device, jax.device_put(state, jax.devices()[0]))
        logits = on_device(tokens)[0]
        assert logits.devices() == {jax.devices()[0]}
        np.testing.assert_allclose(np.asarray(logits, np.float32), reference, atol=atol, err_msg=dtype)
