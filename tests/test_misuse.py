"""No silent wrong answers at the Python API and in conversion (issue 33): a cache must match its model, cache
arguments are checked, weights must be finite, and a damaged or suspicious Hugging Face / GGUF input, or a
conversion into a training workdir, is one clear error before anything is computed or overwritten."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from variants import tiny_config, tiny_model

from causal_lm import CacheError, init_cache
from causal_lm.model.functional import forward

TOKENS = np.array([[3, 1, 4, 1, 5]], np.int32)


# ---- a cache belongs to its model ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cache_config, field",
    [
        (dict(num_kv_heads=4), "num_kv_heads is 4 in the cache, 2 in the model"),
        (dict(sliding_window=4), "the window of layers [0, 1] is 4 in the cache, 0 in the model"),
        (dict(head_dim=16), "head_dim is 16 in the cache, 8 in the model"),
        (dict(num_layers=3), "the number of layers is 3 in the cache, 2 in the model"),
        (
            dict(attention_type="mla", kv_lora_rank=8, num_kv_heads=None),
            "what each slot holds is latent/rope_key in the cache, k/v",
        ),
    ],
    ids=["kv_heads", "window", "head_dim", "layers", "mla"],
)
def test_a_cache_of_another_layout_is_refused_naming_the_field(cache_config, field):
    """Today a cache for 4 KV heads on a 2-head model, or one with a window on a model without one, returns
    logits that differ with no error; another head_dim fails inside JAX's reshape."""
    model = tiny_model(tiny_config())
    cache = init_cache(tiny_config().replace(**cache_config), 1, 16)
    with pytest.raises(CacheError, match="not built for this model") as e:
        model(TOKENS, cache=cache)
    assert field in str(e.value)
    # the jitted entry point (the cache a traced pytree there) refuses it the same way, while tracing
    with pytest.raises(CacheError, match="not built for this model") as e:
        forward(model, TOKENS, cache=init_cache(tiny_config().replace(**cache_config), 1, 16))
    assert field in str(e.value)


@pytest.mark.parametrize(
    "cache_config, field",
    [
        (dict(num_kv_heads=4), "num_kv_heads is 4 in the cache, 2 in the model"),
        (dict(head_dim=16), "head_dim is 16 in the cache, 8 in the model"),
        (dict(sliding_window=4), "the layer groups (window, layers) is [(4, (0, 1))] in the cache, [(0, (0, 1))]"),
    ],
    ids=["kv_heads", "head_dim", "window"],
)
def test_the_engines_paged_cache_of_another_layout_is_refused_naming_the_field(cache_config, field):
    """The engine's pages go through the same check (PagedKVCache.check_matches), against init_pool's layout."""
    from causal_lm.model.paged_cache import PagedKVCache, init_pool

    model = tiny_model(tiny_config())
    pool = init_pool(tiny_config().replace(**cache_config), 4, 4)
    cache = PagedKVCache(pool=pool, table=jnp.zeros((1, 4), jnp.int32), lengths=jnp.zeros((1,), jnp.int32))
    with pytest.raises(CacheError, match="not built for this model") as e:
        model(TOKENS, cache=cache)
    assert field in str(e.value)


def test_a_cache_whose_storage_type_is_not_its_arrays_is_refused():
    config = tiny_config()
    model = tiny_model(config)
    cache = dataclasses.replace(init_cache(config, 1, 16), storage="int8")  # float32 arrays, no scales
    with pytest.raises(CacheError, match="arrays of storage 'int8'"):
        model(TOKENS, cache=cache)


def test_the_cache_check_runs_inside_jit_on_static_shapes_only():
    """Inside jit the cache is a traced pytree: the check compares shapes and metadata, so a matching cache
    traces and runs, and a mismatching one is refused at trace time."""
    config = tiny_config()
    model = tiny_model(config)
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, cache):
        return nnx.merge(graphdef, state)(jnp.asarray(TOKENS), cache=cache)

    logits, cache = step(state, init_cache(config, 1, 16))
    np.testing.assert_allclose(logits, model(TOKENS)[0], atol=1e-5, rtol=0)
    assert np.asarray(cache.lengths).tolist() == [5]
    with pytest.raises(CacheError, match="num_kv_heads is 4 in the cache, 2 in the model"):
        step(state, init_cache(tiny_config(kv="mha"), 1, 16))


# ---- cache arguments ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lookahead=1.5), "lookahead must be an integer >= 0, got 1.5"),
        (dict(lookahead=-1), "lookahead must be an integer >= 0, got -1"),
        (dict(dtype="foo"), "cache dtype must be one of float32, bfloat16, float16, int8, float8_e4m3fn, got 'foo'"),
        (dict(dtype="int32"), "cache dtype must be one of .* got 'int32'"),
        (dict(max_len=0), "max_len must be a positive integer, got 0"),
        (dict(batch_size=True), "batch_size must be a positive integer, got True"),
    ],
)
def test_init_cache_refuses_bad_arguments(kwargs, match):
    args = dict(batch_size=1, max_len=16) | kwargs
    with pytest.raises(CacheError, match=match):
        init_cache(tiny_config(sliding_window=4), args.pop("batch_size"), args.pop("max_len"), **args)


