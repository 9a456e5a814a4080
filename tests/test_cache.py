"""KV cache, chunked prefill and on-device generation: outputs equal to full recomputation."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import example, given, settings
from hypothesis import strategies as st
from variants import VARIANT_IDS, VARIANTS, tiny_config, tiny_mla_config, tiny_model

import causal_lm
from causal_lm import CacheError, GenerateError, generate, init_cache
from causal_lm.decode.generate import bucket_length, compile_count
from causal_lm.decode.sampling import argmax_tokens, sample
from causal_lm.model import build_model
from causal_lm.model.functional import forward

NEW = 64
PROMPTS = [[3, 14, 15, 9, 2, 6, 5, 35, 8, 9, 7], [27, 18, 28, 1, 8]]  # ragged: 11 and 5 tokens


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _full_logits(state, tokens, *, graphdef):
    return nnx.merge(graphdef, state)(tokens)[0]


def teacher_forced(model, prompt, generated):
    """Logits of one full forward pass over prompt + generated, at the positions that predicted each new token."""
    seq = np.asarray([list(prompt) + list(generated)], np.int32)
    graphdef, state = nnx.split(model)
    logits = np.asarray(_full_logits(state, seq, graphdef=graphdef))[0]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)]


def stored(cache, name="k"):
    """A single-layout cache's stored array `name`, [L, B, S, ...]."""
    (group,) = cache.groups
    return group.arrays[name]


def assert_cache_equals_recompute(model, prompts=PROMPTS, new=NEW, **kw):
    """Cached generation vs recomputation of the whole sequence: every step's logits (atol 1.5e-5) and the
    greedy tokens. The recompute reference is a full forward pass over the final sequence, which by prefix
    equivalence (tests/test_model.py) is what recomputing at every step produces. On a CPU the cached steps run
    the C++ decode products (model/matvec.py) and the reference XLA's matmul: two summation orders, ~1e-5 apart
    at most on these logits."""
    res = generate(model, prompts, max_new_tokens=new, return_logits=True, **kw)
    for r, prompt in enumerate(prompts):
        toks = res.tokens[r]
        assert len(toks) == new
        ref = teacher_forced(model, prompt, toks)
        np.testing.assert_allclose(res.logits[r], ref, atol=1.5e-5, rtol=0)
        assert toks == ref.argmax(-1).tolist(), "greedy tokens differ from full recomputation"
    return res


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_cache_equals_recompute_every_variant(variant):
    assert_cache_equals_recompute(tiny_model(tiny_config(*variant)))


@pytest.mark.parametrize(
    "variant",
    [
        ("mha", "rope_full", False, False),
        ("gqa", "rope_partial", True, True),
        ("mqa", "learned", True, False),
        ("gqa", "nope", False, True),
    ],
    ids=["mha-rope", "gqa-partial-gate-sink", "mqa-learned-gate", "gqa-nope-sink"],
)
def test_generate_cached_equals_generate_recompute(variant):
    """The two generate paths side by side: logits at every step and greedy tokens."""
    model = tiny_model(tiny_config(*variant))
    a = generate(model, PROMPTS, max_new_tokens=NEW, return_logits=True)
    b = generate(model, PROMPTS, max_new_tokens=NEW, use_cache=False, return_logits=True)
    assert a.tokens == b.tokens
    np.testing.assert_allclose(a.logits, b.logits, atol=1e-5, rtol=0)
    assert b.kv_computed > a.kv_computed


def test_a_broken_cache_is_caught(monkeypatch):
    """The equivalence check can fail: a cache that writes one slot too far is detected."""
    from causal_lm.model import kv_cache

    real = kv_cache.write_layer_slots
    monkeypatch.setattr(
        kv_cache, "write_layer_slots", lambda buf, layer, new, slots, *a: real(buf, layer, new, slots + 1, *a)
    )
    model = build_model(tiny_config("gqa", "rope_full", vocab_size=59), seed=0)  # fresh config: fresh trace
    with pytest.raises(AssertionError):
        assert_cache_equals_recompute(model, new=8)


