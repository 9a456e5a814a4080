"""LoRA (causal_lm/train/lora.py): adapters train, the base stays frozen, merged weights are the trained model.

The bug classes: an update that reaches weights outside the adapters (or outside `train.lora_targets`), a merge
with the wrong scale (alpha instead of alpha / rank), a merged checkpoint that is not the model the adapters
trained, a resume that does not continue exactly.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from causal_lm.cli import main as cli_main
from causal_lm.config import ConfigError, TrainConfig, load_config
from causal_lm.decode import generate
from causal_lm.train import train_and_evaluate
from causal_lm.train.checkpoint import Checkpointer, load_for_inference, load_frozen_base
from causal_lm.train.lora import LoraGraph, init_adapters, lora_scale, merge_model
from causal_lm.train.metrics import read_metrics
from causal_lm.train.state import init_params, init_train_state, make_optimizer, split_params

RUN = [
    "train.checkpoint_every=1",
    "train.eval_every=3",
    "train.log_every=1",
    "train.progress=false",
    "train.sample_tokens=0",
    "train.warmup_steps=1",
    "train.min_lr_ratio=1.0",  # lr independent of train.steps: 2 steps + 1 resumed = 3 straight
    "train.lora_rank=4",
    "train.lora_alpha=8",
    "train.lora_targets=q,v,up",
]
TARGETS = {"wq", "wv", "w_up"}


def _adapter_state(workdir, step, config, base):
    adapters = init_adapters(base, config.train.lora_targets, config.train.lora_rank, 0)
    state = init_train_state(adapters, make_optimizer(config.train), 0)
    ckpt = Checkpointer(workdir, read_only=True)
    try:
        keys = ("opt_state", "step", "rng", "bad_step")
        p, s, meta = ckpt.restore(step, state.params, {k: getattr(state, k) for k in keys})
    finally:
        ckpt.close()
    return p, s, meta


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    straight, resumed = str(root / "straight"), str(root / "resumed")
    config = load_config("tiny", [*RUN, "train.steps=3"])
    train_and_evaluate(config, straight)
    train_and_evaluate(load_config("tiny", [*RUN, "train.steps=2"]), resumed)
    train_and_evaluate(config, resumed)
    return config, straight, resumed, root


def _leaves(tree):
    return {
        tuple(str(getattr(k, "key", k)) for k in path): np.asarray(x)
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


@pytest.mark.slow
def test_only_the_adapters_train_and_a_resume_is_exact(lora_runs):
    config, straight, resumed, _ = lora_runs
    model, _, run_config = load_for_inference(straight)  # base + adapters, merged
    graphdef, params, rest = split_params(model)
    base = load_frozen_base(straight, params)
    # the checkpoint holds the adapters only, of the targeted weights only
    adapters, state, meta = _adapter_state(straight, 3, config, base)
    names = {k.split(".")[-1] for k in meta["param_shapes"]}
    assert names == {"lora_a", "lora_b"}
    assert {k.split(".")[-2] for k in meta["param_shapes"]} == TARGETS
    init = _leaves(init_adapters(base, "q,v,up", 4, 0))
    for k, v in _leaves(adapters).items():  # both factors moved from their start (B from zero)
        assert not np.array_equal(v, init[k]), k
    # the merged model differs from the base exactly at the targeted weights
    merged, frozen = _leaves(params), _leaves(base)
    for k, v in merged.items():
        if k[-1] in TARGETS:
            assert not np.array_equal(v, frozen[k]), k
        else:
            np.testing.assert_array_equal(v, frozen[k], err_msg=str(k))
    # the fresh base is the seed's initial model: the run never touched it
    for k, v in _leaves(init_params(run_config.model, 0)[1]).items():
        np.testing.assert_array_equal(v, frozen[k], err_msg=str(k))
    # resume: 2 steps, then the third in the same workdir, equals 3 straight (metrics and the whole state)
    keys = ("step", "loss", "grad_norm", "lr", "tokens")
    rows = lambda w: [{k: r.get(k) for k in keys} for r in read_metrics(w) if "loss" in r]  # noqa: E731
    assert rows(resumed) == rows(straight) and len(rows(straight)) == 3
    a = jax.tree.leaves(_adapter_state(straight, 3, config, base)[:2])
    b = jax.tree.leaves(_adapter_state(resumed, 3, config, base)[:2])
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_merged_weights_are_w_plus_alpha_over_rank_ab_and_generate_as_the_adapter(lora_runs):
    config, straight, _, root = lora_runs
    out = str(root / "merged")
    assert cli_main(["convert", "--merge-lora", straight, "--workdir", out]) == 0
    merged_model, _, merged_config = load_for_inference(out)
    assert merged_config.train.lora_rank == 0  # a plain model now
    graphdef, params, rest = split_params(merged_model)
    base = load_frozen_base(straight, params)
    adapters = _adapter_state(straight, 3, config, base)[0]
    # by hand: W + (alpha / rank) * A @ B, alpha 8, rank 4
    a, b = (np.asarray(adapters["blocks"]["attn"]["wq"][k], np.float64) for k in ("lora_a", "lora_b"))
    w = np.asarray(base["blocks"]["attn"]["wq"], np.float64)
    want = w + 2.0 * np.matmul(a, b).reshape(w.shape)
    np.testing.assert_allclose(np.asarray(params["blocks"]["attn"]["wq"]), want, atol=1e-6)
    # the adapter unmerged (the training path: base + adapters applied inside the forward) == the merged weights
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 24)), jnp.int32)
    lora_model = merge_model(LoraGraph(graphdef, lora_scale(config.train)), adapters, {"base": base, "rest": rest})
    got = np.asarray(lora_model(tokens)[0])
    ref = np.asarray(merged_model(tokens)[0])
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
    assert not np.allclose(np.asarray(merge_model(graphdef, base, rest)(tokens)[0]), ref, atol=1e-3)
    # greedy generation from the LoRA workdir (merged on load) equals the merged workdir's
    lora_loaded = load_for_inference(straight)[0]
    prompt = [np.asarray(tokens[0, :8]).tolist()]
    g1 = generate(lora_loaded, prompt, max_new_tokens=12, return_logits=True)
    g2 = generate(merged_model, prompt, max_new_tokens=12, return_logits=True)
    assert g1.tokens == g2.tokens
    np.testing.assert_allclose(np.asarray(g1.logits), np.asarray(g2.logits), atol=1e-5, rtol=0)


def test_bad_lora_settings_fail_with_one_line():
    with pytest.raises(ConfigError, match="lora_targets"):
        TrainConfig(lora_rank=4, lora_targets="q,attn")
    with pytest.raises(ConfigError, match="lora_rank"):
        TrainConfig(lora_rank=-1)
    with pytest.raises(ConfigError, match="lora_alpha"):
        TrainConfig(lora_rank=2, lora_alpha=0)


def test_lora_on_a_trained_workdir_takes_its_weights_as_the_base(tmp_path):
    """LoRA fine-tunes a full training run in its own workdir: the newest checkpoint's weights become the frozen
    base (bitwise), the step count continues from it, and only the adapters are trained and saved after it."""
    workdir = str(tmp_path / "run")
    plain = [r for r in RUN if not r.startswith("train.lora")]
    train_and_evaluate(load_config("tiny", [*plain, "train.steps=2"]), workdir)
    config = load_config("tiny", [*RUN, "train.steps=4"])
    graphdef, params, _ = init_params(config.model, 0)
    ckpt = Checkpointer(workdir, read_only=True)
    try:
        trained, _, _ = ckpt.restore(2, params)
    finally:
        ckpt.close()
    train_and_evaluate(config, workdir)
    base = load_frozen_base(workdir, params)
    for k, v in _leaves(trained).items():
        np.testing.assert_array_equal(_leaves(base)[k], v)
    assert [r["step"] for r in read_metrics(workdir) if "loss" in r][-2:] == [3, 4]
    p, s, _ = _adapter_state(workdir, 4, config, base)
    assert int(s["step"]) == 4
    assert {k[-1] for k in _leaves(p)} == {"lora_a", "lora_b"} and {k[-2] for k in _leaves(p)} == TARGETS
