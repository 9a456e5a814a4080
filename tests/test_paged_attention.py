"""Decode attention that reads the paged pool in place (causal_lm/model/csrc/decode_attention.cc's paged form through
`PagedKVCache.attend`) equals the XLA form: the rows' pages gathered by `update` and the reference kernel, under the
one mask function's mask. Ragged rows, partial last pages, missing pages, garbage in slots nobody may see, windows,
MHA/GQA/MQA, sinks, softcapping and int8 storage. CI machines have gcc: there a kernel that did not build fails."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from causal_lm.model import native
from causal_lm.model import paged_cache as pc
from causal_lm.model.kernels import reference_attention
from causal_lm.model.mask import AttentionMask, make_mask
from tests.variants import tiny_config

PS = 4  # page size
NP = 7  # pages a row's table reaches: 28 slots
PAGES = 48


def _need_kernel():
    if native.compiler() is None:
        if os.environ.get("CI"):
            pytest.fail("no C++ compiler on a CI machine: the paged attention kernel cannot be tested")
        pytest.skip("no C++ compiler here")
    assert native.available(pc.PAGED_ATTENTION, (pc.PAGED_ATTENTION_TARGET,)), native.failure(pc.PAGED_ATTENTION)


def _cache(config, storage, lengths, seed):
    """A pool of random K/V everywhere (so a slot read that the mask hides shows up), each row's pages a random
    permutation, slot positions filled up to the row's length (the rest of a last page empty), and row 1 with
    fewer pages than its table reaches (entries past them: no page)."""
    rng = np.random.default_rng(seed)
    pool = pc.init_pool(config, PAGES, PS, storage)
    B = len(lengths)
    table = rng.permutation(PAGES)[: B * NP].reshape(B, NP).astype(np.int32)
    positions = np.full((PAGES, PS), -1, np.int32)
    for b, n in enumerate(lengths):
        held = pc.pages_for(n + 1, PS)  # room for this step's token
        if b == 1:
            table[b, held:] = PAGES  # "no page" past what the row holds
        for j in range(held):
            for s in range(PS):
                if j * PS + s < n:
                    positions[table[b, j], s] = j * PS + s
    group = pool.groups[0]
    arrays = {}
    for name, a in group.arrays.items():
        if name.endswith("_scale"):
            arrays[name] = jnp.asarray(rng.uniform(0.01, 0.05, a.shape), jnp.float32)
        elif a.dtype == jnp.int8:
            arrays[name] = jnp.asarray(rng.integers(-127, 128, a.shape), jnp.int8)
        else:
            arrays[name] = jnp.asarray(rng.standard_normal(a.shape), a.dtype)
    group = pc.PageGroup(arrays=arrays, positions=jnp.asarray(positions), window=group.window, layers=group.layers)
    pool = pc.PagePool(groups=(group,), names=pool.names, storage=pool.storage)
    return pool.view(table[None], np.asarray(lengths, np.int32), np.full((1, 1), PAGES, np.int32))


@functools.partial(jax.jit, static_argnums=(5, 6, 7))
def _attend_both(cache, valid, q, new, sinks, layer, window, softcap):
    """One program: the kernel's attention and the XLA form's (the pages gathered by `update`, the reference)."""
    plan = cache.plan_write(valid)
    kp = cache.key_positions(0, plan)
    visible = make_mask(plan.query_positions, kp, kp >= 0, window=window or None)
    scale = 0.7 * q.shape[-1] ** -0.5
    got = cache.write(layer, new, plan).attend(layer, q, visible, scale=scale, sink=sinks, softcap=softcap)
    _, kv = cache.update(layer, new, plan)
    want, _ = reference_attention(q, kv["k"], kv["v"], AttentionMask(visible), scale=scale, sink=sinks, softcap=softcap)
    return got, want, visible


def _both(config, storage, lengths, T, *, window=0, sink=False, softcap=None, layer=1, seed=0):
    """(kernel output, XLA output) for T new tokens per row written into layer `layer`, then attended."""
    rng = np.random.default_rng(seed + 1)
    cache = _cache(config, storage, lengths, seed)
    B, N, K, H = len(lengths), config.num_heads, config.num_kv_heads, config.head_dim
    valid = np.ones((B, T), bool)
    valid[-1, 1:] = False  # a right-padded row
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    new = {n: jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.float32) for n in ("k", "v")}
    sinks = jnp.asarray(rng.standard_normal(N), jnp.float32) if sink else None
    assert cache.attends_in_place(q)
    got, want, visible = _attend_both(cache, jnp.asarray(valid), q, new, sinks, layer, window, softcap)
    return np.asarray(got), np.asarray(want), np.asarray(visible)


@pytest.mark.parametrize(("kv", "storage"), [("gqa", "float32"), ("mha", "int8"), ("mqa", "float32")])
def test_kernel_equals_gathered_xla_attention(kv, storage):
    _need_kernel()
    # head dim 10: the kernel's 4-wide dot product and its tail; rows of 0, 3 (row 1: few pages), 13, 16 (a full
    # last page), 22 cached tokens; one decode token, and a 3-token chunk whose last row is padding
    config = tiny_config(kv, d_model=40)
    for T in (1, 3):
        got, want, visible = _both(config, storage, [0, 3, 13, 16, 22], T)
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
        assert visible.any(-1).all()  # every query sees something: no row is trivially zero


def test_kernel_equals_xla_with_windows_sinks_and_softcap():
    _need_kernel()
    config = tiny_config("gqa", d_model=40)
    lengths = [5, 3, 19, 24]
    got, want, visible = _both(config, "float32", lengths, 1, window=6, seed=3)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
    assert visible.sum(-1).max() == 6  # the window hides the older keys
    got, want, _ = _both(config, "float32", lengths, 2, sink=True, seed=4)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
    got, want, _ = _both(config, "int8", lengths, 1, softcap=1.5, layer=0, seed=5)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)


def test_a_row_that_sees_nothing_gets_zeros():
    _need_kernel()
    config = tiny_config("gqa", d_model=40)
    cache = _cache(config, "float32", [4, 9], 0)
    q = jnp.ones((2, 1, 4, 10), jnp.float32)
    out = cache.attend(0, q, jnp.zeros((2, 1, NP * PS), bool), scale=0.3)
    np.testing.assert_array_equal(np.asarray(out), 0.0)


def test_the_paged_decode_step_uses_the_kernel_and_its_fallbacks_do_not(monkeypatch):
    """The decoder's one-token call over a paged cache calls the kernel (in the lowered program); asked for the
    weights, for the batch-invariant mode, or with `CAUSAL_LM_NATIVE=0` it gathers the pages instead. (That the
    engine's tokens are unchanged with the kernel is tests/test_engine.py's churn tests.)"""
    _need_kernel()
    from causal_lm.model.transformer import build_model

    config = tiny_config("gqa")
    model = build_model(config, seed=0)
    pool = pc.init_pool(config, 16, PS)
    table = np.arange(2 * NP, dtype=np.int32).reshape(1, 2, NP)
    lengths, none = np.full(2, 9, np.int32), np.full((1, 1), 16, np.int32)
    tokens = jnp.zeros((2, 1), jnp.int32)

    def calls_kernel(**kw):
        def step(pool):  # a new function each time: nothing traced before is reused
            return model.forward(tokens, cache=pool.view(table, lengths, none), **kw).logits

        return pc.PAGED_ATTENTION_TARGET in jax.jit(step).lower(pool).as_text()

    assert calls_kernel()
    assert not calls_kernel(return_weights=True)
    assert not calls_kernel(batch_invariant=True)
    monkeypatch.setenv(native.ENV, "0")
    assert not calls_kernel()


def _paged_call(q, k, v, k_scale, v_scale, layer, table, visible, sink, scale, softcap):
    """The kernel called as `PagedKVCache.attend` calls it, on a pool built by hand."""
    B, T, N, _ = q.shape
    call = jax.ffi.ffi_call(pc.PAGED_ATTENTION_TARGET, jax.ShapeDtypeStruct((B, T, N, v.shape[-1]), jnp.float32))
    return call(
        q,
        k,
        v,
        k_scale,
        v_scale,
        jnp.asarray(layer, jnp.int32),
        table,
        visible,
        jnp.zeros((N,), jnp.float32) if sink is None else sink,
        scale=np.float32(scale),
        softcap=np.float32(softcap or 0.0),
        has_sink=np.int32(sink is not None),
    )


@pytest.mark.parametrize("storage", ["float32", "int8"])
def test_paged_rows_have_the_bits_of_the_contiguous_kernel(storage):
    """The paged kernel is the contiguous decode kernel (`decode_attention.attend`, what `generate` runs) over each
    row's slot view: a row's output has the same bits as the same row in a contiguous cache holding its view's
    (dequantized) entries, so the engine's decode steps compute what `generate`'s do. Pages of 12 slots, so the
    kernel's 128-slot chunks end inside pages; head dim 64 (the vector paths); a missing page (zeros); a prefix, a
    window that starts mid-page and a short row; two queries that see different slots; sinks and softcapping."""
    _need_kernel()
    from causal_lm.model import decode_attention as da

    rng = np.random.default_rng(7)
    L, P, ps, NP, B, T, K, G, H = 2, 80, 12, 25, 3, 2, 3, 3, 64
    C, N = NP * ps, K * G
    if storage == "int8":
        k = rng.integers(-127, 128, (L, P, ps, K, H)).astype(np.int8)
        v = rng.integers(-127, 128, (L, P, ps, K, H)).astype(np.int8)
        ks, vs = (rng.uniform(0.01, 0.05, (L, P, ps, K)).astype(np.float32) for _ in range(2))
        kf, vf = k.astype(np.float32) * ks[..., None], v.astype(np.float32) * vs[..., None]
    else:
        kf = k = rng.standard_normal((L, P, ps, K, H)).astype(np.float32)
        vf = v = rng.standard_normal((L, P, ps, K, H)).astype(np.float32)
        ks = vs = np.zeros((1,), np.float32)
    table = rng.permutation(P)[: B * NP].reshape(B, NP).astype(np.int32)
    table[0, [3, 13]] = P  # missing pages inside row 0's visible range, in its first and second chunks
    j = np.arange(C)
    visible = np.zeros((B, T, C), bool)
    visible[0] = j < np.array([[250], [251]])
    visible[1] = (j >= np.array([[101], [104]])) & (j < 290)
    visible[2] = j < np.array([[7], [6]])
    kc, vc = np.zeros((L, B, C, K, H), np.float32), np.zeros((L, B, C, K, H), np.float32)
    for b in range(B):
        for s in range(C):
            page = table[b, s // ps]
            if page < P:
                kc[:, b, s], vc[:, b, s] = kf[:, page, s % ps], vf[:, page, s % ps]
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    for sink, softcap in ((None, None), (jnp.asarray(rng.standard_normal(N), jnp.float32), 2.0)):
        args = (jnp.asarray(visible), sink, 0.125, softcap)
        got = jax.jit(_paged_call, static_argnums=(9, 10))(q, k, v, ks, vs, 1, jnp.asarray(table), *args)
        contiguous = jax.jit(functools.partial(da.attend, layer=1, scale=0.125, softcap=softcap))
        want = contiguous(q, jnp.asarray(kc), jnp.asarray(vc), visible=args[0], sink=sink)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert np.abs(np.asarray(got)).max() > 0.01  # not trivially zero