# ---- prefill ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 5])
def test_chunked_prefill_equals_whole(chunk):
    """Chunks at offsets o see cached keys 0..o-1 plus their own tokens causally: same logits, same cache."""
    config = tiny_config("gqa", "rope_partial", True, True)
    model = tiny_model(config)
    prompt = np.random.default_rng(0).integers(0, config.vocab_size, (2, 12)).astype(np.int32)
    whole_logits, whole = forward(model, prompt, cache=init_cache(config, 2, 32))
    cache, pieces = init_cache(config, 2, 32), []
    for o in range(0, 12, chunk):  # 12 is not a multiple of 5 or 7: the last chunk is short
        logits, cache = forward(model, prompt[:, o : o + chunk], cache=cache)
        pieces.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(pieces, 1), np.asarray(whole_logits), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [12, 12])
    np.testing.assert_allclose(np.asarray(stored(cache))[:, :, :12], np.asarray(stored(whole))[:, :, :12], atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(stored(cache, "v"))[:, :, :12], np.asarray(stored(whole, "v"))[:, :, :12], atol=1e-5
    )


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_generate_with_chunked_prefill(chunk):
    model = tiny_model(tiny_config("gqa", "rope_partial", True, True))
    whole = generate(model, PROMPTS, max_new_tokens=16, return_logits=True)
    chunked = generate(model, PROMPTS, max_new_tokens=16, return_logits=True, chunk_size=chunk)
    assert chunked.tokens == whole.tokens
    np.testing.assert_allclose(chunked.logits, whole.logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("prompt_len, chunk", [(8, 3), (5, 16), (1, 1), (8, 8)])
def test_generate_with_chunked_prefill_at_the_bucket_edges(prompt_len, chunk):
    """The padded prompt is rounded up to whole chunks: a bucket (8) that is not a multiple of the chunk (8/3), a
    chunk longer than the bucket (5/16), the smallest prompt and chunk (1/1) and a chunk of exactly the bucket
    (8/8). Rounding down instead would leave no room for the prompt (8/3: 6 slots, 5/16: none)."""
    model = tiny_model(tiny_config("gqa", "rope_partial", True, True))
    prompt = [PROMPTS[0][:prompt_len]]
    whole = generate(model, prompt, max_new_tokens=16, return_logits=True)
    chunked = generate(model, prompt, max_new_tokens=16, return_logits=True, chunk_size=chunk)
    assert chunked.tokens == whole.tokens
    np.testing.assert_allclose(chunked.logits, whole.logits, atol=1e-5, rtol=0)


def test_padding_past_a_full_row_is_dropped_not_written_to_its_last_slot():
    """Global layers write padding at slots past the end, which the scatter must drop: a row holding max_len
    tokens that gets only padding in a call while another row gets real tokens keeps every stored entry, and the
    other row's logits are those of its tokens alone. Clipping those writes instead would overwrite the full row's
    last slot with the padding's K/V."""
    config = tiny_config("gqa", "rope_full")
    model = tiny_model(config)
    tokens = np.random.default_rng(3).integers(0, config.vocab_size, (2, 8)).astype(np.int32)
    seg = np.array([[1] * 8, [1] * 4 + [0] * 4], np.int32)
    _, cache = forward(model, tokens, segment_ids=seg, cache=init_cache(config, 2, 8))  # row 0: full
    before = {name: np.asarray(stored(cache, name)) for name in ("k", "v")}
    more = np.array([[17, 23], [29, 31]], np.int32)
    logits, cache = forward(model, more, segment_ids=np.array([[0, 0], [1, 1]], np.int32), cache=cache)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [8, 6])
    for name in ("k", "v"):
        np.testing.assert_array_equal(np.asarray(stored(cache, name))[:, 0], before[name][:, 0])
    alone = np.asarray(model(np.concatenate([tokens[1:, :4], more[1:]], axis=1))[0])
    np.testing.assert_allclose(np.asarray(logits)[1], alone[0, 4:], atol=1e-5, rtol=0)


