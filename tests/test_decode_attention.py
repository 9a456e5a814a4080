"""Decode attention's C++ products (causal_lm/model/decode_attention.py, csrc/decode_attention.cc): the score and
value products equal XLA's to float rounding (vector and scalar paths, several queries, grouped heads); a row's
result is the same bits whatever the batch; a decode step routes its attention through them; and decoding through
them equals recomputation for the attention variants whose decode takes this path."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from variants import tiny_config, tiny_model

import causal_lm
from causal_lm.decode import generate
from causal_lm.model import decode_attention, native


@pytest.fixture(scope="module", autouse=True)
def _kernels_built():
    if native.compiler() is None and not os.environ.get("CI"):
        pytest.skip("no C++ compiler here")
    if os.environ.get(native.ENV, "1") == "0":
        pytest.skip("CAUSAL_LM_NATIVE=0")
    assert decode_attention.usable(), f"the kernels did not build: {native.failure(decode_attention.NAME)}"


_scores = jax.jit(decode_attention.scores)
_values = jax.jit(decode_attention.values)


@pytest.mark.parametrize("T,K,G,H", [(1, 3, 3, 64), (3, 2, 2, 16), (2, 1, 4, 12)])  # H 12: the scalar path
def test_products_equal_xla_and_do_not_depend_on_the_batch(T, K, G, H):
    rng = np.random.default_rng(0)
    B, S = 4, 37
    q = rng.standard_normal((B, T, K * G, H)).astype(np.float32)
    k = rng.standard_normal((B, S, K, H)).astype(np.float32)
    v = rng.standard_normal((B, S, K, H + 8)).astype(np.float32)
    w = rng.uniform(0, 1, (B, K, G, T, S)).astype(np.float32)
    w[:, :, :, :, 30:] = 0.0  # zero weights (masked slots) add nothing
    want_s = np.einsum("btkgh,bskh->bkgts", q.reshape(B, T, K, G, H).astype(np.float64), k)
    want_v = np.einsum("bkgts,bskh->btkgh", w.astype(np.float64), v).reshape(B, T, K * G, H + 8)
    s, o = np.asarray(_scores(q, k)), np.asarray(_values(w, v))
    np.testing.assert_allclose(s, want_s, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(o, want_v, rtol=1e-5, atol=1e-5)
    # row 2 alone: the same bits as within the batch of 4
    np.testing.assert_array_equal(np.asarray(_scores(q[2:3], k[2:3]))[0], s[2])
    np.testing.assert_array_equal(np.asarray(_values(w[2:3], v[2:3]))[0], o[2])


def test_gradients_flow_through_the_products():
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((2, 1, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 5, 2, 8)), jnp.float32)

    def ours(q, k):
        return jnp.sum(jnp.sin(decode_attention.scores(q, k)))

    def xla(q, k):
        return jnp.sum(jnp.sin(jnp.einsum("btkgh,bskh->bkgts", q.reshape(2, 1, 2, 2, 8), k)))

    for a, b in zip(jax.grad(ours, (0, 1))(q, k), jax.grad(xla, (0, 1))(q, k), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_decode_step_routes_attention_through_the_kernels():
    model = tiny_model(tiny_config("gqa"))
    graphdef, state = nnx.split(model)
    cache = causal_lm.init_cache(model.config, batch_size=1, max_len=8)

    def step(state, layers, tokens, cache):
        return nnx.merge(graphdef, state)(tokens, cache=cache, layers=layers)[0]

    text = jax.jit(step).lower(state, model.split_layers(), jnp.zeros((1, 1), jnp.int32), cache).as_text()
    assert set(re.findall(r"causal_lm_decode_attention_\w+", text)) == {
        "causal_lm_decode_attention_scores",
        "causal_lm_decode_attention_values",
    }


VARIANTS = {
    "gqa": tiny_config("gqa"),
    "mqa": tiny_config("mqa"),
    "windows-sink": tiny_config("gqa", sink=True, sliding_window=4, layer_pattern="local,global"),
    "softcap": tiny_config("mha", attn_softcap=20.0),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_decoding_through_the_kernels_equals_recompute(name):
    model = tiny_model(VARIANTS[name])
    prompts = [[3, 1, 4, 1, 5, 9, 2], [6, 5]]
    cached = generate(model, prompts, max_new_tokens=8, return_logits=True)
    recomputed = generate(model, prompts, max_new_tokens=8, use_cache=False, return_logits=True)
    assert cached.tokens == recomputed.tokens
    np.testing.assert_allclose(cached.logits, recomputed.logits, rtol=0, atol=1e-5)
