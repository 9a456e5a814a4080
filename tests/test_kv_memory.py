"""Window-sized ring-buffer caches and quantized caches: exact where exactness is promised, measured where not.

Ring buffers: a local (sliding-window) layer keeps W + lookahead slots written at position mod capacity; its
slots' positions feed the one mask function. Cached decoding must equal recomputation over generations ten times
the window, for chunk sizes below, at and above the window, ragged rows that wrap at different steps, mixed
local/global patterns, GQA, MQA and MLA.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_cache import assert_cache_equals_recompute
from variants import tiny_config, tiny_mla_config, tiny_model

from causal_lm import CacheError, generate, init_cache
from causal_lm.model.functional import forward
from causal_lm.model.kv_cache import cache_bytes


def _local(kv, window, pattern="", **kw):
    return tiny_config(kv, "rope_full", sliding_window=window, layer_pattern=pattern, **kw)


# ---- exactness -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [1, 2, 3, 8])
@pytest.mark.parametrize("kv, pattern", [("gqa", ""), ("mqa", "local,global")], ids=["gqa-all-local", "mqa-mixed"])
def test_ring_cache_equals_recompute_over_ten_windows(window, kv, pattern):
    """Prompts of 11 and 5 tokens, 10 x window new tokens (at least 16): the rows wrap at different steps."""
    model = tiny_model(_local(kv, window, pattern))
    assert_cache_equals_recompute(model, new=max(16, 10 * window))


def test_ring_cache_with_mla_and_sinks():
    config = tiny_mla_config(num_layers=3, attn_sink=True, sliding_window=3, layer_pattern="local,local,global")
    assert_cache_equals_recompute(tiny_model(config), new=30)


@pytest.mark.parametrize("chunk", [2, 3, 7])
def test_chunks_smaller_equal_and_larger_than_the_window(chunk):
    """Window 3: a chunk of 7 writes more than the ring keeps; its queries still see their own earlier keys."""
    model = tiny_model(_local("gqa", 3))
    assert_cache_equals_recompute(model, new=30, chunk_size=chunk)


def test_a_long_prefill_into_a_small_ring_equals_the_full_forward():
    config = _local("gqa", 3)
    model = tiny_model(config)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 40)).astype(np.int32)
    want = np.asarray(forward(model, tokens)[0])
    cache = init_cache(config, 2, 64)
    assert cache.groups[0].capacity == 3  # the whole cache holds 3 tokens per layer and row
    got, cache = forward(model, tokens[:, :25], cache=cache)  # 25 tokens in one call: the ring keeps the last 3
    np.testing.assert_allclose(np.asarray(got), want[:, :25], atol=1e-5, rtol=0)
    for t in range(25, 40):
        step, cache = forward(model, tokens[:, t : t + 1], cache=cache)
        np.testing.assert_allclose(np.asarray(step)[:, 0], want[:, t], atol=1e-5, rtol=0)
    assert sorted(np.asarray(cache.groups[0].positions)[0].tolist()) == [37, 38, 39]


# ---- memory and capacity ---------------------------------------------------------------------------------------


def test_local_layers_keep_only_their_window():
    config = _local("gqa", 4, "local,local,global", num_layers=3)
    cache = init_cache(config, 2, 64)
    local, glob = cache.groups
    assert (local.window, local.capacity, local.layers) == (4, 4, (0, 1))
    assert (glob.window, glob.capacity, glob.layers) == (0, 64, (2,))
    assert init_cache(config, 2, 64, lookahead=3).groups[0].capacity == 7
    assert cache.total_bytes == cache_bytes(config, 64, batch_size=2)["total_bytes"]


def test_a_global_layer_overflows_clearly_and_a_local_one_never():
    mixed, local = _local("gqa", 4, "local,global"), _local("gqa", 4)
    cache = init_cache(mixed, 1, 16)
    _, cache = forward(tiny_model(mixed), np.ones((1, 12), np.int32), cache=cache)
    with pytest.raises(CacheError, match="overflow: row 0 holds 12 tokens and 6 more do not fit in max_len=16"):
        forward(tiny_model(mixed), np.ones((1, 6), np.int32), cache=cache)
    # all local: the ring wraps for as long as the model's positions go (here 3 x max_len tokens)
    model = tiny_model(local)
    cache = init_cache(local, 1, 16)
    tokens = np.random.default_rng(1).integers(0, local.vocab_size, (1, 48)).astype(np.int32)
    for o in range(0, 48, 8):
        logits, cache = forward(model, tokens[:, o : o + 8], cache=cache)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(forward(model, tokens)[0])[:, 40:], atol=1e-5)


def test_rollback_within_the_lookahead_is_exact_and_beyond_it_refused():
    config = _local("gqa", 3)
    model = tiny_model(config)
    r = np.random.default_rng(2)
    prompt, drafts = r.integers(0, 61, (2, 9)).astype(np.int32), r.integers(0, 61, (2, 4)).astype(np.int32)
    _, cache = forward(model, prompt, cache=init_cache(config, 2, 32, lookahead=4))
    _, cache = forward(model, drafts, cache=cache)
    cache = cache.rollback(np.array([10, 12]))  # rows keep 1 and 3 of the 4 drafts
    seg = (np.arange(4)[None] < np.array([[1], [3]])).astype(np.int32)
    _, ref = forward(model, prompt, cache=init_cache(config, 2, 32, lookahead=4))
    _, ref = forward(model, drafts, segment_ids=seg, cache=ref)
    more = r.integers(0, 61, (2, 1)).astype(np.int32)
    np.testing.assert_allclose(
        np.asarray(forward(model, more, cache=cache)[0]), np.asarray(forward(model, more, cache=ref)[0]), atol=1e-5
    )
    # without room for the drafts, the ring already overwrote keys the rolled-back rows need: refused
    _, small = forward(model, prompt, cache=init_cache(config, 2, 32))
    _, small = forward(model, drafts, cache=small)
    with pytest.raises(CacheError, match="lookahead"):
        small.rollback(np.array([10, 12]))


# ---- quantized caches ------------------------------------------------------------------------------------------


def test_int8_cache_stores_int8_with_scales_and_round_trips():
    config = tiny_config("gqa", "rope_full")
    cache = init_cache(config, 2, 16, "int8")
    arrays = cache.groups[0].arrays
    assert arrays["k"].dtype == np.int8 and arrays["k_scale"].shape == (2, 2, 16, 2)
    _, cache = forward(tiny_model(config), np.arange(1, 7, dtype=np.int32)[None].repeat(2, 0), cache=cache)
    arrays = cache.groups[0].arrays
    k = np.asarray(arrays["k"]).astype(np.int32)
    assert np.abs(k[:, :, :6]).max() == 127  # absmax scaling uses the full range
    assert np.all(k[:, :, 6:] == 0)


def test_an_all_zero_vector_quantizes_to_zero_not_nan():
    from causal_lm.model.kv_cache import quantize

    q, scale = quantize(np.zeros((2, 3, 4), np.float32), 127.0, np.int8)
    assert np.all(np.asarray(q) == 0) and np.all(np.asarray(scale) == 1.0)


@pytest.fixture(scope="module")
def trained_tiny(tmp_path_factory):
    """The tiny preset trained for 150 steps: quantization error is judged on a model with real structure."""
    from causal_lm import load_config, train_and_evaluate
    from causal_lm.train import load_for_inference

    workdir = str(tmp_path_factory.mktemp("trained_tiny"))
    config = load_config(
        "tiny",
        [
            "train.steps=150",
            "train.eval_every=150",
            "train.checkpoint_every=150",
            "train.progress=false",
            "train.sample_tokens=0",
        ],
    )
    train_and_evaluate(config, workdir)
    model, tokenizer, _ = load_for_inference(workdir)
    return model, tokenizer


# How far a quantized cache may move the logits is not a number to fit on one machine: the trained fixture's weights
# come from a training run whose float path differs between CPU generations (XLA picks other kernels with AVX-512),
# and its sensitivity to K/V errors with them (the max |logit difference| of a bfloat16 cache was 1.2e-2 on a Zen 3
# and 5.3e-2 on a Zen 4; over six seeds and step counts on one machine it ranged 5e-3 to 4.4e-2). Two checks that hold
# on any CPU instead:
#  1. Each stored value is within its format's rounding bound of the float32 value (layer 0, whose K/V depend only
#     on the tokens, so both caches quantize the same numbers): bfloat16 keeps 8 significant bits, so |error| <=
#     2^-8 |x| (round to nearest); int8 with a scale of absmax/127 per vector rounds to within half a step,
#     absmax/254; float8_e4m3fn (4 significant bits) after scaling the absmax to 448, 2^-4 |x|, or half its
#     subnormal step 2^-10 in scaled units near zero.
#  2. The logits drift no more than a calibration on the same model: the float32 cache with every stored value
#     moved by pseudo-random noise uniform within that same bound, written where quantization happens. Both
#     drifts scale with the model's sensitivity, so their ratio is a property of the rounding, not of the trained
#     weights: over six trained models (seeds 0-3, 150/300 steps, two learning rates) quantized / noise was
#     0.5-1.0 (bfloat16), 0.5-1.8 (int8), 0.3-1.2 (float8_e4m3fn). Rounding errors are within the noise's bound by
#     (1), so only their placement can differ; 4x covers that with 2x over the largest ratio seen.
# Casting without scales (the bug check 1 exists for) moves int8 values by up to half their magnitude.
QUANT_FORMATS = ("bfloat16", "int8", "float8_e4m3fn")
NOISE_RATIO_BOUND = 4.0
PROMPTS_TEXT = ("The function ", "import os\nimport ")


def _half_step(x, dtype):
    """The largest rounding error `dtype` storage can make on each element of x [..., E] (scaled formats: one
    absmax scale per vector along the last axis), as derived above."""
    xp = jnp if isinstance(x, jax.Array) else np
    x = x.astype(xp.float32)
    amax = xp.max(xp.abs(x), axis=-1, keepdims=True)
    if dtype == "bfloat16":
        return xp.abs(x) * 2.0**-8
    if dtype == "int8":
        return xp.broadcast_to(amax / 254, x.shape)
    return xp.maximum(xp.abs(x) * 2.0**-4, amax / 448 * 2.0**-10)


def _pseudo_uniform(x):
    """A deterministic value in [-1, 1) per element, hashed from its float32 bits (no key inside the jitted step)."""
    b = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    h = ((b * jnp.uint32(2654435761)) ^ (b >> 13)) * jnp.uint32(2246822519)
    return (h >> 8).astype(jnp.float32) / float(1 << 23) - 1.0


def _cached_logits(model, prompt, tokens, dtype, cache=None):
    """(logits [len(tokens), V] at each new token, the final cache): the prompt prefilled and `tokens` fed one by
    one through a cache stored as `dtype` (teacher forcing: every storage type sees the same tokens)."""
    if cache is None:
        cache = init_cache(model.config, 1, len(prompt) + len(tokens), dtype)
    logits, cache = forward(model, np.asarray([prompt], np.int32), cache=cache)
    out = [np.asarray(logits)[0, -1]]
    for t in tokens[:-1]:
        logits, cache = forward(model, np.asarray([[t]], np.int32), cache=cache)
        out.append(np.asarray(logits)[0, -1])
    return np.stack(out), cache


def _noisy_logits(model, prompt, tokens, dtype):
    """Logits through a float32 cache whose every written value moves by noise within `dtype`'s rounding bound.
    The cache is float32 storage under a storage name of its own, registered as scaled so that its writes go
    through `quantize` (patched, for this call only, to add the noise); its own name gives it its own jitted
    programs, so no other storage type ever runs a program traced with the patch."""
    from causal_lm.model import kv_cache, transformer

    name = f"float32-noise-like-{dtype}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(kv_cache.CACHE_DTYPES, name, 1.0)
        # float32 arrays under a storage name of their own: the cache-match check would rightly refuse them
        patch.setattr(transformer, "check_cache_matches", lambda config, cache: None)
        patch.setattr(
            kv_cache,
            "quantize",
            lambda x, limit, d: (x + _half_step(x, dtype) * _pseudo_uniform(x), jnp.ones(x.shape[:-1], jnp.float32)),
        )
        cache = init_cache(model.config, 1, len(prompt) + len(tokens), "float32")
        groups = tuple(
            dataclasses.replace(
                g,
                arrays={**g.arrays, **{k + "_scale": jnp.ones(a.shape[:-1], jnp.float32) for k, a in g.arrays.items()}},
            )
            for g in cache.groups
        )
        cache = dataclasses.replace(cache, groups=groups, storage=name)
        return _cached_logits(model, prompt, tokens, None, cache=cache)[0]


@pytest.fixture(scope="module")
def teacher_forced(trained_tiny):
    """Per prompt: the prompt and the trained model's 32 greedy tokens after it, fed through every cache."""
    model, tokenizer = trained_tiny
    out = []
    for text in PROMPTS_TEXT:
        prompt = tokenizer.encode(text)
        out.append((prompt, generate(model, [prompt], max_new_tokens=32).tokens[0]))
    return out


