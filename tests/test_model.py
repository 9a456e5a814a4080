"""Foundation properties of the decoder, over every attention variant (jitted, float32, highest precision)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from variants import VARIANT_IDS, VARIANTS, tiny_config, tiny_model

import causal_lm
from causal_lm.config import ConfigError, ModelConfig, apply_overrides, load_config
from causal_lm.model import InputError, attention_weights, build_model
from causal_lm.model.functional import forward

T = 10


def _tokens(config, B=2, T=T, seed=0):
    return np.random.default_rng(seed).integers(0, config.vocab_size, (B, T)).astype(np.int32)


@functools.cache
def probe(config: ModelConfig):
    """One compiled program per variant: the Jacobian of the logits w.r.t. the input embeddings, the full-sequence
    logits and the logits of two prefixes run alone."""
    model = tiny_model(config)
    graphdef, state = nnx.split(model)
    tokens = _tokens(config, B=1)
    r = np.random.default_rng(1).standard_normal(config.vocab_size).astype(np.float32)

    @jax.jit
    def run(state, tokens):
        m = nnx.merge(graphdef, state)
        emb = m.embed[...][tokens]  # [1, T, D]

        def f(e):
            logits = m.forward(tokens, input_embeddings=e).logits
            return logits[0] @ r  # [T]: one random projection of each position's logits

        jac = jax.jacrev(f)(emb)[:, 0]  # [T(out), T(in), D]
        full, _ = m(tokens)
        pre1, _ = m(tokens[:, :1])
        pre6, _ = m(tokens[:, :6])
        weights = m.attention_weights(tokens)  # [L, 1, N, T, T]
        return jnp.abs(jac).max(-1), full, pre1, pre6, weights

    return jax.tree.map(np.asarray, run(state, tokens))


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_no_leak_from_the_future(variant):
    jac = probe(tiny_config(*variant))[0]
    future = np.triu(np.ones((T, T), bool), k=1)
    assert np.all(jac[future] == 0.0), "a logit depends on a later position"
    assert np.all(jac[np.arange(T), np.arange(T)] > 0), "a logit ignores its own position"
    assert np.all(jac[1:, 0] > 0), "later logits ignore the first token"


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_prefix_equivalence(variant):
    _, full, pre1, pre6, _ = probe(tiny_config(*variant))
    np.testing.assert_allclose(pre1[0], full[0, :1], atol=1e-5, rtol=0)
    np.testing.assert_allclose(pre6[0], full[0, :6], atol=1e-5, rtol=0)


@pytest.mark.parametrize("mask", ["none", "causal_after_softmax"])
def test_wrong_masks_leak(mask):
    """The research knobs really are wrong: future positions have nonzero gradient."""
    jac = probe(tiny_config("gqa", "rope_full", attention_mask=mask))[0]
    future = np.triu(np.ones((T, T), bool), k=1)
    assert np.all(jac[:-1][future[:-1]].reshape(-1) > 0) or jac[future].max() > 1e-4
    assert (jac[future] > 0).mean() > 0.9


def _weights(config, tokens, **kw):
    model = tiny_model(config)
    graphdef, state = nnx.split(model)
    return np.asarray(_weights_jit(state, tokens, graphdef=graphdef, **kw))


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _weights_jit(state, tokens, segment_ids=None, *, graphdef):
    return nnx.merge(graphdef, state).attention_weights(tokens, segment_ids=segment_ids)


def test_zero_after_softmax_rows_fall_short_and_depend_on_the_future():
    config = tiny_config("gqa", "rope_full", attention_mask="causal_after_softmax")
    tokens = _tokens(config, B=1)
    w = _weights(config, tokens)  # [L, B, N, T, T]
    sums = w.sum(-1)
    assert np.all(sums[..., :-1] < 1), "post-softmax zeroing should leave rows summing below 1"
    assert sums[..., :-1].mean() < 0.9
    np.testing.assert_allclose(sums[..., -1], 1.0, atol=1e-5)  # the last row has no future to lose
    changed = tokens.copy()
    changed[0, -1] = (changed[0, -1] + 1) % config.vocab_size
    sums2 = _weights(config, changed).sum(-1)
    # Layer 0 rows before the last: the shortfall is the future token's share, so it moves with that token.
    assert np.abs(sums2[0, ..., :-1] - sums[0, ..., :-1]).max() > 1e-4
    # The proper mask: the same change moves nothing before the changed position.
    c2 = tiny_config("gqa", "rope_full")
    a, b = _weights(c2, tokens), _weights(c2, changed)
    np.testing.assert_array_equal(a[..., :-1, :-1], b[..., :-1, :-1])


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_causal_weights(variant):
    config = tiny_config(*variant)
    w = probe(config)[4]  # [L, B, N, T, T]
    upper = np.triu(np.ones((T, T), bool), k=1)
    assert np.all(w[..., upper] == 0.0)
    sums = w.sum(-1)
    if config.attn_sink:
        # The sink takes a share of every row: rows sum to 1 - share, strictly inside (0, 1).
        assert np.all(sums < 1) and np.all(sums > 0) and sums.mean() < 0.95
    else:
        np.testing.assert_allclose(sums, 1.0, atol=1e-5)


def test_sink_share_matches_reference():
    """attention_weights with a sink logit == softmax over [visible scores..., sink], minus the sink column."""
    rng = np.random.default_rng(0)
    B, T, N, K, H = 2, 5, 4, 2, 8
    q = rng.standard_normal((B, T, N, H)).astype(np.float32)
    k = rng.standard_normal((B, T, K, H)).astype(np.float32)
    sink = rng.standard_normal(N).astype(np.float32)
    vis = np.tril(np.ones((T, T), bool))[None].repeat(B, 0)
    w = np.asarray(attention_weights(q, k, vis, sink=sink)).reshape(B, N, T, T)
    G = N // K
    for b in range(B):
        for n in range(N):
            s = q[b, :, n] @ k[b, :, n // G].T / np.sqrt(H)
            for i in range(T):
                logits = np.append(s[i, : i + 1], sink[n])
                p = np.exp(logits - logits.max())
                p /= p.sum()
                np.testing.assert_allclose(w[b, n, i, : i + 1], p[:-1], atol=1e-6)
                assert np.all(w[b, n, i, i + 1 :] == 0)


def test_fully_masked_row_is_zero_not_nan():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 3, 2, 4)).astype(np.float32)
    k = rng.standard_normal((1, 3, 2, 4)).astype(np.float32)
    vis = np.zeros((1, 3, 3), bool)
    vis[0, 2, :2] = True
    for sink in (None, np.zeros(2, np.float32)):
        w = np.asarray(attention_weights(q, k, vis, sink=sink))
        assert np.isfinite(w).all()
        assert np.all(w[..., :2, :] == 0)


@pytest.mark.parametrize(
    "variant",
    [("mha", "rope_partial", True, True), ("mqa", "learned", False, False), ("gqa", "nope", False, True)],
    ids=["mha-partial-gate-sink", "mqa-learned", "gqa-nope-sink"],
)
def test_packed_documents_equal_separate_runs(variant):
    config = tiny_config(*variant)
    model = tiny_model(config)
    rng = np.random.default_rng(3)
    a = rng.integers(0, config.vocab_size, (1, 6)).astype(np.int32)
    b = rng.integers(0, config.vocab_size, (1, 9)).astype(np.int32)
    packed = np.concatenate([a, b], 1)
    seg = np.array([[1] * 6 + [2] * 9], np.int32)
    lp, _ = forward(model, packed, segment_ids=seg)
    la, _ = forward(model, a)
    lb, _ = forward(model, b)
    np.testing.assert_allclose(np.asarray(lp)[0, :6], np.asarray(la)[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(lp)[0, 6:], np.asarray(lb)[0], atol=1e-5, rtol=0)


def test_padding_keys_get_zero_weight_and_padded_rows_are_finite():
    config = tiny_config("gqa", "rope_full", False, True)
    tokens = _tokens(config, B=2)
    seg = np.ones_like(tokens)
    seg[0, 7:] = 0  # row 0: 7 real tokens then padding
    w = np.asarray(
        _weights_jit(nnx.split(tiny_model(config))[1], tokens, seg, graphdef=nnx.split(tiny_model(config))[0])
    )
    assert np.all(w[:, 0, :, :, 7:] == 0), "a padded key received attention"
    logits, _ = forward(tiny_model(config), tokens, segment_ids=seg)
    logits = np.asarray(logits)
    assert np.isfinite(logits).all()
    # Real positions of the padded row equal the unpadded row of those 7 tokens run alone.
    alone, _ = forward(tiny_model(config), tokens[:1, :7])
    np.testing.assert_allclose(logits[0, :7], np.asarray(alone)[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kv", ["mha", "gqa", "mqa"])
@pytest.mark.parametrize("mask", ["causal", "none"])
def test_dot_product_attention_path_equals_einsum(kv, mask):
    c1 = tiny_config(kv, "rope_partial", True, False, attention_mask=mask)
    c2 = tiny_config(kv, "rope_partial", True, False, attention_mask=mask, attention_impl="dot_product_attention")
    m1, m2 = tiny_model(c1), tiny_model(c2)
    tokens = _tokens(c1)
    seg = np.ones_like(tokens)
    seg[1, 6:] = 0
    l1, _ = forward(m1, tokens, segment_ids=seg)
    l2, _ = forward(m2, tokens, segment_ids=seg)
    np.testing.assert_allclose(np.asarray(l1), np.asarray(l2), atol=1e-5, rtol=0)


def test_scan_and_unrolled_layers_agree():
    c1 = tiny_config("gqa", "rope_full", True, True)
    c2 = tiny_config("gqa", "rope_full", True, True, scan_layers=False)
    tokens = _tokens(c1)
    l1, _ = forward(tiny_model(c1), tokens)
    l2, _ = forward(tiny_model(c2), tokens)
    np.testing.assert_allclose(np.asarray(l1), np.asarray(l2), atol=1e-5, rtol=0)


def test_rope_rotates_only_q_and_k_and_only_the_fraction():
    from causal_lm.model.rope import apply_rope, rope_tables

    x = np.random.default_rng(0).standard_normal((1, 4, 2, 8)).astype(np.float32)
    cos, sin = rope_tables(jnp.arange(4)[None], 2, 10000.0)
    y = np.asarray(apply_rope(x, cos, sin))
    np.testing.assert_array_equal(y[..., 2:], x[..., 2:])  # unrotated dims pass through
    np.testing.assert_array_equal(y[:, 0], x[:, 0])  # position 0 is the identity
    assert not np.allclose(y[:, 1:, :, :2], x[:, 1:, :, :2])
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-6)
    # V is not rotated: shifting all positions by a constant leaves q.k unchanged and V untouched.
    c = tiny_config("mha", "rope_full")
    model = tiny_model(c)
    h = np.random.default_rng(1).standard_normal((1, 5, c.d_model)).astype(np.float32)
    pos = jnp.arange(5)[None]
    graphdef, state = nnx.split(model.blocks)
    layer0 = nnx.merge(graphdef, jax.tree.map(lambda a: a[0], state))
    ca, sa = rope_tables(pos, c.rope_dim, c.rope_theta)
    cb, sb = rope_tables(pos + 7, c.rope_dim, c.rope_theta)
    ka, va = layer0.attn.project_kv(h, ca, sa)
    kb, vb = layer0.attn.project_kv(h, cb, sb)
    np.testing.assert_array_equal(np.asarray(va), np.asarray(vb))
    assert not np.allclose(np.asarray(ka), np.asarray(kb))


@pytest.mark.parametrize("rope_dim,table_batch", [(8, 2), (4, 2), (4, 1)])
def test_rope_hand_written_derivative_matches_autodiff(rope_dim, table_batch):
    """apply_rope's custom VJP (rotation by minus the angle) against differentiating the forward op by op, for
    x and for the cos/sin tables, with full and partial rotation and tables broadcast over the batch."""
    from causal_lm.model import rope

    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 5, 3, 8)), jnp.float32)
    g = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    cos, sin = rope.rope_tables(jnp.arange(5)[None].repeat(table_batch, 0) + 3, rope_dim, 10000.0)
    cos = cos + 0.1 * jnp.asarray(rng.standard_normal(cos.shape), jnp.float32)  # generic tables, not unit circle

    def loss(f):
        return lambda x, c, s: jnp.sum(f(x, c, s) * g)

    want = jax.grad(loss(rope._rope_forward), argnums=(0, 1, 2))(x, cos, sin)
    got = jax.grad(loss(rope.apply_rope), argnums=(0, 1, 2))(x, cos, sin)
    for w, v in zip(want, got, strict=True):
        assert w.shape == v.shape
        np.testing.assert_allclose(np.asarray(v), np.asarray(w), atol=1e-5, rtol=1e-5)
    assert float(jnp.max(jnp.abs(got[0]))) > 0


# ---- bad input: clear errors before any compute ---------------------------------------------------------------


def test_out_of_vocab_token_is_an_error():
    config = tiny_config()
    model = tiny_model(config)
    bad = _tokens(config)
    bad[1, 3] = config.vocab_size
    with pytest.raises(InputError, match=r"token id 61 at \[row 1, position 3\].*vocabulary"):
        forward(model, bad)
    bad[1, 3] = -1
    with pytest.raises(InputError, match="token id -1"):
        model(bad)


def test_too_long_sequence_is_an_error():
    config = tiny_config()
    with pytest.raises(InputError, match="exceeds model.max_seq_len=96"):
        forward(tiny_model(config), np.zeros((1, 97), np.int32))


def test_input_errors_are_raised_before_compute(monkeypatch):
    """Validation runs on the host: the jitted program is never reached for bad input."""
    import causal_lm.model.functional as fn

    def boom(*a, **k):
        raise AssertionError("compute started")

    monkeypatch.setattr(fn, "_forward", boom)
    config = tiny_config()
    with pytest.raises(InputError):
        fn.forward(tiny_model(config), np.full((1, 4), 99, np.int32))
    with pytest.raises(InputError):
        fn.forward(tiny_model(config), np.zeros((4,), np.int32))
    with pytest.raises(InputError):
        fn.forward(tiny_model(config), np.zeros((1, 4), np.float32))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_heads=4, num_kv_heads=3), "must divide num_heads"),
        (dict(d_model=30, num_heads=4), "not divisible by num_heads"),
        (dict(position="alibi"), "position must be one of"),
        (dict(attention_mask="bidirectional"), "attention_mask must be one of"),
        (dict(rope_fraction=0.3), "rope_fraction"),
        (dict(rope_fraction=1.5), r"rope_fraction must be in \[0, 1\]"),
        (dict(vocab_size=0), "vocab_size must be a positive integer"),
        (dict(attention_impl="dot_product_attention", attn_sink=True), "attn_sink needs attention_impl='xla'"),
        (dict(dtype="float64"), "dtype must be one of"),
    ],
)
def test_bad_config_is_an_error(kwargs, match):
    base = dict(vocab_size=61, d_model=32, num_layers=2, num_heads=4, mlp_dim=48, max_seq_len=64)
    base.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**base)


def test_overrides_convert_types_and_reject_unknown_keys():
    c = load_config(
        "tiny",
        [
            "model.num_layers=3",
            "num_kv_heads=1",
            "rope_theta=500000",
            "attn_sink=true",
            "head_dim=none",
            "train.steps=7",
        ],
    )
    assert c.model.num_layers == 3 and c.model.num_kv_heads == 1 and c.model.rope_theta == 5e5
    # head_dim=none: derived from d_model / num_heads (64 / 4), and derived again when d_model changes
    assert c.model.attn_sink is True and c.model.head_dim == 16 and c.train.steps == 7
    assert c.model.replace(d_model=128).head_dim == 32 and c.model.to_dict()["head_dim"] is None
    assert load_config("tiny", ["head_dim=8"]).model.replace(d_model=128).head_dim == 8  # set, so kept
    with pytest.raises(ConfigError, match=r"unknown config key 'model.num_layer'; valid keys: .*model.num_layers"):
        apply_overrides(c, ["model.num_layer=2"])
    with pytest.raises(ConfigError, match="cannot convert"):
        apply_overrides(c, ["model.num_layers=two"])
    with pytest.raises(ConfigError, match="must divide"):
        apply_overrides(c, ["model.num_kv_heads=3"])
    with pytest.raises(ConfigError, match="not found"):
        load_config("no_such_preset")


def test_presets_build_and_run():
    for name in ("tiny", "small"):
        c = load_config(name)
        model = build_model(c.model)
        logits, cache = forward(model, np.zeros((1, 8), np.int32))
        assert logits.shape == (1, 8, c.model.vocab_size) and cache is None
        assert np.isfinite(np.asarray(logits)).all()


def test_public_api():
    config = tiny_config()
    model = causal_lm.build_model(config, seed=0)
    logits, cache = model(np.zeros((1, 3), np.int32))
    assert cache is None and logits.dtype == jnp.float32
    # Same seed, same parameters; different seed, different parameters.
    a = np.asarray(causal_lm.build_model(config, seed=0).embed[...])
    b = np.asarray(causal_lm.build_model(config, seed=1).embed[...])
    np.testing.assert_array_equal(a, np.asarray(model.embed[...]))
    assert not np.array_equal(a, b)


# ---- attention backends and rematerialisation (issue 17) -----------------------------------------------------


def _segments(B, T):
    seg = np.ones((B, T), np.int32)
    seg[0, T // 3 :] = 2
    seg[-1, -4:] = 0
    return seg


@pytest.mark.parametrize("variant", [("gqa", "rope_full", False, False), ("mqa", "rope_partial", True, True)])
def test_auto_is_the_xla_path_on_a_cpu_bit_for_bit(variant):
    """The new default `auto` runs exactly the XLA kernels on a CPU: logits identical to attention_impl=xla."""
    config = tiny_config(*variant)
    assert config.attention_impl == "auto"
    tokens, seg = _tokens(config, T=24), _segments(2, 24)
    xla = config.replace(attention_impl="xla")
    for c in (config, xla):
        nnx.update(tiny_model(c), nnx.state(tiny_model(config)))
    run = lambda c: np.asarray(jax.jit(lambda t, s: tiny_model(c)(t, segment_ids=s)[0])(tokens, seg))  # noqa: E731
    np.testing.assert_array_equal(run(config), run(xla))


def test_a_splash_model_equals_the_xla_model():
    """The whole decoder with attention_impl=splash (Pallas interpret mode on a CPU) against xla: local and global
    layers in one scan (the window is picked per layer by a switch), packed segments with padding, GQA, sinks;
    float32 within 1e-5."""
    config = tiny_config("gqa", "rope_full", sink=True, sliding_window=5, layer_pattern="local,global")
    splash = config.replace(attention_impl="splash")
    nnx.update(tiny_model(splash), nnx.state(tiny_model(config)))
    tokens, seg = _tokens(config, T=24), _segments(2, 24)
    run = lambda c: np.asarray(jax.jit(lambda t, s: tiny_model(c)(t, segment_ids=s)[0])(tokens, seg))  # noqa: E731
    np.testing.assert_allclose(run(splash), run(config), atol=1e-5, rtol=0)


def test_cudnn_is_refused_when_the_model_runs_on_a_cpu():
    """The config loads anywhere (a GPU job's config on a CPU host); running it off a GPU is a ConfigError."""
    config = tiny_config("gqa", "rope_full", attention_impl="cudnn", dtype="bfloat16")
    model = build_model(config)
    with pytest.raises(ConfigError, match="'cudnn' needs an NVIDIA GPU"):
        model(_tokens(config))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(attention_impl="cudnn", attn_sink=True), "'cudnn' cannot run model.attn_sink"),
        (
            dict(attention_impl="cudnn", attn_softcap=30.0),
            "attn_softcap needs attention_impl='xla', 'auto' or 'splash'",
        ),
        (dict(attention_impl="splash", attention_mask="causal_after_softmax"), "'splash' cannot run attention_mask="),
        (dict(attention_impl="cudnn", attention_mask="none"), "'cudnn' cannot run attention_mask='none'"),
        (dict(attention_impl="flash"), "attention_impl must be one of"),
        (dict(remat="some"), "model.remat must be one of"),
    ],
)
def test_fused_backend_and_remat_config_errors(kwargs, match):
    base = dict(vocab_size=61, d_model=32, num_layers=2, num_heads=4, mlp_dim=48, max_seq_len=64)
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**{**base, **kwargs})


