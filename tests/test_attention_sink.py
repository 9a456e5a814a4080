"""`causal-lm experiment attention-sink` runs end to end on a tiny config and reports per layer and head."""

import json
import os

import numpy as np
import pytest

from causal_lm import cli
from causal_lm.experiments.attention_sink import document_positions


def test_document_positions_restart_per_segment():
    seg = np.array([[1, 1, 1, 2, 2, 0], [3, 3, 3, 3, 3, 3]])
    np.testing.assert_array_equal(document_positions(seg), [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])


@pytest.mark.slow
def test_attention_sink_experiment_on_tiny(tmp_path, capsys):
    out = str(tmp_path / "sink")
    rc = cli.main(
        [
            "experiment",
            "attention-sink",
            "--out",
            out,
            "--config",
            "tiny",
            "train.steps=3",
            "train.eval_every=3",
            "train.checkpoint_every=3",
            "train.log_every=3",
            "train.sample_tokens=0",
            "train.progress=false",
        ]
    )
    assert rc == 0
    # the one-line numeric summary every experiment prints
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("attention-sink: share"))
    assert all(f"{name} mean " in line for name in ("softmax", "sink", "gate")) and "sink logit " in line, line
    for name in ("report.md", "attention_sink.png", "results.json"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    r = json.load(open(os.path.join(out, "results.json")))
    assert list(r["variants"]) == ["softmax", "sink", "gate"]
    L, N = r["config"]["model"]["num_layers"], r["config"]["model"]["num_heads"]
    for name, v in r["variants"].items():
        share = np.asarray(v["first_token_share"])
        assert share.shape == (L, N) and np.all((share > 0) & (share <= 1)), name
        assert v["steps"] == 3 and np.isfinite(v["val_loss"])
        if name == "sink":  # the sink logit (initialised at 0) takes a real share of every row
            assert np.all(np.asarray(v["sink_share"]) > 0.001)
        else:
            assert v["sink_share"] is None
    report = open(os.path.join(out, "report.md")).read()
    assert "| softmax |" in report and "| sink |" in report and "| gate |" in report
