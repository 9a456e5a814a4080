"""Sliding-window attention, expressed through the one position mask: no key further back than the window gets
weight, in training, one-shot and chunked prefill and decode; cache == recompute; chunked == whole prefill."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from variants import tiny_mla_config

from causal_lm.config import ConfigError, ModelConfig
from causal_lm.decode import generate
from causal_lm.model import build_model, init_cache, make_mask
from causal_lm.model.functional import forward

W = 4  # window: a query at position p sees keys p-3 .. p


def _config(**kw):
    base = dict(
        vocab_size=61,
        d_model=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        mlp_dim=48,
        max_seq_len=96,
        init_std=0.2,
        sliding_window=W,
    )
    base.update(kw)
    return ModelConfig(**base)


# Each config is compiled a few times, so the grid is small but covers: one window shared by all layers (the
# mask built once), mixed local/global layers (the mask built per layer inside the scan), GQA/MQA, sink, MLA.
CONFIGS = {
    "all-local-mqa-sink": _config(num_kv_heads=1, attn_sink=True),
    "local-global": _config(layer_pattern="local,global"),
    "mla-local-global": tiny_mla_config(layer_pattern="local,global", sliding_window=W),
}
PROMPTS = [[5, 9, 1, 33, 7, 2, 40, 11, 3, 17, 8], [12, 4, 50]]  # ragged, the first longer than the window
NEW = 24


@functools.cache
def model(name):
    m = build_model(CONFIGS[name], seed=0)
    if CONFIGS[name].attn_sink:
        c = CONFIGS[name]
        m.blocks.attn.sink[...] = jnp.linspace(-1.0, 1.5, c.num_layers * c.num_heads).reshape(c.num_layers, -1)
    return m


@functools.partial(jax.jit, static_argnames="graphdef")
def _weights(state, tokens, segment_ids, *, graphdef):
    return nnx.merge(graphdef, state).attention_weights(tokens, segment_ids=segment_ids)


def attention_weights(m, tokens, segment_ids=None):
    graphdef, state = nnx.split(m)
    return np.asarray(_weights(state, tokens, segment_ids, graphdef=graphdef))  # [L, B, N, T, S]


@functools.cache
def generated(name, use_cache, chunk_size=None):
    return generate(
        model(name), PROMPTS, max_new_tokens=NEW, use_cache=use_cache, chunk_size=chunk_size, return_logits=True
    )


def test_make_mask_window():
    T = 9
    pos = jnp.arange(T)[None]
    valid = jnp.ones((1, T), bool)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    expected = (j <= i) & (i - j < 3)
    np.testing.assert_array_equal(np.asarray(make_mask(pos, pos, valid, window=3))[0], expected)
    # A traced per-layer window (as inside the layer scan): 0 means a global layer.
    traced = jax.jit(lambda w: make_mask(pos, pos, valid, window=w))
    np.testing.assert_array_equal(np.asarray(traced(jnp.int32(3)))[0], expected)
    np.testing.assert_array_equal(np.asarray(traced(jnp.int32(0)))[0], j <= i)
    # A decode step at position 6 over a cache of 9 slots, 7 of them written: sees slots 4, 5, 6.
    one = make_mask(jnp.array([[6]]), pos, pos < 7, window=3)
    np.testing.assert_array_equal(np.asarray(one)[0, 0], (np.arange(T) >= 4) & (np.arange(T) <= 6))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_no_weight_beyond_the_window(name):
    c = CONFIGS[name]
    T = 12
    tokens = np.random.default_rng(0).integers(0, c.vocab_size, (3, T)).astype(np.int32)
    # Row 0 one document, row 1 two packed documents (positions restart at 7), row 2 right padding.
    seg = np.array([[1] * T, [1] * 7 + [2] * 5, [1] * 10 + [0] * 2], np.int32)
    pos = np.array([np.arange(T), np.r_[np.arange(7), np.arange(5)], np.arange(T)])
    w = attention_weights(model(name), tokens, seg)  # [L, B, N, T, T]
    dist = pos[:, :, None] - pos[:, None, :]  # [B, T, T] query position - key position
    same_doc = seg[:, :, None] == seg[:, None, :]
    for layer, window in enumerate(c.layer_windows):
        lw = w[layer]  # [B, N, T, T]
        allowed = same_doc & (dist >= 0) & (dist < (window or T))
        assert np.all(lw[np.broadcast_to(~allowed[:, None], lw.shape)] == 0.0), f"layer {layer}: weight outside"
        if not window:  # a global layer does look further back than the window (so the test is not vacuous)
            assert lw[0, :, T - 1, 0].min() > 0
        if not c.attn_sink:  # every real query's weights still sum to 1 over the keys it may see
            np.testing.assert_allclose(lw.sum(-1)[0], 1.0, atol=1e-5)


def test_receptive_field_of_one_local_layer():
    """One local layer: logits at i depend on inputs i-W+1 .. i and on nothing else (gradient exactly 0)."""
    c = _config(num_layers=1)
    m = build_model(c, seed=1)
    graphdef, state = nnx.split(m)
    T = 10
    tokens = np.arange(1, T + 1, dtype=np.int32)[None]
    r = np.random.default_rng(2).standard_normal(c.vocab_size).astype(np.float32)

    @jax.jit
    def jac(state):
        mm = nnx.merge(graphdef, state)
        emb = mm.embed[...][tokens]
        f = lambda e: mm.forward(tokens, input_embeddings=e).logits[0] @ r  # noqa: E731
        return jnp.abs(jax.jacrev(f)(emb)[:, 0]).max(-1)  # [T(out), T(in)]

    g = np.asarray(jac(state))
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    inside = (j <= i) & (i - j < W)
    assert np.all(g[~inside] == 0.0)
    assert np.all(g[inside] > 0.0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cache_equals_recompute(name):
    cached, recomputed = generated(name, True), generated(name, False)
    assert cached.steps == NEW and max(len(p) for p in PROMPTS) + NEW > 3 * W  # decoding well past the window
    np.testing.assert_allclose(cached.logits, recomputed.logits, atol=1e-5, rtol=0)
    assert cached.tokens == recomputed.tokens


@pytest.mark.parametrize("name", ["local-global"])
def test_chunked_prefill_equals_whole(name):
    whole, chunked = generated(name, True), generated(name, True, chunk_size=3)
    np.testing.assert_allclose(chunked.logits, whole.logits, atol=1e-5, rtol=0)
    assert chunked.tokens == whole.tokens


@pytest.mark.parametrize("name", ["mla-local-global"])
def test_model_level_chunks_equal_one_pass(name):
    """Prefill through the cache in uneven chunks (5 then 7 tokens) == the training-mode pass over all 12."""
    c, m = CONFIGS[name], model(name)
    tokens = np.random.default_rng(3).integers(0, c.vocab_size, (2, 12)).astype(np.int32)
    full, _ = forward(m, tokens)
    cache = init_cache(c, 2, 16)
    pieces = []
    for a, b in ((0, 5), (5, 12)):
        logits, cache = forward(m, tokens[:, a:b], cache=cache)
        pieces.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(pieces, 1), np.asarray(full), atol=1e-5, rtol=0)


def test_window_wider_than_the_sequence_is_plain_causal():
    wide = build_model(_config(sliding_window=64), seed=0)
    plain = build_model(_config(sliding_window=0), seed=0)
    tokens = np.random.default_rng(4).integers(0, 61, (1, 20)).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(forward(wide, tokens)[0]), np.asarray(forward(plain, tokens)[0]))


def test_config_errors():
    with pytest.raises(ConfigError, match="sliding_window is 0"):
        ModelConfig(layer_pattern="local,global")
    with pytest.raises(ConfigError, match="no local layer"):
        ModelConfig(sliding_window=8, layer_pattern="global")
    with pytest.raises(ConfigError, match="layer_pattern entries"):
        ModelConfig(sliding_window=8, layer_pattern="local,full")
    with pytest.raises(ConfigError, match="causal"):
        ModelConfig(sliding_window=8, attention_mask="none")
