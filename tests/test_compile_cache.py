"""The command line's persistent compilation cache: where it lives, how it is turned off, and that a second
`causal-lm generate` on the same workdir loads every compiled program from it (the folder gains entries on the
first run and none on the second), with the same text."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from causal_lm import compile_cache
from causal_lm.bench.train import compile_seconds
from causal_lm.config import load_config
from causal_lm.data import ByteTokenizer
from causal_lm.model import build_model
from causal_lm.train import save_for_inference


def test_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.cache_dir() == str(tmp_path / "xdg" / "causal_lm" / "jax")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.cache_dir() == str(tmp_path / "home" / ".cache" / "causal_lm" / "jax")
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "mine"))
    assert compile_cache.cache_dir() == str(tmp_path / "mine")
    for off in ("off", "0", "", "OFF", "false"):
        monkeypatch.setenv(compile_cache.ENV, off)
        assert compile_cache.cache_dir() is None and compile_cache.enable() is None


def _generate(workdir, cache, *extra):
    env = {**os.environ, compile_cache.ENV: str(cache)}
    argv = ["--workdir", workdir, "--prompt", "The cat", "--max-new-tokens", "6", *extra]
    proc = subprocess.run(
        [sys.executable, "-m", "causal_lm.cli", "generate", *argv], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, proc.stderr


def _entries(folder):
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def test_second_generate_loads_every_compiled_program_from_the_cache(tmp_path):
    config = load_config("tiny", [])
    workdir = str(tmp_path / "w")
    save_for_inference(workdir, build_model(config.model, seed=0), config, ByteTokenizer())
    cache = tmp_path / "jax"
    out1, err1 = _generate(workdir, cache)
    first = _entries(cache)
    assert first, "the first run wrote no compiled program to the cache folder"
    out2, err2 = _generate(workdir, cache)
    assert _entries(cache) == first  # nothing compiled the second time: every program came from the folder
    assert out1 == out2 and out1.startswith("The cat") and len(out1) > len("The cat")
    assert "first token after" in err2.splitlines()[-1]
    # Another prompt length and more new tokens, within the same buckets (prompts up to 8 tokens, up to 16 new
    # tokens), compile nothing new either.
    _generate(workdir, cache, "--prompt", "A cat", "--max-new-tokens", "9")
    assert _entries(cache) == first


@pytest.fixture
def cache_in(tmp_path):
    """The persistent cache on in a fresh folder for one test, and JAX's cache settings as before afterwards."""
    before = jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache
    folder = tmp_path / "jax"
    assert compile_cache.enable(str(folder)) == str(folder)
    yield folder
    jax_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", before[0])
    jax.config.update("jax_enable_compilation_cache", before[1])


def test_bench_train_times_a_real_compile_not_a_cache_load(cache_in):
    """`bench train`'s compile time bypasses the persistent cache (a run after another read 2.2 s for a 15.6 s
    compile): timing the same step twice writes nothing to the folder, and the cache works as before afterwards."""
    config = load_config("tiny", ["model.num_layers=1"])
    assert compile_seconds(config) > 0
    assert _entries(cache_in) == []
    compile_seconds(config)
    assert _entries(cache_in) == []
    jax.jit(lambda x: x * 3 + 1)(jnp.ones(5)).block_until_ready()
    assert any(e.startswith("jit__lambda") for e in _entries(cache_in)), _entries(cache_in)


def test_bypassed_restores_the_flag_it_found_when_nested_and_when_off():
    """The cache flag after `bypassed()` is the one it found: off stays off (a caller who turned the cache off),
    and an inner bypass leaves the outer one's block uncached."""
    before = jax.config.jax_enable_compilation_cache
    try:
        for found in (False, True):
            jax.config.update("jax_enable_compilation_cache", found)
            with compile_cache.bypassed():
                assert jax.config.jax_enable_compilation_cache is False
                with compile_cache.bypassed():
                    assert jax.config.jax_enable_compilation_cache is False
                assert jax.config.jax_enable_compilation_cache is False  # still inside the outer bypass
            assert jax.config.jax_enable_compilation_cache is found
    finally:
        jax_cache.reset_cache()
        jax.config.update("jax_enable_compilation_cache", before)
