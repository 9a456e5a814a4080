"""Every attention kernel equals the reference kernel, over the mask shapes the model produces.

The reference (plain einsums over the dense mask) is the definition; each faster path is tested against it over
the grid: MHA / GQA / MQA, sink logits or not, and masks from training (causal, index order), sliding windows,
packed documents (segments, positions restarting), a chunk at an offset over a cache, a ring-buffer cache (slots
out of position order), padding, and the zero-after-softmax research variant; and with Gemma 2's tanh softcapping
of the scores (applied before the mask) on half of the grid.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from causal_lm.config import ConfigError, ModelConfig
from causal_lm.model import backends, kernels
from causal_lm.model.mask import AttentionMask, make_mask, segment_positions

N, H = 4, 8
ATOL = 1e-5


def _qkv(T, S, K, seed=0, Hv=H):
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.standard_normal((2, T, N, H)), jnp.float32)
    k = jnp.asarray(r.standard_normal((2, S, K, H)), jnp.float32)
    v = jnp.asarray(r.standard_normal((2, S, K, Hv)), jnp.float32)
    return q, k, v


def _self_mask(T, window=None, segments=False):
    """Training's mask: keys are the queries' own tokens, positions from their index (or restarting per segment)."""
    if segments:
        seg = np.ones((2, T), np.int32)
        seg[0, T // 3 :] = 2
        seg[1, T // 2 :] = 3
        seg[1, -3:] = 0  # padding at the end of row 1
        seg = jnp.asarray(seg)
        pos = segment_positions(seg)
        valid = seg != 0
    else:
        seg = None
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
        valid = jnp.ones((2, T), bool)
    return AttentionMask(make_mask(pos, pos, valid, seg, seg, window=window), index_causal=True)


def _chunk_mask(T, S, offsets=(5, 11)):
    """A chunk of T queries at each row's own offset over a cache of S slots (slot == position)."""
    qpos = jnp.asarray([[o + t for t in range(T)] for o in offsets], jnp.int32)
    kpos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (2, S))
    valid = kpos < (jnp.asarray(offsets)[:, None] + T)
    return AttentionMask(make_mask(qpos, kpos, valid))


def _ring_mask(T, window=4):
    """A ring of 6 slots holding positions out of order, one row empty in two slots."""
    kpos = jnp.asarray([[12, 13, 8, 9, 10, 11], [6, 7, -1, -1, 4, 5]], jnp.int32)
    qpos = jnp.asarray([[13 - T + 1 + t for t in range(T)], [7 - T + 1 + t for t in range(T)]], jnp.int32)
    return AttentionMask(make_mask(qpos, kpos, kpos >= 0, window=window))


def _zero_after_mask(T):
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
    valid = jnp.ones((2, T), bool)
    everything = make_mask(pos, pos, valid, causal=False)
    return AttentionMask(everything, zero_after=make_mask(pos, pos, valid).astype(jnp.float32))


CASES = {
    # name: (T, S, mask builder)
    "causal-72": (72, 72, lambda: _self_mask(72)),  # > 64 queries: blocks of 64 and 8
    "window-5": (24, 24, lambda: _self_mask(24, window=5)),
    "packed": (30, 30, lambda: _self_mask(30, segments=True)),
    "chunk-3-at-offset": (3, 20, lambda: _chunk_mask(3, 20)),
    "decode-1": (1, 20, lambda: _chunk_mask(1, 20)),
    "ring-2": (2, 6, lambda: _ring_mask(2)),
    "zero-after-softmax": (12, 12, lambda: _zero_after_mask(12)),
}

FAST = {
    "heads_major": kernels.heads_major_attention,
    "in_place": kernels.in_place_attention,
    "blocked": lambda *a, **kw: kernels.blocked_causal_attention(*a, **kw, block=64),
    "blocked-small": lambda *a, **kw: kernels.blocked_causal_attention(*a, **kw, block=4),
    "query-blocked": lambda *a, **kw: kernels.query_blocked_attention(*a, **kw, block=5),  # a ragged last block
    "dot_product_attention": kernels.xla_dot_product_attention,
}


def _applies(name, mask, sink, softcap, T, S):
    if name.startswith("blocked"):
        return mask.index_causal and T == S
    if name == "dot_product_attention":
        return sink is None and softcap is None and mask.zero_after is None
    return True


def _run(name, fn, q, k, v, mask, sink, scale, softcap=None):
    # Eager: each primitive compiles once per shape and is reused across cases; jitting every kernel for every
    # case would compile ~200 whole programs.
    return fn(q, k, v, mask, scale=scale, sink=sink, softcap=softcap)