def test_ragged_batch_equals_each_prompt_alone():
    model = tiny_model(tiny_config("gqa", "rope_full", True, True))
    prompts = [[5], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41, 42], [7, 7, 7, 7, 7, 7]]
    together = generate(model, prompts, max_new_tokens=24, return_logits=True)
    for r, p in enumerate(prompts):
        alone = generate(model, [p], max_new_tokens=24, return_logits=True)
        assert together.tokens[r] == alone.tokens[0]
        np.testing.assert_allclose(together.logits[r], alone.logits[0], atol=1e-5, rtol=0)


def test_ragged_prefill_lengths_are_per_row():
    config = tiny_config()
    model = tiny_model(config)
    tokens = np.arange(8, dtype=np.int32).reshape(2, 4)
    seg = np.array([[1, 1, 1, 1], [1, 1, 0, 0]], np.int32)
    _, cache = forward(model, tokens, segment_ids=seg, cache=init_cache(config, 2, 16))
    np.testing.assert_array_equal(np.asarray(cache.lengths), [4, 2])
    # The next token of row 1 is written at slot 2, right after its own prompt.
    _, cache2 = forward(model, np.array([[9], [9]], np.int32), cache=cache)
    np.testing.assert_array_equal(np.asarray(cache2.lengths), [5, 3])
    # Row 1's new token landed at slot 2, right after its own prompt: its K equals that of [4, 5, 9] run alone.
    _, alone = forward(model, np.array([[4, 5, 9]], np.int32), cache=init_cache(config, 1, 16))
    np.testing.assert_allclose(np.asarray(stored(cache2))[:, 1, :3], np.asarray(stored(alone))[:, 0, :3], atol=1e-6)


def test_the_seeds_kv_counts():
    """Prompt of 2 tokens, 3 new tokens: recompute computes 2+3+4 = 9 K/V vectors, the cache 2+1+1 = 4."""
    model = tiny_model(tiny_config())
    assert generate(model, [[1, 2]], max_new_tokens=3, use_cache=False).kv_computed == 9
    assert generate(model, [[1, 2]], max_new_tokens=3).kv_computed == 4


# ---- property test ----------------------------------------------------------------------------------------


# The same examples on every run (the profile in conftest.py), the boundaries of chunked prefill pinned: a prompt
# whose bucket (8) is not a multiple of the chunk (7/3, the example that found a buffer rounded down), a chunk past
# the bucket (5/9), the smallest prompt and chunk (1/1) and a chunk of exactly the bucket (8/8).
@settings(max_examples=10)
@example(heads=(2, 1), pos="rope_full", gate=False, sink=False, prompt_len=7, chunk=3, seed=0)
@example(heads=(4, 2), pos="rope_partial", gate=True, sink=True, prompt_len=5, chunk=9, seed=1)
@example(heads=(2, 2), pos="learned", gate=False, sink=True, prompt_len=1, chunk=1, seed=2)
@example(heads=(4, 1), pos="nope", gate=True, sink=False, prompt_len=8, chunk=8, seed=3)
@given(
    heads=st.sampled_from([(2, 1), (2, 2), (4, 2), (4, 1)]),
    pos=st.sampled_from(["rope_full", "nope", "learned", "rope_partial"]),
    gate=st.booleans(),
    sink=st.booleans(),
    prompt_len=st.integers(1, 9),
    chunk=st.integers(1, 9),
    seed=st.integers(0, 3),
)
def test_property_cache_equals_recompute(heads, pos, gate, sink, prompt_len, chunk, seed):
    n, kv = heads
    config = causal_lm.ModelConfig(
        vocab_size=37,
        d_model=16,
        num_layers=1,
        num_heads=n,
        num_kv_heads=kv,
        mlp_dim=24,
        max_seq_len=48,
        init_std=0.3,
        attn_output_gate=gate,
        attn_sink=sink,
        position={"rope_full": "rope", "rope_partial": "rope"}.get(pos, pos) if pos != "nope" else "none",
        rope_fraction=0.5 if pos == "rope_partial" else 1.0,
    )
    model = build_model(config, seed=seed)
    prompt = np.random.default_rng(seed).integers(0, 37, prompt_len).tolist()
    assert_cache_equals_recompute(model, [prompt], new=12, chunk_size=chunk)


