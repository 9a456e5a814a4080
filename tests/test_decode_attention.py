"""Decode attention's C++ products (causal_lm/model/decode_attention.py, csrc/decode_attention.cc): the score and
value products equal XLA's to float rounding (vector and scalar paths, several queries, grouped heads); a row's
result is the same bits whatever the batch; a decode step routes its attention through them; and decoding through
them equals recomputation for the attention variants whose decode takes this path."""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from variants import tiny_config, tiny_model

import causal_lm
from causal_lm.decode import generate
from causal_lm.model import decode_attention, kernels, native
from causal_lm.model.mask import AttentionMask


@pytest.fixture(scope="module", autouse=True)
def _kernels_built():
    if native.compiler() is None and not os.environ.get("CI"):
        pytest.skip("no C++ compiler here")
    if os.environ.get(native.ENV, "1") == "0":
        pytest.skip("CAUSAL_LM_NATIVE=0")
    assert decode_attention.usable(), f"the kernels did not build: {native.failure(decode_attention.NAME)}"


_scores = jax.jit(decode_attention.scores)
_values = jax.jit(decode_attention.values)
_attend = jax.jit(kernels.layer_attention_in_place, static_argnames=("scale", "softcap"))


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
    # the whole attention in one call per layer, over the cache's stacked buffers (not a slice of them)
    calls = re.findall(r"custom_call @(causal_lm_decode_attention\w*)\(", text)
    assert calls == ["causal_lm_decode_attention"] * model.config.num_layers, calls


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


# ---- the whole attention over a contiguous cache's stacked buffers (`kernels.layer_attention_in_place`) ---


WHOLE_CASES = [
    (1, 3, 3, 64, 150, ()),  # two chunks of 128 slots, the last one partial; Hv 72: value blocks of 64 (AVX-512) or
    # 32 (AVX2), then 8
    (2, 2, 2, 16, 64, ("sink",)),  # one whole chunk; Hv 24: 16 + 8 (AVX-512)
    (3, 1, 4, 12, 70, ("softcap",)),  # H 12: the scalar paths
    (3, 2, 1, 8, 200, ("sink", "softcap")),  # a KV head's 3 rows: two share the AVX-512 score instructions (across
    # queries t = 0, 1), the third takes the 8-lane form
]


