"""Multi-head latent attention: no leak from the future, prefix equivalence, cache == recompute for both decode
paths (expanded and absorbed), absorbed == expanded, and a cache that holds only latent + rope key."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from causal_lm.config import ModelConfig
from causal_lm.decode import generate
from causal_lm.model import build_model, init_cache

T = 10  # probe length
NEW = 32  # generated tokens per prompt
PROMPTS = [[5, 9, 1, 33, 7, 2, 40, 11, 3], [12, 4, 50]]  # ragged


def _config(**kw):
    base = dict(
        vocab_size=61,
        d_model=32,
        num_layers=2,
        num_heads=4,
        mlp_dim=48,
        max_seq_len=96,
        init_std=0.25,
        attention_type="mla",
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
    )
    base.update(kw)
    return ModelConfig(**base)


VARIANTS = {
    "expanded": _config(),
    "absorbed": _config(mla_absorb=True),  # the same parameters as "expanded" (same seed, same shapes)
    "absorbed-qlora-gate-sink": _config(mla_absorb=True, q_lora_rank=12, attn_output_gate=True, attn_sink=True),
    "nope-learned": _config(position="learned", qk_rope_head_dim=None, tie_embeddings=False),  # no rope key
}


@functools.cache
def model(name):
    c = VARIANTS[name]
    m = build_model(c, seed=0)
    if c.attn_sink:  # away from 0 so the sink takes a real share
        m.blocks.attn.sink[...] = jnp.linspace(-1.0, 1.5, c.num_layers * c.num_heads).reshape(c.num_layers, -1)
    return m


# Variants that get the full probe; the others (whose no-cache path is already covered) only the full logits
# and the cached chunks, to keep compile time down.
PROBED = ["expanded", "absorbed-qlora-gate-sink"]


@functools.cache
def probe(name):
    """One compiled program per variant: the Jacobian of the logits w.r.t. the input embeddings, the full logits,
    two prefixes run alone, and the same tokens pushed through a cache in two chunks (6 + 4)."""
    c, m = VARIANTS[name], model(name)
    full_probe = name in PROBED
    graphdef, state = nnx.split(m)
    tokens = np.random.default_rng(0).integers(0, c.vocab_size, (1, T)).astype(np.int32)
    r = np.random.default_rng(1).standard_normal(c.vocab_size).astype(np.float32)

    @jax.jit
    def run(state, tokens):
        mm = nnx.merge(graphdef, state)
        emb = mm.embed[...][tokens]

        def f(e):
            return mm.forward(tokens, input_embeddings=e).logits[0] @ r  # [T]

        full, _ = mm(tokens)
        jac = pre1 = pre6 = None
        if full_probe:
            jac = jnp.abs(jax.jacrev(f)(emb)[:, 0]).max(-1)  # [T(out), T(in)]
            pre1, _ = mm(tokens[:, :1])
            pre6, _ = mm(tokens[:, :6])
        cache = init_cache(c, 1, 16)
        a, cache = mm(tokens[:, :6], cache=cache)
        b, cache = mm(tokens[:, 6:], cache=cache)
        return jac, full, pre1, pre6, jnp.concatenate([a, b], 1)

    return tuple(None if x is None else np.asarray(x) for x in run(state, tokens))


@functools.cache
def generated(name, use_cache, chunk_size=None):
    return generate(
        model(name), PROMPTS, max_new_tokens=NEW, use_cache=use_cache, chunk_size=chunk_size, return_logits=True
    )


@pytest.mark.parametrize("name", PROBED)
def test_no_leak_from_the_future(name):
    jac = probe(name)[0]
    future = np.triu(np.ones((T, T), bool), k=1)
    assert np.all(jac[future] == 0.0), "a logit depends on a later position"
    assert np.all(jac[~future] > 0.0), "a logit ignores an earlier position"


@pytest.mark.parametrize("name", PROBED)
def test_prefix_equivalence(name):
    _, full, pre1, pre6, _ = probe(name)
    np.testing.assert_allclose(pre1[0], full[0, :1], atol=1e-5, rtol=0)
    np.testing.assert_allclose(pre6[0], full[0, :6], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_chunks_through_the_cache_equal_one_pass(name):
    _, full, _, _, cached = probe(name)
    np.testing.assert_allclose(cached, full, atol=1e-5, rtol=0)


def test_expanded_and_absorbed_share_parameters_and_the_no_cache_path():
    a, b = nnx.state(model("expanded"), nnx.Param), nnx.state(model("absorbed"), nnx.Param)
    jax.tree.map(np.testing.assert_array_equal, a, b)
    # Without a cache both use the expanded form: bit-identical logits (so one recompute reference serves both).
    np.testing.assert_array_equal(probe("expanded")[1], probe("absorbed")[1])


@pytest.mark.parametrize(
    "name,reference",
    [
        ("expanded", "expanded"),
        ("absorbed", "expanded"),  # the recompute path does not depend on mla_absorb (test above)
        ("absorbed-qlora-gate-sink", "absorbed-qlora-gate-sink"),
    ],
)
def test_cache_equals_recompute(name, reference):
    cached, recomputed = generated(name, True), generated(reference, False)
    assert cached.steps == NEW
    np.testing.assert_allclose(cached.logits, recomputed.logits, atol=1e-5, rtol=0)
    assert cached.tokens == recomputed.tokens
    assert len(set(cached.tokens[0])) > 3, "degenerate generation would make the token check weak"


def test_absorbed_equals_expanded():
    expanded, absorbed = generated("expanded", True), generated("absorbed", True)
    np.testing.assert_allclose(absorbed.logits, expanded.logits, atol=1e-5, rtol=0)
    assert absorbed.tokens == expanded.tokens
    np.testing.assert_allclose(probe("absorbed")[4], probe("expanded")[4], atol=1e-5, rtol=0)


def test_cache_holds_latent_and_rope_key_only():
    c = VARIANTS["absorbed"]
    cache = init_cache(c, 2, 24)
    (group,) = cache.groups
    assert set(group.arrays) == {"latent", "rope_key"}  # no K, no V
    assert group.arrays["latent"].shape == (2, 2, 24, 16) and group.arrays["rope_key"].shape == (2, 2, 24, 4)
    assert cache.bytes_per_token == c.num_layers * (16 + 4) * 4 == c.kv_bytes_per_token()
    nope = init_cache(VARIANTS["nope-learned"], 2, 24)
    assert nope.groups[0].arrays["rope_key"].shape == (2, 2, 24, 0)  # without RoPE only the latent is cached
    # What MHA with the same heads would cache per layer and token: K and V of 4 heads, 4*(8+4) + 4*6 elements.
    assert c.num_heads * (c.qk_nope_head_dim + c.rope_dim + c.v_head_dim) > c.kv_lora_rank + c.rope_dim
