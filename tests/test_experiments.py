"""The seed experiments on tiny settings: the direction of every claim they make, their files, and the CLI.

Each pair of models is trained once per module (fixed seeds); a run is compile-bound, so steps are cheap.
"""

import json
import math
import os
import shutil

import numpy as np
import pytest

from causal_lm import CacheError, build_model, generate, init_cache, load_config
from causal_lm.config import apply_overrides
from causal_lm.experiments import EXPERIMENTS, get, mask_ablation, mask_placement, nope_position, prefix_cost
from causal_lm.model.functional import forward

ABLATION = ["train.steps=300", "train.seq_len=32", "train.eval_every=100", "train.checkpoint_every=300"]
NOPE = [
    "train.steps=400",
    "train.seq_len=32",
    "train.eval_every=200",
    "train.checkpoint_every=400",
    "model.num_layers=2",
]


def _files(out, png):
    for name in ("report.md", png, "results.json"):
        path = os.path.join(out, name)
        assert os.path.isfile(path) and os.path.getsize(path) > 0, path
    with open(os.path.join(out, png), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(os.path.join(out, "results.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def ablation(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("mask_ablation"))
    config = apply_overrides(mask_ablation.default_config(), ABLATION)
    return out, mask_ablation.run(config, out, prompts=("The ",), sample_tokens=16, eval_rows=32)


@pytest.fixture(scope="module")
def nope(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("nope_position"))
    config = apply_overrides(nope_position.default_config(), NOPE)
    return out, nope_position.run(config, out, probe_rows=256)


def test_registry_has_every_seed_experiment():
    for name in ("mask-ablation", "mask-placement", "prefix-cost", "nope-position", "attention-sink"):
        exp = get(name)
        assert exp.NAME == name and callable(exp.run) and callable(exp.default_config)
    assert set(EXPERIMENTS) >= {"mask-ablation", "mask-placement", "prefix-cost", "nope-position"}
    with pytest.raises(ValueError, match="unknown experiment"):
        get("mask-ablatoin")


# ---- mask-ablation -----------------------------------------------------------------------------------------


def test_mask_ablation_no_mask_copies_and_collapses_with_the_mask_back(ablation):
    out, r = ablation
    saved = _files(out, "mask_ablation.png")
    lnv = r["ln_vocab"]
    c, n = r["causal"], r["no_mask"]
    assert lnv == pytest.approx(math.log(259))
    for key in ("final_train_loss", "val_loss"):
        assert key in c and key in n
    assert set(r["samples"]) == {"causal", "no_mask"}
    assert all(isinstance(s, str) and s.startswith("The ") for v in r["samples"].values() for s in v)
    # without the mask the model copies the next token: its training (and unmasked validation) loss is far lower
    assert n["final_train_loss"] < 0.5 * c["final_train_loss"]
    assert n["val_loss"] < 0.5 * c["val_loss"]
    # with the causal mask put back (generation) it is far worse than the causal model, towards guessing: at these
    # settings seeds 0/1/2 give 4.49/5.13/4.24 against ln 259 = 5.56, while the causal model stays at 2.5-2.8 (a
    # broken ablation, e.g. the mask not put back, would score the no-mask model's own ~0.25). The bounds keep the
    # claim's direction with a margin over that seed-to-seed spread: a 300-step run's exact loss rides on rounding.
    assert n["val_loss_with_causal_mask"] > 0.7 * lnv
    assert n["val_loss_with_causal_mask"] > 1.5 * c["val_loss"]
    assert n["val_loss_with_causal_mask"] > c["val_loss"] + 1.2
    # ... while the causal model's validation loss stays low
    assert c["val_loss"] < 0.55 * lnv
    assert saved["no_mask"]["val_loss_with_causal_mask"] == pytest.approx(n["val_loss_with_causal_mask"])
    assert saved["causal"]["train_curve"]["step"][-1] == 300


# ---- mask-placement ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def placement(ablation, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("mask_placement"))
    return out, mask_placement.run(None, out, workdir=os.path.join(ablation[0], "causal"))


def test_mask_placement_rows_and_future(placement):
    out, r = placement
    _files(out, "mask_placement.png")
    assert r["prompt"] == "小明把苹果给了小王" and len(r["tokens"]) == 27  # byte-level: 9 characters x 3 bytes
    first = r["first_changed"]
    assert first == 24 and r["changed_positions"][0] == 24
    before, after = np.asarray(r["row_sums"]["before"]), np.asarray(r["row_sums"]["after"])
    # before the softmax: every row sums to 1
    np.testing.assert_allclose(before, 1.0, atol=1e-5)
    # zeroing after it: no row sums to more than 1, and the rows that have a future mostly sum to less (a row
    # whose future weights are below float32's resolution next to 1 rounds to exactly 1.0: how many do depends
    # on the trained weights, which differ in their last bits between CPU generations)
    assert np.all(after <= 1.0 + 1e-6) and np.mean(after[:-1] < 1.0) >= 0.5 and after[:-1].min() < 0.99
    share = np.asarray(r["future_share_per_head"])
    assert r["head"] == int(np.argmin(np.abs(share - 1 / 3)))  # the head drawn by default
    assert after[-1] == pytest.approx(1.0, abs=1e-5)
    # ... by an amount that depends on the future
    changed_sums = np.asarray(r["row_sums"]["after_changed_future"])
    assert np.abs(changed_sums[:first] - after[:first]).max() > 1e-4
    cb, ca = r["changes"]["before"], r["changes"]["after"]
    # a future token changes nothing before it with the mask before the softmax ...
    assert cb["max_weights_change_past"] <= 1e-6
    assert cb["max_head_output_change_past"] <= 1e-6
    assert cb["max_logits_change_past"] <= 1e-5
    assert cb["past_rows_changed"] == 0
    # ... and moves past rows, head outputs and logits when the weights are zeroed after it
    assert ca["max_weights_change_past"] > 1e-4
    assert ca["past_rows_changed"] >= 1
    assert ca["max_head_output_change_past"] > 1e-5
    assert ca["max_logits_change_past"] > 1e-4
    # the experiment can see a change where there is one (rows at and after the changed token)
    assert max(cb["logits_change_per_row"][first:]) > 1e-4


def test_layer_views_are_the_models_own_weights(ablation):
    from causal_lm.train import load_for_inference

    model, tok, _ = load_for_inference(os.path.join(ablation[0], "causal"))
    ids = tok.encode("abc de")
    for layer in range(model.config.num_layers):
        v = mask_placement.layer_views(model, ids, layer)
        w = np.asarray(model.attention_weights(np.asarray([ids]))[layer, 0])
        np.testing.assert_allclose(v["weights_before"], w, atol=1e-6)
        assert np.all(v["weights_after"][:, ~v["causal"]] == 0)
    with pytest.raises(ValueError, match="out of range"):
        mask_placement.layer_views(model, ids, model.config.num_layers)


# ---- prefix-cost -------------------------------------------------------------------------------------------


def test_prefix_cost_counts_and_equality(tmp_path):
    out = str(tmp_path / "prefix_cost")
    r = prefix_cost.run(
        load_config("tiny"), out, lengths=(5,), gen_lengths=(5,), repeats=1
    )  # (5,): reuses 2+3's compile
    _files(out, "prefix_cost.png")
    f = r["five_tokens"]
    assert (f["positions_one_pass"], f["positions_every_prefix"], f["forwards_every_prefix"]) == (5, 15, 5)
    assert f["max_abs_logit_diff"] < 1e-4 < f["logits_scale"]
    g = r["generate_2_plus_3"]
    assert g["recompute"]["kv_computed"] == 9 and g["cache"]["kv_computed"] == 4 and g["tokens_equal"]
    (g5,) = r["generate"]  # the timed sweep over context lengths
    assert g5["context"] == 5 and g5["tokens_equal"]
    assert (g5["recompute"]["kv_computed"], g5["cache"]["kv_computed"]) == (9, 4)
    assert g5["recompute"]["time_per_token_s"] > 0 and g5["cache"]["time_per_token_s"] > 0


# ---- nope-position -----------------------------------------------------------------------------------------


def test_nope_position_probe_above_chance_only_with_the_mask(nope):
    out, r = nope
    saved = _files(out, "nope_position.png")
    assert saved["config"]["model"]["position"] == "none"
    c, n = r["causal"], r["no_mask"]
    assert len(c["r2"]) == 3  # embeddings + 2 blocks
    # the causal NoPE model's layers encode position ...
    assert c["best_r2"] > 0.15
    assert c["best_r2"] > c["max_chance_r2"] + 0.15
    assert min(c["mae"]) < 0.9 * c["mean_baseline_mae"]
    # ... which is not in the token embeddings: it comes from the mask
    assert c["r2"][0] < 0.05
    # without the mask, no layer does better than chance
    assert n["best_r2"] < 0.03
    assert max(c["chance_r2"] + n["chance_r2"]) < 0.03


# ---- the KV cache and non-causal models --------------------------------------------------------------------


@pytest.mark.parametrize("mask", ["none", "causal_after_softmax"])
def test_non_causal_models_refuse_a_cache_and_recompute_exactly(mask):
    config = load_config("tiny", [f"model.attention_mask={mask}"]).model
    model = build_model(config, 0)
    why = "needs attention_mask='causal'.*old token's K/V would change.*use_cache=False"
    with pytest.raises(CacheError, match=why):
        generate(model, [[5, 6]], max_new_tokens=3)
    with pytest.raises(CacheError, match=why):
        init_cache(config, 1, 8)
    causal_cache = init_cache(load_config("tiny").model, 1, 8)
    with pytest.raises(CacheError, match=why):
        model(np.asarray([[5, 6]], np.int32), cache=causal_cache)
    res = generate(model, [[5, 6]], max_new_tokens=4, use_cache=False)
    seq = [5, 6]  # greedy by hand: the model over the whole sequence so far, with its own mask, each step
    for _ in range(4):
        seq.append(int(np.argmax(np.asarray(forward(model, np.asarray([seq], np.int32))[0])[0, -1])))
    assert res.tokens[0] == seq[2:]
    assert res.kv_computed == 2 + 3 + 4 + 5


def test_hidden_states_end_in_the_logits():
    model = build_model(load_config("tiny").model, 0)
    tokens = np.asarray([[1, 2, 3, 4, 5]], np.int32)
    h = model.hidden_states(tokens)
    assert h.shape == (3, 1, 5, model.config.d_model)
    logits = np.asarray(
        model.final_norm(h[-1]) @ model.embed[...].T
        if model.config.tie_embeddings
        else model.final_norm(h[-1]) @ model.lm_head[...]
    )
    np.testing.assert_allclose(logits, np.asarray(forward(model, tokens)[0]), atol=1e-4)


# ---- the command line ----------------------------------------------------------------------------------------


def test_cli_runs_an_experiment_end_to_end(ablation, tmp_path, capsys):
    from causal_lm.cli import main

    out = str(tmp_path / "cli")
    os.makedirs(out)
    for name in ("causal", "no_mask"):  # trained workdirs of the same config: the command reuses them
        shutil.copytree(os.path.join(ablation[0], name), os.path.join(out, name))
    assert main(["experiment", "mask-ablation", "--out", out, *ABLATION]) == 0
    printed = capsys.readouterr().out
    assert "no mask with the causal mask put back" in printed and "report.md" in printed
    r = _files(out, "mask_ablation.png")
    assert r["no_mask"]["val_loss_with_causal_mask"] > r["causal"]["val_loss"] + 2.0
    assert main(["experiment", "mask-ablation", "--out", out, "model.not_a_key=1"]) == 2


def test_kv_memory_measures_what_it_calculates_and_orders_the_layouts(tmp_path):
    """Tiny settings: 2 training steps per layout, a 128-token context, window 16, no decode timing."""
    from causal_lm.experiments import kv_memory

    out = str(tmp_path / "kv_memory")
    config = apply_overrides(
        kv_memory.default_config(),
        ["train.steps=2", "train.eval_every=2", "train.checkpoint_every=2", "train.seq_len=32", "model.num_layers=6"],
    )
    names = ("MHA", "MQA", "MLA", "local-16", "5:1 mixed")
    r = kv_memory.run(
        config, out, context=128, window=16, drift_tokens=4, reps=0, names=names, dtypes=("float32", "int8")
    )
    assert _files(out, "kv_memory.png")["experiment"] == "kv-memory"
    lay = r["layouts"]
    assert tuple(lay) == names
    f32 = {n: v["caches"]["float32"]["bytes_per_token_at_context"] for n, v in lay.items()}
    for name, v in lay.items():
        for dtype, c in v["caches"].items():
            assert c["measured_bytes"] == c["calculated_bytes"], (name, dtype)
        assert v["caches"]["int8"]["bytes_per_token_at_context"] < f32[name]
        assert 0 < v["caches"]["int8"]["max_logit_diff"] and 0 <= v["caches"]["int8"]["greedy_agreement"] <= 1
    assert f32["MHA"] > f32["MQA"] and f32["MHA"] > f32["MLA"]
    assert f32["local-16"] < f32["5:1 mixed"] < f32["MQA"] * 2  # rings of 16 slots against 128 full-length ones
    assert "measured == calculated: True" in kv_memory.summary(r)


def test_mask_ablation_report_sentences_follow_the_numbers():
    # What the lessons predict (the no-mask model copies; put back under the mask it scores near ln V) and a run too
    # short to learn the shortcut: the report must not claim the copy, or "as bad as guessing", when its numbers
    # say otherwise.
    def results(n_train, n_val, n_back, c_train, c_val, c_unmasked):
        return {
            "config": {"train": {"steps": 5}},
            "ln_vocab": math.log(259),
            "vocab_size": 259,
            "causal": {"final_train_loss": c_train, "val_loss": c_val, "val_loss_without_mask": c_unmasked},
            "no_mask": {"final_train_loss": n_train, "val_loss": n_val, "val_loss_with_causal_mask": n_back},
        }

    learned = " ".join(mask_ablation.what_it_shows(results(0.07, 0.06, 5.03, 1.97, 2.02, 4.2)))
    assert "learns to copy" in learned and "about as bad as guessing" in learned
    assert "copying the answer" in learned and "also wrong" in learned
    short = " ".join(mask_ablation.what_it_shows(results(4.9, 4.8, 4.7, 5.0, 4.9, 4.85)))
    assert "has not yet learned to copy" in short and "after 5 steps" in short
    assert "learns to copy" not in short and "copying the answer" not in short and "as bad as" not in short
    assert "better than guessing" in short and "no worse than the causal model" in short
    assert "also wrong" not in short and "did not make it worse" in short
