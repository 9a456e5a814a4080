"""Checkpoints outside training: save_for_inference / load_for_inference round-trip the weights, the config and the
tokenizer (here a character-level one), fine-tuning starts from such a checkpoint, and restoring into another
architecture is an error naming the parameters (orbax alone could restore part of it silently)."""

import jax
import numpy as np
import pytest
from flax import nnx

from causal_lm.config import apply_overrides, load_config
from causal_lm.data import ByteTokenizer, CharTokenizer, build_data, builtin_documents
from causal_lm.model import build_model
from causal_lm.train import (
    CheckpointError,
    load_for_inference,
    read_metrics,
    restore_params,
    save_for_inference,
    train_and_evaluate,
)
from causal_lm.train.checkpoint import Checkpointer
from causal_lm.train.state import init_params, split_params
from causal_lm.train.step import eval_sums

TINY = [
    "train.steps=2",
    "train.eval_every=2",
    "train.checkpoint_every=2",
    "train.log_every=1",
    "train.progress=false",
    "train.sample_tokens=0",
]


def _params(model):
    return jax.tree.leaves(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def _model(config, seed):
    graphdef, params, rest = init_params(config.model, seed)  # the compiled init the training tests use too
    return nnx.merge(graphdef, params, rest)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tok = CharTokenizer.from_texts(builtin_documents()[:50])
    config = load_config("tiny", ["data.tokenizer=char", *TINY])
    assert tok.vocab_size < config.model.vocab_size
    model = _model(config, seed=3)
    workdir = str(tmp_path_factory.mktemp("converted"))
    save_for_inference(workdir, model, config, tok)
    return workdir, model, config, tok


def test_save_for_inference_round_trip(saved):
    workdir, model, config, tok = saved
    loaded, tok2, config2 = load_for_inference(workdir)
    assert config2 == config
    assert type(tok2) is CharTokenizer and tok2.chars == tok.chars and tok2.vocab_size == tok.vocab_size
    assert tok2.encode("The assert statement ¿") == tok.encode("The assert statement ¿")
    for a, b in zip(_params(loaded), _params(model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Settings that keep shapes can change at load time (e.g. to evaluate the weights under another mask).
    nomask, _, c3 = load_for_inference(workdir, overrides=["model.attention_mask=none"])
    assert c3.model.attention_mask == "none" and nomask.config.attention_mask == "none"
    for a, b in zip(_params(nomask), _params(model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(CheckpointError, match="tokenizer has 300 ids"):
        save_for_inference(workdir, model, config, CharTokenizer([chr(i) for i in range(1000, 1296)]))


def test_restore_into_another_architecture_names_the_parameters(saved):
    workdir, model, config, tok = saved
    other_config = apply_overrides(config, ["model.num_kv_heads=4", "model.attn_sink=true"]).model
    other = nnx.eval_shape(lambda: build_model(other_config))
    with pytest.raises(CheckpointError) as e:
        restore_params(workdir, other)
    msg = str(e.value)
    assert "blocks.attn.wk: checkpoint [2, 64, 2, 16] vs model [2, 64, 4, 16]" in msg
    assert "blocks.attn.sink: in the model [2, 4], not in the checkpoint" in msg
    assert "embed" not in msg and "wq" not in msg  # only what differs
    with pytest.raises(CheckpointError, match="no checkpoint for step 7"):
        load_for_inference(workdir, step=7)
    # A model with the same shapes takes the weights.
    same = _model(config, seed=0)
    restore_params(workdir, same)
    for a, b in zip(_params(same), _params(model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_training_starts_from_an_inference_checkpoint(tmp_path):
    config = load_config("tiny", TINY)
    model = _model(config, seed=5)
    run = str(tmp_path / "finetune")
    save_for_inference(run, model, config, ByteTokenizer())
    # The loss of the saved weights on the first training batch is what training step 1 must report.
    batch = next(build_data(config).train)
    graphdef, params, rest = split_params(model)
    loss_sum, count = eval_sums(graphdef, params, rest, batch)
    record = train_and_evaluate(config, run)
    assert record["step"] == 2 and Checkpointer(run, read_only=True).all_steps() == [0, 2]
    assert read_metrics(run)[0]["loss"] == pytest.approx(float(loss_sum) / float(count), abs=1e-5)


def test_a_workdir_written_with_the_flat_rope_and_mla_keys_still_loads(tmp_path, monkeypatch):
    """Checkpoints written before model.rope_scaling / model.mla (their config with kv_lora_rank, rope_type, ...
    at the top of the model section) load as the same config, with no model differences reported against it."""
    import causal_lm.train.checkpoint as ck
    from causal_lm.config import config_to_dict

    mla = ["model.attention_type=mla", "model.num_kv_heads=none", "model.mla.kv_lora_rank=16"]
    config = load_config("tiny", [*TINY, *mla])
    old_names = {"kv_lora_rank": 16, "q_lora_rank": None, "qk_nope_head_dim": None, "qk_rope_head_dim": None}
    old_names.update(v_head_dim=None, mla_absorb=False, rope_type="default", rope_factor=1.0, rope_truncate=True)

    def flat_layout(c):
        d = config_to_dict(c)
        del d["model"]["rope_scaling"], d["model"]["mla"]
        d["model"].update(old_names)
        return d

    model = _model(config, seed=2)
    workdir = str(tmp_path / "old")
    monkeypatch.setattr(ck, "config_to_dict", flat_layout)
    save_for_inference(workdir, model, config, ByteTokenizer())
    monkeypatch.undo()
    meta = Checkpointer(workdir, read_only=True).read_meta(0)
    assert meta["config"]["model"]["kv_lora_rank"] == 16 and "mla" not in meta["config"]["model"]
    loaded, _, config2 = load_for_inference(workdir)
    assert config2 == config and config2.model.mla.kv_lora_rank == 16
    assert ck.check_model_config(meta, config, 0, workdir) == []
    for a, b in zip(_params(loaded), _params(model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
