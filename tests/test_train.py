"""Training: it learns, resumes bitwise-exactly after a SIGKILL (even one in the middle of a save), accumulates
gradients by token count, halts on a non-finite loss naming the step without saving it, and rejects bad input
before any compute. One tiny run is trained once (through the CLI) and shared by the tests of this module."""

import dataclasses
import json
import math
import os

import jax
import numpy as np
import pytest
from children import kill_child_at

from causal_lm.cli import main
from causal_lm.config import ConfigError, apply_overrides, config_from_dict, load_config
from causal_lm.data import build_data, builtin_documents
from causal_lm.train import (
    Checkpointer,
    CheckpointError,
    DivergenceError,
    Hook,
    NonFiniteLossError,
    evaluate,
    load_for_inference,
    read_metrics,
    train_and_evaluate,
)
from causal_lm.train.checkpoint import CHECKPOINT_DIR
from causal_lm.train.state import init_params, init_train_state, make_optimizer
from causal_lm.train.step import compiled_train_step, eval_sums

N = 100  # the resume test: 2N steps straight vs N, SIGKILL, resume to 2N
OVERRIDES = [
    f"train.steps={2 * N}",
    "train.eval_every=50",
    "train.checkpoint_every=50",
    "train.log_every=25",
    "train.progress=false",
    "train.sample_tokens=0",
]
STATE_KEYS = ("opt_state", "step", "rng", "bad_step")


def tiny(*extra):
    return load_config("tiny", [*OVERRIDES, *extra])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The straight 2N-step run, trained through `causal-lm train`."""
    workdir = str(tmp_path_factory.mktemp("straight"))
    assert main(["train", "--config", "tiny", *OVERRIDES, "--workdir", workdir]) == 0
    return workdir


def _restore_all(workdir, step):
    """(params, train_state) of a checkpoint, restored against the tiny config's abstract state."""
    config = tiny()
    _, params, _ = init_params(config.model, 0)
    state = init_train_state(params, make_optimizer(config.train), 0)
    ckpt = Checkpointer(workdir, read_only=True)
    try:
        p, s, _ = ckpt.restore(step, state.params, {k: getattr(state, k) for k in STATE_KEYS})
    finally:
        ckpt.close()
    return p, s


def test_one_step_smoke(tmp_path):
    record = train_and_evaluate(
        load_config("tiny", ["train.steps=1", "train.progress=false", "train.sample_tokens=16"]), str(tmp_path)
    )
    assert record["step"] == 1 and math.isfinite(record["loss"]) and math.isfinite(record["val_loss"])
    assert isinstance(record["sample"], str)  # sampled through the KV cache
    assert 0 < record["loss"] < 2 * math.log(259)
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1]
    assert Checkpointer(str(tmp_path), read_only=True).all_steps() == [1]
    assert os.path.exists(tmp_path / "config.json") and os.listdir(tmp_path / "tokenizer")
    events = sorted(os.listdir(tmp_path / "tb"))
    assert len(events) == 1 and events[0].startswith("events.out.tfevents")
    # A rerun that trains nothing (already at train.steps) writes no new TensorBoard event file.
    config = load_config("tiny", ["train.steps=1", "train.progress=false", "train.sample_tokens=16"])
    assert train_and_evaluate(config, str(tmp_path))["step"] == 1
    assert sorted(os.listdir(tmp_path / "tb")) == events


def test_validation_loss_falls_well_below_uniform(trained):
    records = read_metrics(trained)
    assert [r["step"] for r in records] == list(range(25, 2 * N + 1, 25))
    for r in records:
        assert {"step", "loss", "grad_norm", "lr", "tokens", "tokens_per_s", "mfu"} <= set(r)
        assert math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 and r["mfu"] > 0  # (a shared CPU's peak varies)
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evals] == [50, 100, 150, 200]
    for r in evals:
        assert {"val_ppl", "val_bpb"} <= set(r)
        assert r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]), rel=1e-6)
        # Bytes per target token: 1, except the few EOS targets that stand for no byte.
        bits_per_token = r["val_loss"] / math.log(2)
        assert bits_per_token < r["val_bpb"] < 1.05 * bits_per_token
    final = evals[-1]["val_loss"]
    # Uniform guessing costs ln(259) = 5.56 nats; the best context-free (unigram) predictor costs the corpus's
    # byte entropy. Beating the latter means the model uses context.
    text = np.frombuffer("".join(builtin_documents()).encode(), np.uint8)
    p = np.bincount(text, minlength=256) / len(text)
    unigram = float(-(p[p > 0] * np.log(p[p > 0])).sum())
    assert final < 0.5 * math.log(259)
    assert final < unigram, (final, unigram)
    assert final < evals[0]["val_loss"]