def test_remat_accepts_the_old_booleans():
    """Old workdirs' config.json hold remat true/false: they load as full/none, as do key=value booleans."""
    from causal_lm.config import config_from_dict, config_to_dict

    assert ModelConfig(remat=True).remat == "full" and ModelConfig(remat=False).remat == "none"
    old = config_to_dict(load_config("tiny"))
    old["model"]["remat"] = True
    assert config_from_dict(old).model.remat == "full"
    assert apply_overrides(load_config("tiny"), ["model.remat=false"]).model.remat == "none"
    assert apply_overrides(load_config("tiny"), ["remat=minimal"]).model.remat == "minimal"


def test_remat_policies_give_the_gradients_of_no_remat():
    """none, minimal and full rematerialisation: the same parameter gradients (float32, within 1e-6), and the
    policies differ in what they keep (the compiled gradient's temporaries shrink from none to full)."""
    base = tiny_config("gqa", "rope_full", gate=True)
    tokens, seg = _tokens(base, T=32), _segments(2, 32)
    grads, temp = {}, {}
    for remat in ("none", "minimal", "full"):
        model = build_model(base.replace(remat=remat), seed=0)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(params, graphdef=graphdef, rest=rest):
            logits = nnx.merge(graphdef, params, rest)(tokens, segment_ids=seg)[0]
            return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0])

        fn = jax.jit(jax.grad(loss))
        temp[remat] = fn.lower(params).compile().memory_analysis().temp_size_in_bytes
        grads[remat] = jax.tree.leaves(fn(params))
    for remat in ("minimal", "full"):
        for g, want in zip(grads[remat], grads["none"], strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(want), atol=1e-6, rtol=0, err_msg=remat)
    assert temp["none"] > temp["minimal"] > temp["full"], temp