# ---- bfloat16 cache ----------------------------------------------------------------------------------------


def test_bfloat16_cache_tracks_float32():
    """A bf16 cache (f32 compute) on a fixed model: greedy tokens identical for 32 steps, logits close.
    The model's weights come from a fixed seed, not from training, so they are the same on every CPU to float32's
    last bits and the drift is a property of the code, not of the machine (unlike a trained fixture's; see
    test_kv_memory.py): ~1e-2 on logits of magnitude ~3-5, bf16 keeping 8 significant bits (2^-8 relative per
    stored value). The bound leaves ~5x for summation-order differences between CPUs' kernels."""
    model = tiny_model(tiny_config("gqa", "rope_full"))
    f32 = generate(model, PROMPTS, max_new_tokens=32, return_logits=True)
    bf16 = generate(model, PROMPTS, max_new_tokens=32, return_logits=True, cache_dtype="bfloat16")
    assert bf16.tokens == f32.tokens
    diff = np.abs(bf16.logits - f32.logits).max()
    assert 0 < diff < 5e-2, diff  # nonzero: the cache really is stored in bfloat16
    cache = init_cache(model.config, 1, 8, "bfloat16")
    assert (
        stored(cache).dtype == jnp.bfloat16
        and cache.bytes_per_token * 2 == init_cache(model.config, 1, 8).bytes_per_token
    )


# ---- cache as data ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv, heads", [("mha", 4), ("gqa", 2), ("mqa", 1)])
def test_cache_is_stored_at_the_kv_head_count(kv, heads):
    config = tiny_config(kv)
    cache = init_cache(config, batch_size=3, max_len=20)
    L, H = config.num_layers, config.head_dim
    assert stored(cache).shape == stored(cache, "v").shape == (L, 3, 20, heads, H)
    assert cache.bytes_per_token == 2 * L * heads * H * 4 == config.kv_bytes_per_token()
    # K and V, the slots' positions [B, S] and the lengths [B], all int32 or float32
    assert cache.total_bytes == 2 * L * 3 * 20 * heads * H * 4 + 3 * 20 * 4 + 3 * 4
    assert cache.lengths.dtype == jnp.int32 and np.all(np.asarray(cache.lengths) == 0)


def test_cache_is_donated_under_jit():
    config = tiny_config()
    model = tiny_model(config)
    cache = init_cache(config, 1, 16)
    _, new = forward(model, np.array([[1, 2]], np.int32), cache=cache)
    assert stored(cache).is_deleted(), "the input cache buffer should be donated to the jitted call"
    assert not stored(new).is_deleted()


# ---- errors before anything runs --------------------------------------------------------------------------


def test_capacity_overflow_is_an_error():
    config = tiny_config()
    model = tiny_model(config)
    cache = init_cache(config, 1, 8)
    _, cache = forward(model, np.ones((1, 6), np.int32), cache=cache)
    with pytest.raises(CacheError, match="overflow: row 0 holds 6 tokens and 3 more do not fit in max_len=8"):
        forward(model, np.ones((1, 3), np.int32), cache=cache)
    assert np.asarray(cache.lengths)[0] == 6 and not stored(cache).is_deleted(), (
        "the failed call must not consume the cache"
    )
    with pytest.raises(GenerateError, match="exceeds model.max_seq_len=96"):
        generate(model, [[1] * 40], max_new_tokens=57)