def test_rollback_refuses_negative_lengths_and_lengths_beyond_the_current_ones():
    config = tiny_config()
    _, cache = forward(tiny_model(config), TOKENS, cache=init_cache(config, 1, 16))
    with pytest.raises(CacheError, match="cannot roll row 0 back to length -3"):
        cache.rollback([-3])
    with pytest.raises(CacheError, match="cannot roll row 0 back to length 7: .*current 5"):
        cache.rollback(np.array([7]))
    with pytest.raises(CacheError, match="integer lengths"):
        cache.rollback([2.5])
    assert np.asarray(cache.rollback([2]).lengths).tolist() == [2]


# ---- finite weights --------------------------------------------------------------------------------------------


def _nan_model():
    """A fresh tiny model with one NaN in an MLP weight (not the shared tiny_model)."""
    from causal_lm.model import build_model

    model = build_model(tiny_config())
    model.blocks.mlp.w_up[...] = model.blocks.mlp.w_up[...].at[1, 3, 5].set(jnp.nan)
    return model


def test_generate_refuses_a_model_with_a_nan_parameter_naming_it():
    """Today: NaN logits, argmax picks token 0 every step, and the garbage comes back with no error."""
    from causal_lm import WeightError, generate

    model = _nan_model()
    with pytest.raises(WeightError, match=r"parameter blocks\.mlp\.w_up holds NaN"):
        generate(model, [[1, 2, 3]], max_new_tokens=2)
    with pytest.warns(UserWarning, match=r"blocks\.mlp\.w_up holds NaN; going on as asked"):
        out = generate(model, [[1, 2, 3]], max_new_tokens=2, check_finite=False)
    assert len(out.tokens[0]) == 2


def test_an_eager_call_refuses_nan_weights_once_per_array():
    """model(...) outside jit says so instead of returning NaN logits; the reduction runs once per array object:
    a second call reduces nothing, and replacing one array reduces that one only."""
    from causal_lm import WeightError
    from causal_lm.model import weights

    model = _nan_model()
    with pytest.raises(WeightError, match=r"blocks\.mlp\.w_up holds NaN"):
        model(TOKENS)
    with pytest.raises(WeightError, match=r"blocks\.mlp\.w_up holds NaN"):
        forward(model, TOKENS)  # the jitted entry point checks before it traces
    model.blocks.mlp.w_up[...] = jnp.nan_to_num(model.blocks.mlp.w_up[...])
    assert weights._magnitudes(model)[2] == {"blocks.mlp.w_up"}
    assert weights._magnitudes(model)[2] == set()
    logits, _ = model(TOKENS)
    assert np.isfinite(np.asarray(logits)).all()
    model.embed[...] = model.embed[...].at[0, 0].set(jnp.inf)
    with pytest.raises(WeightError, match="embed holds an infinity"):
        model(TOKENS)
    with pytest.warns(UserWarning, match="embed holds an infinity"):
        weights.check_weights(model, warn=True)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        weights.check_weights(model, warn=True)  # once per array object


# ---- conversion is as careful as checkpoints ---------------------------------------------------------------


def _cli(capsys, *argv):
    """(status, stderr lines other than notes and warnings) of `causal-lm ARGV` run in this process."""
    from causal_lm.cli import main

    capsys.readouterr()
    status = main(list(argv))
    out = capsys.readouterr()
    lines = [line for line in out.err.splitlines() if ": note: " not in line and ": warning: " not in line]
    return status, lines, out.out