def test_rope_scaling_and_mla_are_sub_structures_and_the_old_flat_names_still_work():
    """Issue 28: RoPE scaling and MLA settings live in model.rope_scaling / model.mla. The old flat names keep
    working as overrides, keyword arguments, replace() changes, attribute reads and config.json keys (workdirs
    written before the change), and a wrong value given under an old name is refused naming the new key."""
    from causal_lm.config import MLAConfig, RopeScaling, config_from_dict, config_to_dict

    yarn = ["model.rope_scaling.type=yarn", "model.rope_scaling.factor=4", "model.rope_scaling.original_max_len=64"]
    new = load_config("tiny", yarn)
    old = load_config("tiny", ["model.rope_type=yarn", "rope_factor=4", "model.rope_original_max_len=64"])
    assert old == new and new.model.rope_scaling == RopeScaling(type="yarn", factor=4.0, original_max_len=64)
    assert ModelConfig(rope_type="linear", rope_factor=2.0) == ModelConfig(
        rope_scaling=RopeScaling(type="linear", factor=2.0)
    )
    assert new.model.rope_factor == 4.0 and new.model.rope_type == "yarn"  # old reads
    with pytest.raises(ConfigError, match=r"model.rope_scaling.factor only applies to rope_scaling.type"):
        apply_overrides(load_config("tiny"), ["model.rope_factor=2"])
    with pytest.raises(ConfigError, match=r"unknown config key 'model.mla.kv_lora_rnk'; valid keys: .*model.mla.kv"):
        apply_overrides(load_config("tiny"), ["model.mla.kv_lora_rnk=8"])

    mla = ["model.attention_type=mla", "model.num_kv_heads=none", "model.mla.kv_lora_rank=16", "model.mla.absorb=true"]
    c = load_config("tiny", mla)
    assert c == load_config("tiny", [*mla[:2], "kv_lora_rank=16", "model.mla_absorb=true"])
    assert c.model.mla == MLAConfig(16, None, 16, 8, 16, True)  # sizes derived from head_dim 16
    assert c.model.kv_lora_rank == 16 and c.model.qk_rope_head_dim == 8
    # A change to one MLA field keeps the others and derives the derived sizes again.
    wider = c.model.replace(kv_lora_rank=32, d_model=128)
    assert wider.mla == MLAConfig(32, None, 32, 16, 32, True)
    assert c.model.replace(**{"mla.kv_lora_rank": 32}).mla.kv_lora_rank == 32
    with pytest.raises(ConfigError, match=r"model.mla.kv_lora_rank only apply to attention_type='mla'"):
        ModelConfig(kv_lora_rank=8)

    # config.json round trip, and one written with the flat keys (an older workdir) reads as the same config.
    d = config_to_dict(c)
    assert d["model"]["mla"]["qk_nope_head_dim"] is None and config_from_dict(d) == c  # derived again on load
    flat = config_to_dict(new)
    flat["model"].update(rope_type="yarn", rope_factor=4.0, rope_original_max_len=64, kv_lora_rank=None)
    del flat["model"]["rope_scaling"], flat["model"]["mla"]
    assert config_from_dict(flat) == new
    flat["model"]["rope_factr"] = 2.0
    with pytest.raises(ConfigError, match="unknown config key"):
        config_from_dict(flat)