# A cap well inside the scores' range (|score| reaches ~4 at scale 1/sqrt(8)), so it changes every kernel's result.
SOFTCAP = 1.5


@pytest.mark.parametrize("kv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("case", CASES)
def test_every_kernel_equals_the_reference(kv, case):
    T, S, build = CASES[case]
    i = list(CASES).index(case)
    with_sink = (i + kv) % 2 == 1  # half the grid with sink logits, each case and head count
    # covered both ways across the grid (a full product doubles the compiles for little); likewise softcapping,
    # crossed with the sink so both combinations occur.
    softcap = SOFTCAP if (i // 2 + kv) % 2 == 0 else None
    mask = build()
    q, k, v = _qkv(T, S, kv)
    sink = jnp.asarray([-1.0, 0.5, 2.0, 0.0], jnp.float32) if with_sink else None
    scale = kernels.default_scale(H)
    ref, weights = kernels.reference_attention(q, k, v, mask, scale=scale, sink=sink, softcap=softcap)
    assert np.isfinite(np.asarray(ref)).all()
    checked = 0
    for name, fn in FAST.items():
        if not _applies(name, mask, sink, softcap, T, S):
            continue
        out = _run(name, fn, q, k, v, mask, sink, scale, softcap)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=ATOL, rtol=0, err_msg=name)
        checked += 1
    assert checked >= 2
    # and the dispatcher's choice for these shapes is one of them (same result)
    out, _ = kernels.attention(q, k, v, mask, scale=scale, sink=sink, softcap=softcap)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=ATOL, rtol=0)
    if softcap is not None:  # the cap matters here: without it the result is different
        uncapped, _ = kernels.reference_attention(q, k, v, mask, scale=scale, sink=sink)
        assert np.abs(np.asarray(uncapped) - np.asarray(ref)).max() > 1e-2