CHILD = r"""
import os, sys, threading
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py
from orbax.checkpoint._src.path import atomicity
from causal_lm.config import load_config
from causal_lm.train import train_and_evaluate

workdir, n, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
original = atomicity.AtomicRenameTemporaryPath.finalize

async def finalize(self, *args, **kwargs):
    # Every save after step n stops between writing its files and committing them (the rename), and says so.
    name = self.get_final().name
    if name.isdigit() and int(name) > n:
        print(f"SAVING {name}", flush=True)
        threading.Event().wait()
    return await original(self, *args, **kwargs)

atomicity.AtomicRenameTemporaryPath.finalize = finalize

def callback(event, step, info):
    if event == "checkpoint" and step == n:
        info["wait"]()
        print(f"SAVED {step}", flush=True)

train_and_evaluate(load_config("tiny", overrides), workdir, callback=callback)
print("FINISHED", flush=True)
"""


def test_resume_after_sigkill_is_bitwise_exact(trained, tmp_path):
    workdir = str(tmp_path / "killed")
    # killed in the middle of writing the checkpoint after step N
    lines = kill_child_at(tmp_path, CHILD, [workdir, N, *OVERRIDES])
    assert lines[-2:] == [f"SAVED {N}", f"SAVING {N + 50}"]

    # The interrupted save left only a temporary directory; step N is the latest complete, restorable checkpoint.
    ckdir = os.path.join(workdir, CHECKPOINT_DIR)
    assert any(str(N + 50) in d and "tmp" in d for d in os.listdir(ckdir)), os.listdir(ckdir)
    assert Checkpointer(workdir, read_only=True).latest_step() == N
    model, _, _ = load_for_inference(workdir)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(model))
    # The killed process had logged past step N: resuming must cut those lines and redo them identically.
    assert max(r["step"] for r in read_metrics(workdir)) > N

    train_and_evaluate(tiny(), workdir)  # the same command again: resumes from step N

    straight, resumed = read_metrics(trained), read_metrics(workdir)
    keys = ("step", "loss", "grad_norm", "lr", "tokens", "val_loss", "val_bpb")
    assert [{k: r.get(k) for k in keys} for r in resumed] == [{k: r.get(k) for k in keys} for r in straight]
    (p1, s1), (p2, s2) = _restore_all(trained, 2 * N), _restore_all(workdir, 2 * N)
    leaves1, leaves2 = jax.tree.leaves((p1, s1)), jax.tree.leaves((p2, s2))
    assert len(leaves1) == len(leaves2) > 10
    for a, b in zip(leaves1, leaves2, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # bitwise: params, Adam moments, step, RNG
    assert int(s2["step"]) == 2 * N


def test_trained_checkpoint_round_trip(trained, capsys):
    model, tokenizer, config = load_for_inference(trained)
    with open(os.path.join(trained, "config.json")) as f:
        assert config == config_from_dict(json.load(f)) == apply_overrides(tiny(), [])
    assert tokenizer.to_dict() == {"kind": "byte"}
    params, _ = _restore_all(trained, 2 * N)
    from flax import nnx

    for a, b in zip(
        jax.tree.leaves(nnx.to_pure_dict(nnx.state(model, nnx.Param))), jax.tree.leaves(params), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The loaded model scores the validation batches exactly as the training loop did at its last eval.
    data = build_data(config, tokenizer)
    val = evaluate(model, data.val, data.token_bytes)
    last = read_metrics(trained)[-1]
    assert val["loss"] == pytest.approx(last["val_loss"], abs=1e-5)
    assert val["bits_per_byte"] == pytest.approx(last["val_bpb"], abs=1e-5)
    # The same through the CLI, plus plot and generate from the workdir.
    capsys.readouterr()
    assert main(["eval", "--workdir", trained, "--json", "--max-batches", str(config.train.eval_batches)]) == 0
    assert json.loads(capsys.readouterr().out)["loss"] == pytest.approx(last["val_loss"], abs=1e-5)
    out = os.path.join(trained, "curves.png")
    assert main(["plot", "--workdir", trained, "--out", out]) == 0
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    assert main(["generate", "--workdir", trained, "--max-new-tokens", "16", "--no-stream"]) == 0
    assert capsys.readouterr().out.startswith("The ")


def test_eval_weights_scores_the_data_asked_for(trained, tmp_path, capsys):
    """`eval --weights` scores --data's validation split (it once scored the training corpus whatever --data said):
    its float32 row is the plain eval of that data; --minimums reaches the int4 row; misuse is one line."""
    data = tmp_path / "other.txt"
    data.write_text("Quantized weights are read in blocks, each with its own scale.\n\n" * 40)
    common = ["eval", "--workdir", trained, "--json", "--max-batches", "2"]
    capsys.readouterr()
    assert main([*common, "--data", str(data)]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(common) == 0
    own = json.loads(capsys.readouterr().out)
    assert own["loss"] != pytest.approx(plain["loss"], abs=1e-3)  # the two corpora do score differently
    assert main([*common, "--data", str(data), "--weights", "int4", "--minimums", "--greedy-tokens", "4"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["weights"], r["minimums"], r["embed_weights"], r["corpus"]) for r in rows] == [
        ("float32", None, None, str(data)),
        ("int4", True, "int4", str(data)),
    ]
    assert main([*common, "--weights", "int4", "--embed-weights", "int8", "--greedy-tokens", "0"]) == 0
    assert json.loads(capsys.readouterr().out)[1]["embed_weights"] == "int8"
    assert rows[0]["loss"] == pytest.approx(plain["loss"], abs=1e-6) and rows[0]["tokens"] == plain["tokens"]
    assert abs(rows[1]["bits_per_byte_vs_float32"]) < 0.05
    for argv, expected in [
        ([*common, "--minimums"], "--minimums applies with --weights int4"),
        ([*common, "--weights", "int8", "--minimums"], "--minimums applies with --weights int4"),
        ([*common, "--weights", "int8", "--split", "train"], "drop --split train"),
        ([*common, "--embed-weights", "int8"], "--embed-weights applies with --weights int8|int4"),
    ]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "error:" in err[0] and expected in err[0], err


def test_mismatched_checkpoint_is_an_error_naming_parameters(trained, capsys):
    before = open(os.path.join(trained, "metrics.jsonl")).read()
    with pytest.raises(CheckpointError) as e:
        train_and_evaluate(tiny("model.num_layers=3", "model.mlp_dim=96"), trained)
    msg = str(e.value)
    assert "blocks.mlp.w_up: checkpoint [2, 64, 128] vs model [3, 64, 96]" in msg
    assert "blocks.attn.wq: checkpoint [2, 64, 4, 16] vs model [3, 64, 4, 16]" in msg
    assert "num_layers: 2 -> 3" in msg
    assert "embed" not in msg.split("differ:")[1].split("model config")[0]  # only the ones that differ
    # Through the CLI: a one-line error, exit status 2; nothing in the workdir changed.
    assert main(["train", "--config", "tiny", *OVERRIDES, "model.d_model=32", "--workdir", trained]) == 2
    assert "embed: checkpoint [259, 64] vs model [259, 32]" in capsys.readouterr().err
    assert open(os.path.join(trained, "metrics.jsonl")).read() == before
    assert Checkpointer(trained, read_only=True).latest_step() == 2 * N


def test_bad_inputs_fail_before_any_compute(tmp_path, capsys):
    with pytest.raises(ConfigError, match="unknown config key 'train.stepz'.*train.steps"):
        load_config("tiny", ["train.stepz=3"])
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    workdir = tmp_path / "run"
    assert main(["train", "--config", "tiny", f"data.corpus={empty}", "--workdir", str(workdir)]) == 2
    assert "empty.txt" in capsys.readouterr().err and not workdir.exists()  # nothing created
    assert main(["train", "--config", "tiny", f"data.corpus={tmp_path / 'nope.jsonl'}", "--workdir", str(workdir)]) == 2
    assert "nope.jsonl" in capsys.readouterr().err and not workdir.exists()
    assert main(["eval", "--workdir", str(tmp_path / "never_trained")]) == 2
    assert "no checkpoints" in capsys.readouterr().err
    # a fused attention backend this platform lacks (a GPU's cuDNN on this CPU): one line, nothing created
    assert main(["train", "--config", "tiny", "model.attention_impl=cudnn", "--workdir", str(workdir)]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "'cudnn' needs an NVIDIA GPU" in err and not workdir.exists()


def test_microbatches_equal_one_big_batch():
    config = tiny()  # batch 16: the shape the module's other runs compiled for
    batch = next(build_data(config).train)
    # Unequal microbatches of 4 rows: the first holds 2 x 10 target tokens, the others 4 x 64 each.
    batch["segment_ids"][0:2, 10:] = 0
    batch["weights"][0:2, 10:] = 0
    batch["segment_ids"][2:4] = 0
    batch["weights"][2:4] = 0
    graphdef, params, rest = init_params(config.model, 0)
    outs = []
    for c in (config, apply_overrides(config, ["train.microbatches=4"])):
        state = init_train_state(params, make_optimizer(c.train), 0)
        state = jax.tree.map(lambda x: x.copy(), state)  # the step donates its input state
        new, metrics = compiled_train_step(c.model, c.train, graphdef)(state, rest, batch)
        outs.append((jax.device_get(new.params), jax.device_get(metrics)))
    (p1, m1), (p4, m4) = outs
    per_micro = batch["weights"].reshape(4, -1).sum(axis=1)
    assert per_micro[0] <= 20 < 200 < per_micro[1:].min()  # very unequal microbatches
    assert float(m1["tokens"]) == float(m4["tokens"]) == batch["weights"].sum()
    # Loss and gradient norm are normalised by the total token count (the norm would differ if the gradient were
    # scaled differently, which Adam's first update would hide), and the updated parameters agree.
    np.testing.assert_allclose(m4["loss"], m1["loss"], rtol=2e-6)
    np.testing.assert_allclose(m4["grad_norm"], m1["grad_norm"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(p4), jax.tree.leaves(p1), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    # The test can tell: averaging the microbatches' own means (a common bug) gives a different loss.
    means = []
    for i in range(0, 16, 4):
        loss_sum, count = eval_sums(graphdef, params, rest, {k: v[i : i + 4] for k, v in batch.items()})
        means.append(float(loss_sum) / float(count))
    assert abs(np.mean(means) - float(m1["loss"])) > 1e-3


@pytest.mark.parametrize("checkpoint_every", [6, 1])
def test_non_finite_loss_halts_naming_the_step_and_saves_nothing_bad(tmp_path, checkpoint_every):
    overrides = [
        "train.learning_rate=1e30",
        "train.warmup_steps=0",
        "train.steps=12",
        "train.log_every=6",
        "train.eval_every=6",
        f"train.checkpoint_every={checkpoint_every}",
        "train.progress=false",
        "train.sample_tokens=0",
    ]
    config = load_config("tiny", overrides)
    with pytest.raises(NonFiniteLossError) as e:
        train_and_evaluate(config, str(tmp_path))
    named = int(str(e.value).split("at step ")[1].split()[0])
    # Replay the same steps on the host, one at a time: the first non-finite step is the one the error named.
    data = build_data(config)
    graphdef, params, rest = init_params(config.model, config.train.seed)
    state = init_train_state(params, make_optimizer(config.train), config.train.seed)
    step_fn = compiled_train_step(config.model, config.train, graphdef)
    for s in range(1, 13):  # noqa: B007 (s is the step the halt must name, read after the loop)
        state, m = step_fn(state, rest, next(data.train))
        if not (np.isfinite(float(m["loss"])) and np.isfinite(float(m["grad_norm"]))) or int(state.bad_step):
            break
    assert named == s == int(state.bad_step)
    # No metrics record and no checkpoint at or after that step; what was saved is finite.
    assert (
        all(r["step"] < named for r in read_metrics(str(tmp_path)))
        if os.path.exists(tmp_path / "metrics.jsonl")
        else True
    )
    steps = Checkpointer(str(tmp_path), read_only=True).all_steps()
    assert all(s < named for s in steps)
    if checkpoint_every == 1:
        assert steps and f"last healthy checkpoint is step {max(steps)}" in str(e.value)
        params, _ = _restore_all(str(tmp_path), max(steps))
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))
    else:
        assert steps == [] and "no checkpoint had been written yet" in str(e.value)


def test_a_nan_loss_at_the_bad_step_is_the_non_finite_error_not_a_spike(tmp_path, monkeypatch):
    """Parameters poisoned with NaN before step 3 of 4 (one log step at 4): the step's own check records step 3,
    and the loop reports the non-finite-loss error for it. The spike monitor sees only the steps before it: were
    step 3's NaN loss checked there, it would be a plain DivergenceError ("the loss at step 3 is nan")."""
    from causal_lm.train import loop

    real = loop.compiled_train_step

    def poisoned(*args, **kwargs):
        step_fn = real(*args, **kwargs)

        def run(state, rest, batch):
            if int(state.step) == 2:  # the update of step 3
                nan = jax.tree.map(lambda x: np.full(x.shape, np.nan, x.dtype), state.params)
                state = dataclasses.replace(state, params=nan)
            return step_fn(state, rest, batch)

        return run

    monkeypatch.setattr(loop, "compiled_train_step", poisoned)
    every = ["train.steps=4", "train.log_every=4", "train.eval_every=4", "train.checkpoint_every=4"]
    config = load_config("tiny", [*every, "train.progress=false", "train.sample_tokens=0"])
    with pytest.raises(DivergenceError) as e:
        train_and_evaluate(config, str(tmp_path))
    err = e.value
    assert type(err) is NonFiniteLossError and err.step == 3, str(err)
    assert "diverged: non-finite loss or gradient at step 3 (loss=nan, grad_norm=nan)" in str(err), str(err)


def test_a_hook_runs_at_its_cadence_and_sees_the_step_s_metrics(tmp_path):
    """A user's hook runs every N steps of the run (counted from step 0, so a resumed run keeps the cadence), sees
    that step's metrics (its record: the same numbers metrics.jsonl gets, after evaluation), and what it adds to
    them is written with the record."""
    seen = []

    def grad_to_loss(info):
        assert float(info.per_step[-1]["grad_norm"]) == info.metrics["grad_norm"]  # this step's own
        seen.append((info.step, dict(info.metrics), [float(h["loss"]) for h in info.per_step]))
        info.metrics["grad_to_loss"] = info.metrics["grad_norm"] / info.metrics["loss"]

    never = ["train.log_every=100", "train.eval_every=100", "train.checkpoint_every=100"]
    config = tiny("train.steps=7", *never)  # batch 16 x 64: the shape the module's other runs compiled for
    with pytest.raises(ValueError, match="every=0"):
        Hook(grad_to_loss, every=0)
    with pytest.raises(TypeError, match="not a causal_lm.train.Hook"):
        train_and_evaluate(config, str(tmp_path / "typo"), hooks=[grad_to_loss])
    assert not (tmp_path / "typo").exists()

    last = train_and_evaluate(config, str(tmp_path), hooks=[Hook(grad_to_loss, every=3)])
    assert [s for s, _, _ in seen] == [3, 6]
    records = read_metrics(str(tmp_path))
    assert [r["step"] for r in records] == [3, 6, 7]  # the hook's steps are log steps; 7 is the last step
    for (step, metrics, losses), r in zip(seen, records, strict=False):
        assert metrics["step"] == step == r["step"]
        assert len(losses) == 3 and metrics["loss"] == pytest.approx(np.mean(losses), rel=1e-6)
        assert {k: r[k] for k in ("loss", "grad_norm", "lr", "tokens")} == {
            k: metrics[k] for k in ("loss", "grad_norm", "lr", "tokens")
        }
        assert r["grad_to_loss"] == r["grad_norm"] / r["loss"]
    assert "grad_to_loss" not in records[2] and last["step"] == 7 and "val_loss" in last

    # Resumed from step 7 to 12: the hook runs at 9 and 12 (the last step, also an eval step: it sees val_loss).
    seen.clear()
    train_and_evaluate(tiny("train.steps=12", *never), str(tmp_path), hooks=[Hook(grad_to_loss, every=3)])
    assert [s for s, _, _ in seen] == [9, 12]
    assert [len(losses) for _, _, losses in seen] == [2, 3]
    assert "val_loss" in seen[1][1] and "val_loss" not in seen[0][1]
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [3, 6, 7, 9, 12]