def test_generate_rejects_bad_prompts_and_arguments():
    model = tiny_model(tiny_config())
    for prompts, match in [
        ([[1, 2], []], "prompt 1 is empty"),
        ([[1, 61]], "token id 61 outside"),
        ([[-3]], "token id -3"),
        ([], "non-empty list"),
        ([1, 2], "list of token-id lists"),
    ]:
        with pytest.raises(GenerateError, match=match):
            generate(model, prompts, max_new_tokens=4)
    for kw, match in [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=2, top_k=0), "top_k"),
        (dict(max_new_tokens=2, top_p=1.5), "top_p"),
        (dict(max_new_tokens=2, temperature=-1), "temperature"),
        (dict(max_new_tokens=2, chunk_size=0), "chunk_size"),
    ]:
        with pytest.raises(GenerateError, match=match):
            generate(model, [[1]], **kw)


def test_non_causal_model_refuses_a_cache_but_recomputes():
    model = tiny_model(tiny_config(attention_mask="none"))
    with pytest.raises(CacheError, match="needs attention_mask='causal'.*use_cache=False"):
        generate(model, [[1, 2]], max_new_tokens=3)
    with pytest.raises(CacheError, match="needs attention_mask='causal'"):
        init_cache(model.config, 1, 8)
    res = generate(model, [[1, 2]], max_new_tokens=3, use_cache=False)
    assert len(res.tokens[0]) == 3


# ---- sampling ----------------------------------------------------------------------------------------------

_sample = jax.jit(sample)


def _draws(logits, n=400, **kw):
    logits = jnp.asarray(np.tile(np.asarray(logits, np.float32), (n, 1)))
    args = dict(temperature=1.0, top_k=0, top_p=1.0)
    args.update(kw)
    return np.asarray(
        _sample(
            logits,
            jax.random.key(0),
            jnp.float32(args["temperature"]),
            jnp.int32(args["top_k"]),
            jnp.float32(args["top_p"]),
        )
    )


def test_top_k_keeps_exactly_the_k_most_likely():
    logits = np.log(np.array([0.05, 0.3, 0.1, 0.25, 0.2, 0.1]))
    got = set(_draws(logits, top_k=3).tolist())
    assert got == {1, 3, 4}
    assert set(_draws(logits, top_k=1).tolist()) == {1}


def test_top_p_keeps_the_token_that_crosses_the_threshold():
    logits = np.log(np.array([0.5, 0.3, 0.2]))
    assert set(_draws(logits, top_p=0.6).tolist()) == {0, 1}  # 0.5 < 0.6: token 1 crosses and stays
    assert set(_draws(logits, top_p=0.5).tolist()) == {0}  # token 0 alone reaches 0.5
    assert set(_draws(logits, top_p=0.81).tolist()) == {0, 1, 2}
    assert set(_draws(logits, top_p=0.9, top_k=2).tolist()) == {0, 1}


def test_greedy_and_temperature():
    logits = np.log(np.array([0.2, 0.5, 0.3]))
    assert set(_draws(logits, temperature=0.0).tolist()) == {1}
    hot = _draws(logits, n=4000)
    # 4,000 draws: each frequency's standard error is at most sqrt(0.25 / 4000) = 0.008, so 0.03 is ~4 of them
    # (and the draws are seeded: the same on every run)
    np.testing.assert_allclose(np.bincount(hot, minlength=3) / 4000, [0.2, 0.5, 0.3], atol=0.03)