def test_the_reference_is_the_formula():
    """The reference against a loop written out in numpy: softmax over visible keys (plus the sink), GQA heads."""
    T, S, K = 3, 20, 2
    mask = _chunk_mask(T, S)
    q, k, v = _qkv(T, S, K, seed=3, Hv=5)
    sink = np.asarray([0.3, -0.2, 1.0, 0.0], np.float32)
    out, w = kernels.reference_attention(q, k, v, mask, scale=0.5, sink=jnp.asarray(sink))
    q, k, v, vis = (np.asarray(a, np.float64) for a in (q, k, v, mask.visible))
    G = N // K
    for b in range(2):
        for n in range(N):
            for t in range(T):
                s = (k[b, :, n // G] @ q[b, t, n]) * 0.5
                e = np.where(vis[b, t] > 0, np.exp(s - s.max()), 0.0)
                p = e / (e.sum() + np.exp(sink[n] - s.max()))
                np.testing.assert_allclose(np.asarray(w)[b, n, t], p, atol=1e-6)
                np.testing.assert_allclose(np.asarray(out)[b, t, n], p @ v[b, :, n // G], atol=1e-5)


def test_value_dim_may_differ_from_the_key_dim():
    """MLA's values have their own head dim: every kernel handles Hv != H."""
    q, k, v = _qkv(66, 66, 2, Hv=5)
    mask = _self_mask(66)
    ref, _ = kernels.reference_attention(q, k, v, mask, scale=0.3)
    for name in ("heads_major", "in_place", "blocked", "query-blocked"):
        out = FAST[name](q, k, v, mask, scale=0.3)
        assert out.shape == (2, 66, N, 5)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=ATOL, rtol=0, err_msg=name)


def test_the_blocked_kernel_refuses_a_mask_that_does_not_promise_causality():
    """Skipping keys is derived from the mask (index_causal), never assumed: a mask without it is refused."""
    q, k, v = _qkv(66, 66, 2)
    mask = _self_mask(66)
    loose = AttentionMask(mask.visible)  # same values, no promise
    with pytest.raises(ValueError, match="index-causal"):
        kernels.blocked_causal_attention(q, k, v, loose, scale=0.3, block=16)
    assert kernels.select_kernel(q, k, loose).func is kernels.query_blocked_attention  # blocks, skips no key
    assert kernels.select_kernel(q, k, mask).func is kernels.blocked_causal_attention


@pytest.mark.parametrize("sink", [False, True], ids=["plain", "sink"])
def test_softcap_is_tanh_of_the_scaled_scores_before_the_mask(sink):
    """Gemma 2's softcapping against numpy: weights = softmax over visible keys of c * tanh(q.k * scale / c).

    Capping after the mask would turn the masked scores' large negative into -c, a score like any other: masked
    keys would get weight, which this catches (the chunk mask hides most keys of each row)."""
    T, S, K, c = 3, 20, 2, 2.0
    mask = _chunk_mask(T, S)
    q, k, v = _qkv(T, S, K, seed=5, Hv=5)
    sinks = np.asarray([0.3, -0.2, 1.0, 0.0], np.float32)
    out, w = kernels.reference_attention(q, k, v, mask, scale=0.5, sink=jnp.asarray(sinks) if sink else None, softcap=c)
    q, k, v, vis = (np.asarray(a, np.float64) for a in (q, k, v, mask.visible))
    G = N // K
    for b in range(2):
        for n in range(N):
            for t in range(T):
                s = c * np.tanh((k[b, :, n // G] @ q[b, t, n]) * 0.5 / c)
                e = np.where(vis[b, t] > 0, np.exp(s - s.max()), 0.0)
                p = e / (e.sum() + (np.exp(sinks[n] - s.max()) if sink else 0.0))
                np.testing.assert_allclose(np.asarray(w)[b, n, t], p, atol=1e-6)
                np.testing.assert_allclose(np.asarray(out)[b, t, n], p @ v[b, :, n // G], atol=1e-5)


def test_dot_product_attention_refuses_softcapping():
    q, k, v = _qkv(3, 20, 2)
    with pytest.raises(ValueError, match="softcapping"):
        kernels.xla_dot_product_attention(q, k, v, _chunk_mask(3, 20), scale=0.3, softcap=5.0)


# ---- fused backends: splash (Pallas interpret mode on a CPU) and cuDNN (on a GPU) ------------------------------


def _decoder_mask(T, window=0, segments=False):
    """The mask the decoder makes over its own positions, with the structure a fused kernel reads (windows and
    segment ids, see AttentionMask): padding at the end of row 1 when segmented."""
    seg = None
    if segments:
        s = np.ones((2, T), np.int32)
        s[0, T // 3 :] = 2
        s[1, T // 2 :] = 3
        s[1, -3:] = 0
        seg = jnp.asarray(s)
    m = _self_mask(T, window=window or None, segments=segments)
    return AttentionMask(m.visible, index_causal=True, windows=(window,), segment_ids=seg)


SPLASH_CASES = {
    # name: (T, kv heads, window, segments, sink, softcap, tile)
    "causal-mha": (40, 4, 0, False, False, None, None),
    "window-gqa-sink": (24, 2, 5, False, True, None, None),
    "packed-mqa-softcap": (30, 1, 0, True, False, SOFTCAP, None),
    "packed-window-gqa-sink-softcap": (30, 2, 4, True, True, SOFTCAP, None),
    "causal-gqa-tiles-of-128": (200, 2, 0, False, False, None, 128),  # 2 x 2 tiles, one skipped as fully masked
}
SINK = jnp.asarray([-1.0, 0.5, 2.0, 0.0], jnp.float32)


@functools.cache
def _splash_fn(softcap, block):
    """One jitted splash call per static setting (Pallas interpret mode compiles a large program: jitted, the
    cases cost ~2 s each rather than ~8 s eagerly)."""

    @jax.jit
    def run(q, k, v, mask, sink, scale):
        return backends.splash_attention(q, k, v, mask, scale=scale, sink=sink, softcap=softcap, block=block)

    return run


@pytest.mark.parametrize("case", SPLASH_CASES)
def test_splash_equals_the_reference(case):
    """Splash attention (causal / window / packed segments with padding, MHA / GQA / MQA, sinks, softcapping,
    several tiles) equals the reference kernel over the same mask in float32 within 1e-5."""
    T, kv, window, segments, sink, softcap, block = SPLASH_CASES[case]
    mask = _decoder_mask(T, window, segments)
    q, k, v = _qkv(T, T, kv, seed=T + kv)
    s = SINK if sink else None
    ref, _ = kernels.reference_attention(q, k, v, mask, scale=0.4, sink=s, softcap=softcap)
    out = _splash_fn(softcap, block)(q, k, v, mask, s, 0.4)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=ATOL, rtol=0)
    if segments:  # padding rows are zeros, as in the reference
        assert np.all(np.asarray(out)[1, -3:] == 0)


def test_splash_gradients_equal_the_reference():
    """The backward kernels (dq, dk/dv, the sink's gradient) against the reference's autodiff, packed segments with
    a window, GQA, sinks and softcapping, in float32 within 1e-5."""
    T, window = 30, 4
    mask = _decoder_mask(T, window, segments=True)
    q, k, v = _qkv(T, T, 2, seed=7)
    ct = jnp.asarray(np.random.default_rng(8).standard_normal((2, T, N, H)), jnp.float32)

    def loss(kernel):
        return lambda q, k, v, s: jnp.sum(kernel(q, k, v, mask, scale=0.4, sink=s, softcap=SOFTCAP) * ct)

    grads = jax.jit(jax.grad(loss(backends.splash_attention), argnums=(0, 1, 2, 3)))(q, k, v, SINK)
    ref_attn = lambda *a, **kw: kernels.reference_attention(*a, **kw)[0]  # noqa: E731
    want = jax.grad(loss(ref_attn), argnums=(0, 1, 2, 3))(q, k, v, SINK)
    for name, g, w in zip("q k v sink".split(), grads, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=ATOL, rtol=0, err_msg=name)


def test_fused_backends_leave_unstructured_masks_to_the_xla_kernels():
    """A chunk at an offset over a cache, a decode step, a ring buffer, explicit positions (no `windows` on the
    mask): no fused kernel applies, the dispatcher takes the XLA kernels, and the result is the reference's."""
    for T, S, build in (CASES["chunk-3-at-offset"], CASES["ring-2"], CASES["window-5"]):
        mask = build()
        q, k, v = _qkv(T, S, 2)
        assert not backends.applies(mask, q, k)
        out, _ = kernels.attention(q, k, v, mask, impl="splash", scale=0.3)
        ref, _ = kernels.reference_attention(q, k, v, mask, scale=0.3)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=ATOL, rtol=0)


def test_cudnn_is_refused_off_a_gpu():
    """A named cuDNN backend on a CPU: a ConfigError saying so when the model first runs; `auto` falls back."""
    q, k, v = _qkv(24, 24, 2)
    mask = _decoder_mask(24)
    with pytest.raises(ConfigError, match="'cudnn' needs an NVIDIA GPU, but JAX's backend here is 'cpu'"):
        kernels.attention(q, k, v, mask, impl="cudnn", scale=0.3)
    out, _ = kernels.attention(q, k, v, mask, impl="auto", scale=0.3)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(kernels.attention(q, k, v, mask, scale=0.3)[0]))


@pytest.mark.parametrize(
    "plat, dtype, extra, want",
    [
        ("cpu", "float32", {}, None),
        ("tpu", "bfloat16", {}, "splash"),
        ("tpu", "bfloat16", dict(sink=True, softcap=True), "splash"),
        ("tpu", "bfloat16", dict(devices=4), None),  # no partitioning rule for a Pallas call: xla on a mesh
        ("gpu", "bfloat16", dict(devices=8), "cudnn"),
        ("gpu", "bfloat16", {}, "cudnn"),
        ("gpu", "float16", {}, "cudnn"),
        ("gpu", "float32", {}, None),
        ("gpu", "bfloat16", dict(sink=True), None),
        ("gpu", "bfloat16", dict(softcap=True), None),
    ],
)
def test_auto_picks_the_fused_kernel_the_platform_and_call_allow(plat, dtype, extra, want):
    assert backends.resolve("auto", plat, dtype, 64, **extra) == want


@pytest.mark.parametrize(
    "impl, plat, dtype, head_dim, extra, match",
    [
        ("cudnn", "tpu", "bfloat16", 64, {}, "needs an NVIDIA GPU"),
        ("cudnn", "gpu", "float32", 64, {}, "float32 compute"),
        ("cudnn", "gpu", "bfloat16", 12, {}, "head_dim=12"),
        ("cudnn", "gpu", "bfloat16", 64, dict(sink=True), "sink logits"),
        ("splash", "gpu", "bfloat16", 64, {}, "is a TPU kernel"),
        ("splash", "tpu", "bfloat16", 64, dict(devices=8), "runs on one device, but this process sees 8"),
    ],
)
def test_a_named_backend_that_cannot_run_is_refused(impl, plat, dtype, head_dim, extra, match):
    with pytest.raises(ConfigError, match=match):
        backends.resolve(impl, plat, dtype, head_dim, **extra)


@pytest.mark.parametrize(
    "impl, plat, dtype, extra, want",
    [
        ("auto", "cpu", "float32", {}, "auto on cpu: xla for training and forward passes without a cache; xla kernels"),
        ("auto", "gpu", "bfloat16", {}, "auto on gpu: cudnn for training"),
        ("auto", "gpu", "bfloat16", dict(attn_sink=True), "auto on gpu: xla for training"),
        ("auto", "tpu", "bfloat16", dict(attn_sink=True), "auto on tpu: splash for training"),
        ("splash", "cpu", "float32", {}, "splash (Pallas interpret mode: exact, slow) for training"),
        ("auto", "tpu", "bfloat16", dict(attention_mask="none"), "auto on tpu: xla for training"),
        ("dot_product_attention", "gpu", "bfloat16", {}, "dot_product_attention for training"),
    ],
)
def test_the_start_up_line_names_the_kernels_of_each_phase(impl, plat, dtype, extra, want):
    """What train and generate print once at start-up (backends.describe), per platform and config."""
    m = ModelConfig(num_heads=4, d_model=256, attention_impl=impl, dtype=dtype, **extra)
    assert want in backends.describe(m, plat, devices=1)
    assert "kernels for prefill and decode over the KV cache" in backends.describe(m, plat, devices=1)


ACCEL_CASES = {"causal": (0, False), "window-64": (64, False), "packed": (0, True)}


@pytest.mark.accelerator
@pytest.mark.parametrize("kv", [8, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("case", ACCEL_CASES)
def test_the_fused_backend_on_the_device_equals_the_reference_in_bf16(case, kv):
    """On a GPU (cuDNN) or TPU (splash, compiled): bf16 inputs, T=256, 8 heads of 64. The fused kernel's output and
    gradients against the float32 reference over the same bf16-rounded inputs: within 2e-2 (outputs, |v| ~ 1) and
    5e-2 (gradients), what bf16's 8-bit mantissa allows for weights and values rounded once more inside the kernel.
    Run by ./launch/device_check.sh (pytest -m accelerator)."""
    plat = backends.platform()
    if plat == "cpu":
        pytest.skip("no accelerator: JAX's default backend is the CPU (splash runs here in interpret mode instead)")
    name = "cudnn" if plat == "gpu" else "splash"
    window, segments = ACCEL_CASES[case]
    T, Nd, Hd = 256, 8, 64
    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.standard_normal((2, T, n, Hd)), jnp.bfloat16) for n in (Nd, kv, kv))
    seg = None
    if segments:
        s = np.ones((2, T), np.int32)
        s[0, 100:] = 2
        s[1, 200:] = 0
        seg = jnp.asarray(s)
    pos = segment_positions(seg) if segments else jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
    valid = jnp.ones((2, T), bool) if seg is None else seg != 0
    mask = AttentionMask(
        make_mask(pos, pos, valid, seg, seg, window=window or None),
        index_causal=True,
        windows=(window,),
        segment_ids=seg,
    )
    ct = jnp.asarray(r.standard_normal((2, T, Nd, Hd)), jnp.float32)
    scale = Hd**-0.5

    def loss(fn, dtype):
        def f(q, k, v):
            out = fn(q.astype(dtype), k.astype(dtype), v.astype(dtype), mask, scale=scale)
            return jnp.sum(out.astype(jnp.float32) * ct), out

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))

    (_, out), grads = loss(backends.KERNELS[name], jnp.bfloat16)(q, k, v)
    (_, ref), want = loss(lambda *a, **kw: kernels.reference_attention(*a, **kw)[0], jnp.float32)(q, k, v)
    # bfloat16 inputs carry up to 2^-8 relative error each (0.4%); the inputs are standard-normal draws of a fixed
    # seed (no training: the same on every CPU), so the bounds are a few of those units of the outputs' and
    # gradients' magnitude, with room for each kernel's own bf16 accumulation order
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=2e-2, rtol=0, err_msg=name)
    for g, w, what in zip(grads, want, "qkv", strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w), atol=5e-2, rtol=0, err_msg=f"d{what}")


def test_decode_over_copied_keys_runs_heads_major():
    """A decode step reads a cache in place (in_place_attention: no transpose of the stored layer), but K/V that were
    just gathered from pages (a paged cache: `keys_copied`) are laid out heads-major for free, and the batched
    matmuls then score each query head against its own KV head only: the dispatcher picks heads-major for them."""
    q, k, v = _qkv(1, 40, 2)
    mask = AttentionMask(jnp.ones((2, 1, 40), bool))
    assert kernels.select_kernel(q, k, mask) is kernels.in_place_attention
    assert kernels.select_kernel(q, k, mask, keys_copied=True) is kernels.heads_major_attention
    out, _ = kernels.attention(q, k, v, mask, scale=0.3, keys_copied=True)
    ref, _ = kernels.reference_attention(q, k, v, mask, scale=0.3)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=ATOL, rtol=0)
