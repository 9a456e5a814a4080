"""Profiles: `profile_trace` writes a jax.profiler trace (TensorBoard's xplane and a Perfetto JSON) of what runs
inside it, and train.profile_steps=START,END traces exactly those training steps into workdir/profile."""

import gzip
import json
import os

import jax
import jax.numpy as jnp
import pytest

from causal_lm.cli import main
from causal_lm.config import ConfigError, load_config
from causal_lm.train import read_metrics, train_and_evaluate
from causal_lm.train.profile import PROFILE_DIR, profile_trace, trace_files


def _events(directory) -> list:
    (perfetto,) = [f for f in trace_files(directory) if f.endswith(".trace.json.gz")]  # Chrome-trace JSON
    with gzip.open(perfetto) as f:
        return json.load(f)["traceEvents"]


def test_profile_trace_writes_a_trace_of_the_block(tmp_path):
    f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
    x = jnp.ones((64, 64))
    f(x).block_until_ready()  # compiled outside the trace
    with profile_trace(str(tmp_path / "trace")) as directory:
        jax.block_until_ready(f(x))
    files = trace_files(directory)
    names = [os.path.basename(p) for p in files]
    assert len(names) == 3 and "perfetto_trace.json.gz" in names
    assert sum(n.endswith(".xplane.pb") for n in names) == 1  # <host>.xplane.pb, beside <host>.trace.json.gz
    assert all(os.path.getsize(p) > 0 for p in files)
    assert any("tanh" in e.get("name", "") or "jit" in e.get("name", "") for e in _events(directory))


@pytest.mark.slow
def test_profile_steps_traces_exactly_those_training_steps(tmp_path):
    config = load_config(
        "tiny",
        [
            "train.steps=4",
            "train.log_every=1",
            "train.profile_steps=2,3",
            "train.progress=false",
            "train.sample_tokens=0",
        ],
    )
    directory = tmp_path / PROFILE_DIR
    seen = {}

    def callback(event, step, info):  # the trace is written when step END is done, not when training ends
        if event == "log":
            seen[step] = len(trace_files(str(directory)))

    train_and_evaluate(config, str(tmp_path), callback=callback)
    assert seen[4] == 3, seen
    assert len(trace_files(str(directory))) == 3  # one trace (xplane + 2 JSON), started once, stopped once
    steps = sorted(int(e["args"]["step_num"]) for e in _events(str(directory)) if e.get("name") == "train")
    assert steps == [2, 3]  # annotated training steps: the window, nothing before or after it
    assert read_metrics(str(tmp_path))[-1]["step"] == 4  # training went on after the trace


def test_bad_profile_steps_are_config_errors(tmp_path, capsys):
    for value, message in [
        ("5", "must be 'START,END'"),
        ("a,b", "must be 'START,END'"),
        ("3,2", "1 <= START <= END"),
        ("0,2", "1 <= START <= END"),
        ("5,30", "ends after the last step"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config("tiny", [f"train.profile_steps={value}"])
    assert load_config("tiny", ["train.profile_steps=2,3"]).train.profile_range == (2, 3)
    assert load_config("tiny").train.profile_range is None
    workdir = tmp_path / "run"
    assert main(["train", "--config", "tiny", "train.profile_steps=9", "--workdir", str(workdir)]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "train.profile_steps" in err and "Traceback" not in err
    assert not workdir.exists()