def test_greedy_tokens_are_jnp_argmax_ties_nans_and_infinities_included():
    """`argmax_tokens` (greedy decoding's two-reduction argmax) returns what jnp.argmax returns on every row: the
    first of tied maxima, the first NaN of a row holding one, 0 for a row of -inf, a lone +inf."""
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((12, 50)).astype(np.float32)
    rows[0, [3, 17, 40]] = 9.0  # ties: the first wins
    rows[1, [5, 30]] = np.nan  # NaN counts as the largest, the first one
    rows[2, 7] = np.nan
    rows[2, 9] = np.inf
    rows[3] = -np.inf
    rows[4, 44] = np.inf
    rows[5] = 0.0
    rows[5, [10, 20]] = -0.0  # -0.0 == 0.0: index 0 still wins
    rows[6] = np.round(rows[6])  # many ties among small integers
    f = jax.jit(argmax_tokens)
    np.testing.assert_array_equal(f(rows), np.asarray(jnp.argmax(rows, axis=-1)))
    assert f(rows).dtype == jnp.int32
    three = rows.reshape(3, 4, 50)  # any leading shape
    np.testing.assert_array_equal(f(three), np.asarray(jnp.argmax(three, axis=-1)))


def test_sampling_is_seeded_and_the_same_with_and_without_cache():
    model = tiny_model(tiny_config("gqa", "rope_full", True, True))
    kw = dict(max_new_tokens=20, temperature=1.0, top_k=20, top_p=0.95)
    a = generate(model, PROMPTS, seed=7, **kw)
    b = generate(model, PROMPTS, seed=7, use_cache=False, **kw)
    c = generate(model, PROMPTS, seed=8, **kw)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


def test_rows_stop_independently_at_a_stop_token():
    model = tiny_model(tiny_config("gqa", "rope_full", True, True))
    free = generate(model, PROMPTS, max_new_tokens=20)
    stop = free.tokens[0][4]  # row 0 produces this token at step 4
    first = free.tokens[0].index(stop)
    res = generate(model, PROMPTS, max_new_tokens=20, stop_tokens=[stop])
    assert res.tokens[0] == free.tokens[0][: first + 1]
    row1_stop = free.tokens[1].index(stop) + 1 if stop in free.tokens[1] else 20
    assert res.tokens[1] == free.tokens[1][:row1_stop]


def test_compile_count_counts_new_buckets_not_new_lengths():
    """A new prompt length in the same bucket reuses the compiled program; a new bucket compiles one more.
    (Breaking the bucketing, e.g. bucket_length returning n itself, fails the first assertion.)"""
    model = tiny_model(tiny_config())
    generate(model, [[1, 2, 3]], max_new_tokens=5)
    before = compile_count()
    generate(model, [[1, 2, 3, 4, 5, 6]], max_new_tokens=5)
    generate(model, [[9] * 8], max_new_tokens=5)
    assert compile_count() == before
    generate(model, [[9] * 9], max_new_tokens=5)  # bucket 16
    assert compile_count() == before + 1
    assert bucket_length(9) == 16 and bucket_length(1) == 8
    # max_new_tokens is bucketed too (powers of two from 16): 5 and 12 share a program, 17 does not
    res = generate(model, [[1, 2, 3]], max_new_tokens=12)
    assert compile_count() == before + 1 and len(res.tokens[0]) == 12
    generate(model, [[1, 2, 3]], max_new_tokens=17)
    assert compile_count() == before + 2


def test_concrete_tokens_with_a_cache_built_inside_jit():
    """Host validation steps aside when the cache is traced (it cannot read lengths), instead of crashing."""
    config = tiny_config()
    graphdef, state = nnx.split(tiny_model(config))
    tokens = np.array([[1, 2, 3]], np.int32)

    @jax.jit
    def run(state):
        return nnx.merge(graphdef, state)(tokens, cache=init_cache(config, 1, 8))[0]

    np.testing.assert_allclose(np.asarray(run(state)), np.asarray(forward(tiny_model(config), tokens)[0]), atol=1e-5)


# ---- rollback ------------------------------------------------------------------------------------------------