def _whole_case(T, K, G, H, C, extras):
    """(q, k, v, layer, visible, keywords) of one case of the whole attention: 4 rows over layer 1 of 3."""
    rng = np.random.default_rng(2)
    L, B, layer = 3, 4, 1
    q = jnp.asarray(rng.standard_normal((B, T, K * G, H)) * 2, jnp.float32)
    k = jnp.asarray(rng.standard_normal((L, B, C, K, H)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((L, B, C, K, H + 8)), jnp.float32)
    # rows of different lengths, causal within the queries; row 3 sees nothing (zeros, or the sink alone)
    lengths = np.array([C - 5, 70, 9, 0])
    visible = np.arange(C)[None, None, :] < (lengths[:, None, None] - T + 1 + np.arange(T)[None, :, None])
    visible[3] = False
    visible = jnp.asarray(visible)
    kw = dict(
        scale=H**-0.5,
        sink=jnp.asarray(rng.standard_normal(K * G), jnp.float32) if "sink" in extras else None,
        softcap=5.0 if "softcap" in extras else None,
    )
    return q, k, v, layer, visible, kw


@pytest.mark.parametrize("T,K,G,H,C,extras", WHOLE_CASES)
def test_whole_attention_equals_xla_and_does_not_depend_on_the_batch(T, K, G, H, C, extras):
    q, k, v, layer, visible, kw = _whole_case(T, K, G, H, C, extras)
    got = np.asarray(_attend(q, k, v, layer, visible, **kw))
    want = np.asarray(kernels.reference_attention(q, k[layer], v[layer], AttentionMask(visible=visible), **kw)[0])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
    if "sink" not in extras:
        assert not got[3].any()  # a row that sees no slot gets zeros
    # row 1 alone (its own cache rows): the same bits as within the batch of 4
    alone = _attend(q[1:2], k[:, 1:2], v[:, 1:2], layer, visible[1:2], **kw)
    np.testing.assert_array_equal(np.asarray(alone)[0], got[1])


_AVX2_BUILD = """
import sys, numpy as np
sys.path.insert(0, sys.argv[1])
import test_decode_attention as t
from causal_lm.model import decode_attention, native
assert decode_attention.usable()
out = {}
for i, case in enumerate(t.WHOLE_CASES):
    q, k, v, layer, visible, kw = t._whole_case(*case)
    out[str(i)] = np.asarray(t._attend(q, k, v, layer, visible, **kw))
np.savez(sys.argv[2], **out)
print(native.library(decode_attention.NAME)._name)
"""


def _has_avx512() -> bool:
    try:
        return "avx512f" in open("/proc/cpuinfo").read().split()
    except OSError:
        return False


@pytest.mark.skipif(not _has_avx512(), reason="without AVX-512 there is one vector path")
def test_the_avx512_value_sums_give_the_avx2_builds_bits(tmp_path):
    """On a CPU with AVX-512 the whole attention sums the values 16 output elements a vector and scores two query rows
    of a KV head per instruction; each element's chain of fused multiply-adds is the one the AVX2 path runs, so the
    kernel built without AVX-512
    (`CAUSAL_LM_NATIVE_FLAGS=-mno-avx512f`, in a subprocess: another library file) gives the same bits."""
    env = dict(os.environ, **{native.FLAGS_ENV: "-mno-avx512f"})
    out = tmp_path / "avx2.npz"
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", _AVX2_BUILD, here, str(out)], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] != native.library(decode_attention.NAME)._name, "the subprocess loaded this build"
    avx2 = np.load(out)
    for i, case in enumerate(WHOLE_CASES):
        q, k, v, layer, visible, kw = _whole_case(*case)
        np.testing.assert_array_equal(
            np.asarray(_attend(q, k, v, layer, visible, **kw)), avx2[str(i)], err_msg=str(case)
        )


def test_whole_attention_reads_the_layer_it_is_given_and_has_a_gradient():
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((2, 1, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((3, 2, 70, 2, 8)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((3, 2, 70, 2, 8)), jnp.float32)
    visible = jnp.asarray(np.arange(70)[None, None, :] < np.array([66, 3])[:, None, None])
    sink = jnp.asarray(rng.standard_normal(4), jnp.float32)
    outs = [np.asarray(_attend(q, k, v, layer, visible, scale=0.3)) for layer in range(3)]
    assert not np.allclose(outs[0], outs[2])
    with pytest.raises(Exception, match="layer out of range"):
        np.asarray(decode_attention.attend(q, k, v, 3, visible, scale=0.3))

    def ours(q, k, v, sink):
        return jnp.sum(jnp.sin(kernels.layer_attention_in_place(q, k, v, 2, visible, scale=0.3, sink=sink)))

    def xla(q, k, v, sink):
        mask = AttentionMask(visible=visible)
        return jnp.sum(jnp.sin(kernels.reference_attention(q, k[2], v[2], mask, scale=0.3, sink=sink)[0]))

    for a, b in zip(
        jax.grad(ours, (0, 1, 2, 3))(q, k, v, sink), jax.grad(xla, (0, 1, 2, 3))(q, k, v, sink), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_few_queries_over_keys_outside_a_cache_use_the_products():
    """Outside a contiguous cache's in-place path (e.g. a ring's old slots joined to a chunk), a decode trace's few
    float32 queries still go to the C++ products; outside a decode trace (training, scoring) to XLA."""
    from causal_lm.model import matvec

    q, k = jnp.zeros((1, 2, 4, 8)), jnp.zeros((1, 5, 2, 8))
    mask = AttentionMask(visible=jnp.ones((1, 2, 5), bool))
    assert kernels.select_kernel(q, k, mask) is not kernels.native_attention
    with matvec.native_products():
        assert kernels.select_kernel(q, k, mask) is kernels.native_attention