def _layer0(cache, name):
    """Layer 0's stored entries [B, C, ...] as float32 (dequantized when the storage is scaled)."""
    return np.asarray(cache._read(cache.groups[0], name, 0), np.float32)


@pytest.mark.parametrize("dtype", QUANT_FORMATS)
def test_quantized_cache_values_are_within_their_formats_rounding_bound(trained_tiny, teacher_forced, dtype):
    model, _ = trained_tiny
    prompt, tokens = teacher_forced[0]
    _, exact = _cached_logits(model, prompt, tokens, "float32")
    _, low = _cached_logits(model, prompt, tokens, dtype)
    for name in exact.names:
        x, q = _layer0(exact, name), _layer0(low, name)
        # slack: the two caches' programs may round K/V themselves differently in float32's last bits
        bound = _half_step(x, dtype) + 1e-6 * np.max(np.abs(x), axis=-1, keepdims=True)
        err = np.abs(q - x)
        assert np.all(err <= bound), f"{name}: worst error / bound {np.max(err / bound):.2f}"
        assert err.max() > 0  # the storage really rounds


@pytest.mark.parametrize("dtype", QUANT_FORMATS)
def test_quantized_caches_decode_within_the_drift_of_their_rounding_noise(trained_tiny, teacher_forced, dtype):
    model, _ = trained_tiny
    worst, noise, agree = 0.0, 0.0, []
    for prompt, tokens in teacher_forced:
        f32 = _cached_logits(model, prompt, tokens, "float32")[0]
        low = _cached_logits(model, prompt, tokens, dtype)[0]
        worst = max(worst, float(np.abs(low - f32).max()))
        noise = max(noise, float(np.abs(_noisy_logits(model, prompt, tokens, dtype) - f32).max()))
        agree += list(low.argmax(-1) == f32.argmax(-1))
    print(f"{dtype}: max |logit diff| {worst:.2e} (noise at its bound {noise:.2e}), agreeing {np.mean(agree):.0%}")
    assert 0 < worst < NOISE_RATIO_BOUND * noise
    assert np.mean(agree) >= 0.9


def test_casting_without_scales_would_be_caught(trained_tiny, teacher_forced, monkeypatch):
    """Both checks can fail: int8 storage without scales (the plain cast this replaced) rounds values by up to half
    their magnitude, far past the format's bound, and drifts far past the noise calibration."""
    from causal_lm.model import kv_cache

    model, _ = trained_tiny
    prompt, tokens = teacher_forced[0]
    tokens = tokens[:7]  # a new length: fresh traces with the patches below
    f32, exact = _cached_logits(model, prompt, tokens, "float32")
    noise = np.abs(_noisy_logits(model, prompt, tokens, "int8") - f32).max()
    monkeypatch.setattr(kv_cache, "quantize", lambda x, limit, dtype: (x.astype(dtype), x[..., 0] * 0 + 1.0))
    broken, cache = _cached_logits(model, prompt, tokens, "int8")
    x = _layer0(exact, "k")
    assert np.any(np.abs(_layer0(cache, "k") - x) > _half_step(x, "int8"))
    assert np.abs(broken - f32).max() > NOISE_RATIO_BOUND * noise
