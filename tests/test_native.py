"""The C++ kernel build (causal_lm/model/native.py): compiled with the machine's compiler, registered with XLA, called
under jit. CI machines have gcc, so there a missing compiler fails the test instead of skipping it."""

import os

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