def test_one_backend_table_serves_config_validation_and_the_backend_choice():
    """ATTENTION_BACKENDS is the one statement of what each attention_impl computes: config validation refuses a
    named backend for a setting the table says it lacks, naming those that have it, and `auto` skips it."""
    from causal_lm.config import ATTENTION_BACKENDS, ATTENTION_IMPLS
    from causal_lm.model import backends

    base = dict(vocab_size=61, d_model=32, num_layers=2, num_heads=4, mlp_dim=48, max_seq_len=64)
    assert ATTENTION_IMPLS == ("auto", *ATTENTION_BACKENDS)
    settings = {
        "sink": dict(attn_sink=True),
        "softcap": dict(attn_softcap=30.0),
        "mla": dict(attention_type="mla", mla={"kv_lora_rank": 8}),
    }
    for impl, b in ATTENTION_BACKENDS.items():
        for feature, kwargs in settings.items():
            if getattr(b, feature):
                ModelConfig(**base, **kwargs, attention_impl=impl)
            else:
                with pytest.raises(ConfigError, match=f"'{impl}' cannot run"):
                    ModelConfig(**base, **kwargs, attention_impl=impl)
        for mask in ("causal", "none", "causal_after_softmax"):
            if mask in b.masks:
                ModelConfig(**base, attention_mask=mask, attention_impl=impl)
            else:
                with pytest.raises(ConfigError, match=f"'{impl}' cannot run attention_mask='{mask}'"):
                    ModelConfig(**base, attention_mask=mask, attention_impl=impl)
    for feature in ("sink", "softcap"):
        want = "cudnn" if ATTENTION_BACKENDS["cudnn"].__dict__[feature] else None
        assert backends.resolve("auto", "gpu", "bfloat16", 64, **{feature: True}) == want