def _decode(model, cache, tokens):
    """Feed tokens [B, n] one column at a time through the cache; logits [B, n, V]."""
    out = []
    for t in range(tokens.shape[1]):
        logits, cache = forward(model, tokens[:, t : t + 1], cache=cache)
        out.append(np.asarray(logits))
    return np.concatenate(out, 1), cache


def _assert_same_cache(a, b):
    np.testing.assert_array_equal(np.asarray(a.lengths), np.asarray(b.lengths))
    for ga, gb in zip(a.groups, b.groups, strict=True):
        pa, pb = np.asarray(ga.positions), np.asarray(gb.positions)
        np.testing.assert_array_equal(pa, pb)
        for name in ga.arrays:
            xa, xb = np.asarray(ga.arrays[name]), np.asarray(gb.arrays[name])
            filled = pa >= 0  # [B, S]: slots that hold a token (empty ones may keep stale bytes)
            np.testing.assert_allclose(xa[:, filled], xb[:, filled], atol=1e-6, err_msg=name)


@pytest.mark.parametrize(
    "config",
    [
        tiny_config("gqa", "rope_full", True, True),
        tiny_config("mqa", "learned"),
        tiny_mla_config(),
    ],
    ids=["gqa-gate-sink", "mqa-learned", "mla-absorbed"],
)
def test_rollback_then_decode_equals_never_having_seen_the_tokens(config):
    """Write 4 tokens per row, roll the rows back by different counts, decode other tokens: the cache and the
    logits equal those of a cache that only ever saw the kept tokens."""
    model = tiny_model(config)
    r = np.random.default_rng(4)
    prompt = r.integers(0, config.vocab_size, (2, 5)).astype(np.int32)
    drafts = r.integers(0, config.vocab_size, (2, 4)).astype(np.int32)
    keep = np.array([1, 3])  # row 0 keeps 1 draft, row 1 keeps 3
    _, cache = forward(model, prompt, cache=init_cache(config, 2, 16))
    _, cache = forward(model, drafts, cache=cache)
    cache = cache.rollback(5 + keep)
    np.testing.assert_array_equal(np.asarray(cache.lengths), 5 + keep)
    # the reference: each row fed only its kept drafts (ragged: right padding marks the rest invalid)
    seg = (np.arange(4)[None, :] < keep[:, None]).astype(np.int32)
    _, ref = forward(model, prompt, cache=init_cache(config, 2, 16))
    _, ref = forward(model, drafts, segment_ids=seg, cache=ref)
    _assert_same_cache(cache, ref)
    more = r.integers(0, config.vocab_size, (2, 3)).astype(np.int32)
    got, cache = _decode(model, cache, more)
    want, ref = _decode(model, ref, more)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    _assert_same_cache(cache, ref)


def test_rollback_never_lengthens_a_row():
    """A length beyond the row's current one is refused (it used to be clamped silently)."""
    config = tiny_config()
    _, cache = forward(tiny_model(config), np.ones((1, 3), np.int32), cache=init_cache(config, 1, 8))
    with pytest.raises(CacheError, match="cannot roll row 0 back to length 7"):
        cache.rollback(np.array([7]))
    assert np.asarray(cache.lengths).tolist() == [3]


def test_a_rollback_that_forgets_the_positions_is_caught(monkeypatch):
    """The rollback test can fail: a rollback that shortens the lengths but leaves the dropped tokens' slots marked
    as filled lets later queries see the rejected tokens."""
    from causal_lm.model.kv_cache import KVCache

    def lengths_only(self, lengths):
        return dataclasses.replace(self, lengths=jnp.minimum(jnp.asarray(lengths, jnp.int32), self.lengths))

    monkeypatch.setattr(KVCache, "rollback", lengths_only)
    with pytest.raises(AssertionError):
        test_rollback_then_decode_equals_never_having_seen_the_tokens(tiny_config("mqa", "learned"))
