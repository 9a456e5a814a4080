"""`causal-lm kv-bytes` reproduces the published KV-cache figures, and init_cache allocates what it predicts."""

import glob
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from causal_lm import cli
from causal_lm.commands.kv_bytes import human_bytes, kv_bytes
from causal_lm.config import ConfigError, ModelConfig, load_config
from causal_lm.model import init_cache
from causal_lm.model.kv_cache import cache_bytes

KiB, GiB = 1024, 1024**3
CONTEXT = 262_144


def kv_json(capsys, *argv):
    assert cli.main(["kv-bytes", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# The anchor's 16 full-attention layers, 24 query heads of dim 256, bf16: the lesson's three figures.
@pytest.mark.parametrize(
    "preset,per_token,total",
    [
        ("anchor_16l_mha", 384 * KiB, 96 * GiB),
        ("anchor_16l_gqa4", 64 * KiB, 16 * GiB),
        ("anchor_16l_mqa", 16 * KiB, 4 * GiB),
    ],
)
def test_anchor_figures(capsys, preset, per_token, total):
    r = kv_json(capsys, "--preset", preset, "--context", str(CONTEXT), "--bytes-per-element", "2")
    assert r["bytes_per_token"] == per_token and r["kv_bytes"] == total
    # what init_cache allocates besides K/V: each slot's position and the row's length (int32)
    assert r["total_bytes"] == r["allocated_bytes"] == total + 4 * CONTEXT + 4


def test_deepseek_67b_gqa_and_as_mha(capsys):
    r = kv_json(capsys, "--preset", "deepseek_67b", "--context", "1")
    assert (r["attention"], r["bytes_per_token"]) == ("GQA-8", 389_120)
    mha = kv_json(capsys, "--preset", "deepseek_67b", "num_kv_heads=64", "--context", "1")
    assert (mha["attention"], mha["bytes_per_token"]) == ("MHA", 3_112_960)
    # The lesson's 1M-token request: 380 GiB for one sequence.
    assert kv_json(capsys, "--preset", "deepseek_67b", "--context", str(2**20))["kv_bytes"] == 380 * GiB


def test_deepseek_v2_v3_mla(capsys):
    v2 = kv_json(capsys, "--preset", "deepseek_v2", "--context", "1")
    assert (v2["attention"], v2["bytes_per_token"]) == ("MLA", 69_120)
    assert (v2["kv_lora_rank"], v2["qk_rope_head_dim"]) == (512, 64)
    dense = kv_json(capsys, "--preset", "deepseek_67b", "--context", "1")["bytes_per_token"]
    assert f"{100 * (1 - v2['bytes_per_token'] / dense):.1f}%" == "82.2%"
    assert kv_json(capsys, "--preset", "deepseek_v3", "--context", "1")["bytes_per_token"] == 70_272
    # An override changes the preset's shape: V2 with V3's 61 layers costs what V3 costs.
    assert kv_json(capsys, "--preset", "deepseek_v2", "num_layers=61", "--context", "1")["bytes_per_token"] == 70_272


def test_text_output_and_units(capsys):
    assert cli.main(["kv-bytes", "--preset", "anchor_16l_mha", "--context", str(CONTEXT)]) == 0
    out = capsys.readouterr().out
    assert "393,216 B (384 KiB)" in out and "(96 GiB)" in out
    assert human_bytes(69_120) == "67.5 KiB" and human_bytes(4 * GiB) == "4 GiB" and human_bytes(12) == "12 B"


def test_element_size_and_config_file(capsys, repo_root):
    r = kv_json(
        capsys,
        "--config",
        os.path.join(repo_root, "configs", "anchor_16l_gqa4.py"),
        "--context",
        "10",
        "--bytes-per-element",
        "4",
    )
    assert r["bytes_per_token"] == 128 * KiB and r["kv_bytes"] == 1280 * KiB


def test_sliding_window_counts_local_layers_at_their_window(capsys):
    # 16 layers, 3 local : 1 global, window 4096: 12 layers hold 4096 tokens, 4 hold all 262,144.
    r = kv_json(
        capsys,
        "--preset",
        "anchor_16l_gqa4",
        "sliding_window=4096",
        "layer_pattern=local,local,local,global",
        "--context",
        str(CONTEXT),
    )
    assert r["local_layers"] == 12
    assert r["kv_bytes"] == 4 * KiB * (12 * 4096 + 4 * CONTEXT)  # local layers keep a ring of `window` slots
    assert r["allocated_bytes"] == r["total_bytes"] == r["kv_bytes"] + 4 * (4096 + CONTEXT) + 4
    short = kv_json(capsys, "--preset", "anchor_16l_gqa4", "sliding_window=4096", "--context", "1000")
    assert short["kv_bytes"] == 64 * KiB * 1000  # shorter than the window: every layer holds all 1000 tokens
    ahead = kv_json(
        capsys, "--preset", "anchor_16l_gqa4", "sliding_window=4096", "--context", str(CONTEXT), "--lookahead", "4"
    )
    assert ahead["kv_bytes"] == 64 * KiB * 4100  # all local: a ring of window + lookahead slots


def test_every_preset_answers_without_building_a_model(capsys, repo_root, monkeypatch):
    import causal_lm.model.transformer as transformer

    def refuse(*a, **k):
        raise AssertionError("kv-bytes must not build a model")

    monkeypatch.setattr(transformer.Decoder, "__init__", refuse)
    for path in sorted(glob.glob(os.path.join(repo_root, "configs", "*.py"))):
        name = os.path.basename(path)[:-3]
        r = kv_json(capsys, "--preset", name, "--context", "4096")
        assert r["bytes_per_token"] > 0 and r["total_bytes"] > 0, name


def test_bad_arguments(capsys):
    assert cli.main(["kv-bytes", "--preset", "deepseek_v2", "--context", "0"]) == 2
    assert cli.main(["kv-bytes", "--preset", "no_such_preset", "--context", "8"]) == 2
    assert cli.main(["kv-bytes", "--preset", "deepseek_v2", "kv_lora_rnak=8", "--context", "8"]) == 2
    err = capsys.readouterr().err
    assert "context" in err and "not found" in err and "kv_lora_rank" in err  # the valid keys are listed
    with pytest.raises(SystemExit):
        cli.main(["kv-bytes", "--preset", "deepseek_v2", "--config", "x.py", "--context", "8"])
    with pytest.raises(SystemExit):
        cli.main(["kv-bytes", "--context", "8"])


# ---- the project's own models: what init_cache allocates == what the calculator predicts ---------------------


def _tiny(**kw):
    base = dict(vocab_size=61, d_model=32, num_layers=3, num_heads=4, mlp_dim=48, max_seq_len=64)
    base.update(kw)
    return ModelConfig(**base)


OWN_MODELS = {
    "mha": _tiny(),
    "gqa": _tiny(num_kv_heads=2),
    "mqa": _tiny(num_kv_heads=1),
    "mla": _tiny(attention_type="mla", kv_lora_rank=12, qk_rope_head_dim=4),
    "mla-qlora-absorb": _tiny(
        attention_type="mla",
        kv_lora_rank=10,
        q_lora_rank=6,
        qk_nope_head_dim=6,
        qk_rope_head_dim=2,
        v_head_dim=5,
        mla_absorb=True,
    ),
    "mla-nope": _tiny(attention_type="mla", kv_lora_rank=12, position="none"),
    "sliding": _tiny(num_kv_heads=2, sliding_window=5, layer_pattern="local,global"),
    "mqa-all-local": _tiny(num_kv_heads=1, sliding_window=7),
    "mla-mixed": _tiny(attention_type="mla", kv_lora_rank=12, sliding_window=3, layer_pattern="local,local,global"),
    "small-preset": load_config("small").model,
}


@pytest.mark.parametrize("name", OWN_MODELS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "float8_e4m3fn"])
def test_init_cache_allocates_what_kv_bytes_predicts(capsys, name, dtype):
    """cache.total_bytes (the arrays' own nbytes) == kv-bytes' total_bytes: windows (rings), mixed patterns, MLA,
    and the scaled storage types, whose scales count."""
    config, context = OWN_MODELS[name], 40
    cache = init_cache(config, 1, context, dtype)
    actual = sum(x.nbytes for x in jax.tree.leaves(cache))
    predicted = kv_bytes(config, context, cache_dtype=dtype)
    assert cache.total_bytes == actual == predicted["total_bytes"] == predicted["allocated_bytes"]
    assert cache.bytes_per_token == predicted["bytes_per_token"]
    if dtype in ("float32", "bfloat16"):  # no scales: the config's own per-token arithmetic agrees
        assert cache.bytes_per_token == config.kv_bytes_per_token(jnp.dtype(dtype).itemsize)
    # a batch of 3 and a lookahead: the same arithmetic, three times the rows and wider rings
    big = init_cache(config, 3, context, dtype, lookahead=2)
    assert big.total_bytes == cache_bytes(config, context, dtype=dtype, batch_size=3, lookahead=2)["total_bytes"]


def test_kv_bytes_cli_cache_dtype_matches_init_cache(capsys):
    config = load_config("small").model
    for dtype in ("bfloat16", "int8"):
        r = kv_json(capsys, "--preset", "small", "--context", "64", "--cache-dtype", dtype)
        assert r["total_bytes"] == init_cache(config, 1, 64, dtype).total_bytes
    f32 = kv_json(capsys, "--preset", "small", "--context", "64", "--cache-dtype", "float32")
    i8 = kv_json(capsys, "--preset", "small", "--context", "64", "--cache-dtype", "int8")
    # int8 stores a quarter of float32's K/V bytes plus one float32 scale per token and KV head
    kv_per_token = 2 * config.num_kv_heads * config.head_dim
    assert i8["bytes_per_token"] == config.num_layers * (kv_per_token + 2 * config.num_kv_heads * 4)
    assert f32["bytes_per_token"] == config.num_layers * kv_per_token * 4


def test_mla_cache_is_latent_plus_rope_key_only():
    config = OWN_MODELS["mla"]
    cache = init_cache(config, 2, 16)
    (group,) = cache.groups
    assert set(group.arrays) == {"latent", "rope_key"}  # no K, no V
    assert group.arrays["latent"].shape == (3, 2, 16, 12) and group.arrays["rope_key"].shape == (3, 2, 16, 4)
    # Versus the same heads as MHA: 2 x 4 heads x 8 dims = 64 elements per layer and token, MLA 12 + 4 = 16.
    assert _tiny().kv_bytes_per_token(4) == 4 * config.kv_bytes_per_token(4)


def test_config_validation_names_the_fix():
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        ModelConfig(attention_type="mla")
    with pytest.raises(ConfigError, match="only apply to attention_type='mla'"):
        ModelConfig(kv_lora_rank=64)
    with pytest.raises(ConfigError, match="num_kv_heads"):
        ModelConfig(attention_type="mla", kv_lora_rank=64, num_kv_heads=2)
    with pytest.raises(ConfigError, match="attention_type"):
        ModelConfig(attention_type="linear")
    np.testing.assert_equal(
        ModelConfig(num_layers=5, sliding_window=8, layer_pattern=("local", "global")).layer_windows, (8, 0, 8, 0, 8)
    )