def test_logits_at_projects_only_the_chosen_positions():
    """forward(..., logits_at=[B, K]) gives the logits of those positions (a sampler needs one per row, the engine
    the last fed token of each row), equal to the full projection's, and refuses indices outside the call."""
    model = tiny_model(tiny_config("gqa"))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 7)), jnp.int32)
    full = model.forward(tokens).logits
    at = np.asarray([[6, 0], [3, 3]], np.int32)
    picked = model.forward(tokens, logits_at=at).logits
    assert picked.shape == (2, 2, full.shape[-1])
    want = np.take_along_axis(np.asarray(full), at[..., None], axis=1)
    np.testing.assert_allclose(np.asarray(picked), want, atol=1e-5, rtol=0)
    for bad in ([[7, 0], [0, 0]], [[-1, 0], [0, 0]], [[0], [0], [0]]):
        with pytest.raises(InputError, match="logits_at"):
            model.forward(tokens, logits_at=np.asarray(bad))


def test_decode_form_fuses_the_products_and_gives_the_same_logits():
    """split_layers() (what the decode loops pass as `layers`) concatenates q/k/v and gate/up into one weight each;
    the logits through a cache equal those of the stacked model's, biases, q/k norms and gates included."""
    c = tiny_config("gqa", pos="rope_partial", gate=True, qkv_bias=True, qk_norm=True)
    model = build_model(c, seed=3)
    init = jax.tree.map(lambda a: a + 0.1, nnx.state(model, nnx.Param))  # non-zero biases and norm gains
    nnx.update(model, init)
    fused = model.split_layers(native=False)  # the XLA layout; native=True: the same, output-major (test_matvec)
    attn, mlp = fused[0]["attn"], fused[0]["mlp"]
    assert "wqkv" in attn and not {"wq", "wk", "wv"} & set(attn), sorted(attn)
    assert "w_gate_up" in mlp and not {"w_gate", "w_up"} & set(mlp), sorted(mlp)
    assert attn["wqkv"][...].shape == (c.d_model, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim)
    tokens = np.random.default_rng(0).integers(0, c.vocab_size, (2, 7))
    want, _ = model(tokens, cache=causal_lm.init_cache(c, 2, 16))
    for layers in (fused, model.split_layers(), model.split_layers(fuse=False)):
        got, _ = model(tokens, cache=causal_lm.init_cache(c, 2, 16), layers=layers)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)