def _assert_one_error_line(lines, *expected):
    assert len(lines) == 1 and lines[0].startswith("causal-lm convert: error: "), lines
    for text in expected:
        assert text in lines[0], (text, lines)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny Hugging Face folder (config.json, model.safetensors, tokenizer.json) written by save_hf: no torch."""
    pytest.importorskip("safetensors")
    from causal_lm import save_hf
    from causal_lm.data import ByteTokenizer

    path = str(tmp_path_factory.mktemp("hf") / "tiny")
    save_hf(tiny_model(tiny_config(vocab_size=259)), ByteTokenizer(), path)
    return path


def _copy_hf(hf_dir, tmp_path):
    import shutil

    dst = str(tmp_path / "hf")
    shutil.copytree(hf_dir, dst)
    return dst


def test_a_truncated_safetensors_file_is_one_line_naming_it(hf_dir, tmp_path):
    """Today: a 23-line traceback from the safetensors library. Run as a real subprocess: no traceback at all."""
    import os
    import subprocess
    import sys

    src = _copy_hf(hf_dir, tmp_path)
    weights = os.path.join(src, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    out = subprocess.run(
        [sys.executable, "-m", "causal_lm.cli", "convert", "--from-hf", src, "--workdir", str(tmp_path / "wd")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    _assert_one_error_line(lines, weights, "cannot be read as safetensors")
    assert not os.path.exists(tmp_path / "wd")


def test_a_garbled_config_json_names_the_file_and_the_position(hf_dir, tmp_path, capsys):
    src = _copy_hf(hf_dir, tmp_path)
    with open(f"{src}/config.json", "w") as f:
        f.write('{\n  "architectures": ["LlamaForCausalLM"],,\n}')
    status, lines, _ = _cli(capsys, "convert", "--from-hf", src, "--workdir", str(tmp_path / "wd"))
    assert status == 2
    _assert_one_error_line(lines, f"{src}/config.json is not valid JSON", "line 2 column 41")


@pytest.mark.parametrize(
    "value, why", [(3.0e6, "holds |w| = 3e+06, beyond 10000"), (np.nan, "holds NaN")], ids=["huge", "nan"]
)
def test_a_tensor_with_corrupt_values_is_refused_at_conversion(hf_dir, tmp_path, capsys, value, why):
    """safetensors has no checksum: a huge (or NaN) value is the only sign of corrupt bytes. Today a huge one is
    converted silently (and a NaN is named only by our parameter name, after the whole model was built)."""
    from safetensors.numpy import load_file, save_file

    src = _copy_hf(hf_dir, tmp_path)
    file = f"{src}/model.safetensors"
    tensors = load_file(file)
    tensors["model.layers.1.mlp.up_proj.weight"][2, 3] = value
    save_file(tensors, file, metadata={"format": "pt"})
    status, lines, _ = _cli(capsys, "convert", "--from-hf", src, "--workdir", str(tmp_path / "wd"))
    assert status == 2
    _assert_one_error_line(lines, file, "tensor 'model.layers.1.mlp.up_proj.weight' " + why)


def test_converting_into_a_workdir_with_checkpoints_needs_force(hf_dir, tmp_path, capsys):
    """Today the converted model is written as checkpoints/0 beside the run's step 30, which every command then
    ignores (the newest wins) and a later `train` deletes."""
    import os

    from causal_lm.config import Config, TrainConfig
    from causal_lm.data import ByteTokenizer
    from causal_lm.train import save_for_inference

    wd = str(tmp_path / "wd")
    trained = tiny_model(tiny_config(vocab_size=259))
    save_for_inference(
        wd, trained, Config(model=trained.config, train=TrainConfig(seq_len=64)), ByteTokenizer(), step=30
    )
    status, lines, _ = _cli(capsys, "convert", "--from-hf", hf_dir, "--workdir", wd)
    assert status == 2
    _assert_one_error_line(lines, f"{wd} already holds checkpoints (steps 30)", "--force")
    assert sorted(os.listdir(os.path.join(wd, "checkpoints"))) == ["30"]
    status, lines, out = _cli(capsys, "convert", "--from-hf", hf_dir, "--workdir", wd, "--force")
    assert status == 0, lines
    assert f"--force: moved the checkpoints it held (steps 30) to {wd}/checkpoints_refused" in out
    assert sorted(d for d in os.listdir(os.path.join(wd, "checkpoints")) if d.isdigit()) == ["0"]
    assert os.listdir(os.path.join(wd, "checkpoints_refused")) == ["30"]  # moved, not lost


# ---- small things found on the way -------------------------------------------------------------------------


def test_to_hf_writes_the_weights_readable_like_every_other_file(tmp_path):
    """safetensors creates its file 0600; the folder is meant for others (transformers, a model hub) to read."""
    import os

    from causal_lm import save_hf
    from causal_lm.data import ByteTokenizer

    pytest.importorskip("safetensors")
    old = os.umask(0o022)
    try:
        save_hf(tiny_model(tiny_config(vocab_size=259)), ByteTokenizer(), str(tmp_path / "out"))
    finally:
        os.umask(old)
    modes = {f: oct(os.stat(tmp_path / "out" / f).st_mode & 0o777) for f in os.listdir(tmp_path / "out")}
    assert set(modes.values()) == {"0o644"}, modes


def test_missing_checksums_are_a_sentence_and_notes_keep_the_workdir_as_given(tmp_path, monkeypatch):
    import shutil

    from causal_lm.config import Config, TrainConfig
    from causal_lm.data import ByteTokenizer
    from causal_lm.train import IntegrityError, load_for_inference, save_for_inference

    monkeypatch.chdir(tmp_path)
    model = tiny_model(tiny_config(vocab_size=259))
    path = save_for_inference("wd", model, Config(model=model.config, train=TrainConfig(seq_len=64)), ByteTokenizer())
    shutil.rmtree(f"{path}/integrity")
    with pytest.raises(IntegrityError) as e:
        load_for_inference("wd", step=0)
    assert str(e.value) == (
        "checkpoint 0 in wd/checkpoints is damaged: its checksums (integrity/) are missing, so what it holds "
        "cannot be verified"
    )


def test_a_yarn_factor_below_one_is_refused():
    from causal_lm.config import ConfigError

    with pytest.raises(ConfigError, match="rope_scaling.type='yarn' needs model.rope_scaling.factor >= 1 .*got 0.5"):
        tiny_config(rope_type="yarn", rope_factor=0.5, rope_original_max_len=16)
