"""The C++ kernel build (causal_lm/model/native.py): compiled with the machine's compiler, registered with XLA, called
under jit. CI machines have gcc, so there a missing compiler fails the test instead of skipping it."""

import ctypes
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from causal_lm.model import native


def _need_compiler():
    if native.compiler() is None:
        if os.environ.get("CI"):
            pytest.fail("no C++ compiler on a CI machine: the native kernels cannot be tested")
        pytest.skip("no C++ compiler here")


def test_a_kernel_builds_registers_and_runs_under_jit():
    _need_compiler()
    assert native.available("example", ("causal_lm_affine",)), native.failure("example")
    call = jax.ffi.ffi_call("causal_lm_affine", jax.ShapeDtypeStruct((5,), jnp.float32))
    f = jax.jit(lambda x: call(x, a=np.float32(3.0), b=np.float32(-1.0)))
    x = jnp.arange(5, dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(f(x)), 3.0 * np.arange(5) - 1.0)
    assert list(native.cache_dir().glob("example-*.so")), "the built library is cached"


def test_kernels_can_be_turned_off_and_a_missing_source_is_an_error(monkeypatch):
    monkeypatch.setenv(native.ENV, "0")
    assert not native.enabled() and not native.available("example")
    monkeypatch.delenv(native.ENV)
    _need_compiler()
    assert not native.available("no_such_kernel")
    assert "no kernel source" in native.failure("no_such_kernel")


def test_the_kernel_libraries_share_one_set_of_pool_helpers():
    """The decode kernels' helpers linger in XLA's pool between calls (csrc/parallel.h); were each library's helpers
    its own, one library's would spin through the other's calls and take a core from them."""
    _need_compiler()
    from causal_lm.model import decode_attention, matvec, paged_cache

    libs = [
        native.library(matvec.NAME, matvec.TARGETS),
        native.library(decode_attention.NAME, decode_attention.TARGETS),
        native.library(paged_cache.PAGED_ATTENTION, (paged_cache.PAGED_ATTENTION_TARGET,)),
    ]
    addresses = []
    for lib in libs:
        lib.causal_lm_parallel_state.restype = ctypes.c_void_p
        addresses.append(lib.causal_lm_parallel_state())
    assert addresses[0] and len(set(addresses)) == 1, addresses


def test_kernel_calls_from_several_threads_at_once_each_get_their_own_result():
    """Calls running at the same time post their work to the same lingering helpers: each must still get exactly
    its own products (the sequential results, bit for bit)."""
    _need_compiler()
    from causal_lm.model import matvec

    assert matvec.usable(), native.failure(matvec.NAME)
    rng = np.random.default_rng(0)
    k = 1024
    w_host = rng.standard_normal((4096, k), np.float32)
    w = jnp.asarray(w_host)
    xs = [jnp.asarray(rng.standard_normal((1 + i % 3, k), np.float32)) for i in range(6)]
    f = jax.jit(lambda x: matvec.matvec_f32(x, w) * 2.0)  # the next operation reads the products at once
    expected = [np.asarray(f(x)) for x in xs]
    for x, e in zip(xs, expected, strict=True):
        np.testing.assert_allclose(e, 2.0 * (np.asarray(x, np.float64) @ w_host.T), rtol=1e-4, atol=1e-3)
    failures = []

    def worker(i):
        for _ in range(30):
            got = np.asarray(f(xs[i]))
            if not np.array_equal(got, expected[i]):
                failures.append(i)
                return

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
