"""Decode-shaped products through the C++ matrix-vector kernels (`csrc/matvec.cc`, built by `native.py`).

A decode step multiplies one activation row per sequence (a few rows in all) by every weight; XLA:CPU reads float32
weights at 8-9 GB/s there and has no product that reads int8/int4 weights as such (docs/performance.md). The kernels
read each weight once for all rows (up to `MAX_ROWS`), output-major (each output's weights one contiguous run),
split across XLA's intra-op threads by blocks of outputs. Each output's sum runs in one fixed order whatever the
number of rows or threads (`csrc/matvec.cc` says which), so a row's result does not depend on its batch.

The weights reach them in the decode form (`Decoder.split_layers(native=True)`, what `generate`, speculative
decoding, the engine and `bench decode` slice once per program): on a CPU with the kernels built, each projection
weight is stored there output-major, float32 as an `OutMajor` (this module), int8/int4 as a `QArray` with
`major="out"` (quant.py). A float32 or int8 weight of N outputs and K inputs is stored tiled where 4 divides N and
one 64-byte line of inputs (16 float32, 64 int8) divides K, [N/4, K/L, 4, L] (`tile`): tiles of 4 outputs x L
inputs, each output's L inputs one line, so a block of 4 outputs is one stream of addresses instead of 4 (the 135M
shape's products, Zen 5, 2 threads: float32 40 -> 48 GB/s, 58 -> 77 in a quiet minute, int8 43 -> 51:
docs/performance.md); else [N, K]. int4 keeps [N, G, g/2]. Tiles are only for a decode form whose products all go
to the kernels (`split_layers(rows=...)` of at most `MAX_ROWS`: `generate`'s decode loop, the engine's calls of at
most that many token slots): XLA's product over them (more rows than the kernels take) is 1.2-5x slower than over
[N, K], so the engine's longer prompt chunks run on the model's stacked weights instead. The copy `split_layers`
makes anyway is made in this layout. The head is the exception: `DecodeLayers.head` holds a copy in
the kernels' layout of a head stored otherwise, a quantized model's (stored input-major) and, in tiles, a tied
float32 table [V, D] (V x D x 4 bytes more while decoding, 113 MB for the 135M shape, for a head read 1.3x faster;
untiled, the table is read in place).

Used only where `native_products()` is on (the decoder sets it for a forward pass over a cache, i.e. decoding,
outside the batch-invariant scoring mode), on the CPU backend, with the kernels built (`native.available`), for
float32 products of at most `MAX_ROWS` rows. Everything else (prefill, training, other backends and dtypes,
`CAUSAL_LM_NATIVE=0`, no compiler) keeps the XLA form; an output-major weight met there is multiplied by XLA
(`x @ w.T`). The kernel calls have a `custom_vjp` whose backward is the XLA product, so a gradient traced through
a decode step still works.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from causal_lm.model import native

NAME = "matvec"
TARGETS = ("causal_lm_matvec_f32", "causal_lm_matvec_i8", "causal_lm_matvec_i4", "causal_lm_matvec_i4m")
MAX_ROWS = 16


def usable() -> bool:
    """Whether the kernels can be used in this process: CPU backend, built, not turned off."""
    return native.enabled() and native.on_cpu() and native.available(NAME, TARGETS)


def applies(rows: int, *dtypes) -> bool:
    """Whether a product of `rows` rows with operands of these dtypes can go to the kernels."""
    return 1 <= rows <= MAX_ROWS and all(jnp.dtype(d) == jnp.float32 for d in dtypes) and usable()


_native = threading.local()


@contextlib.contextmanager
def native_products(on: bool = True):
    """While tracing inside this context, float32 products of at most `MAX_ROWS` rows with the decode form's
    output-major weights (and the tied head) run through the kernels when they are usable here. The decoder sets it
    for a forward pass over a cache (decoding) outside the batch-invariant mode, whose row-at-a-time XLA products
    the RL trainer's scoring must match bit for bit; it is read when a function is traced, never at run time."""
    before = getattr(_native, "on", False)
    _native.on = bool(on)
    try:
        yield
    finally:
        _native.on = before


def native_on() -> bool:
    """Whether the code being traced is inside `native_products()` (a decode step outside the scoring mode)."""
    return getattr(_native, "on", False)


def native_here(rows: int, *dtypes) -> bool:
    """Whether a product of `rows` rows with operands of these dtypes goes to the kernels now."""
    return getattr(_native, "on", False) and applies(rows, *dtypes)


def _call(target: str, rows: int, n: int, *args):
    native.library(NAME, TARGETS)  # built and registered (once); NativeError if it cannot be
    out = jax.ShapeDtypeStruct((rows, n), jnp.float32)
    return jax.ffi.ffi_call(target, out, vmap_method="sequential")(*args)


TILE_OUT, TILE_BYTES = 4, 64  # a tile: 4 outputs x one 64-byte line of inputs each (16 float32, 64 int8)


def tile_inputs(dtype=jnp.float32) -> int:
    """How many inputs of one output a tile holds: one 64-byte line of them."""
    return TILE_BYTES // jnp.dtype(dtype).itemsize


def tiles(n: int, k: int, dtype=jnp.float32) -> bool:
    """Whether a float32 (or int8) weight of n outputs and k inputs is stored tiled."""
    return n % TILE_OUT == 0 and k % tile_inputs(dtype) == 0


def tile(t):
    """An output-major float32 or int8 weight t [N, K] in the kernels' tiles [N/4, K/L, 4, L] (L = 16 float32, 64
    int8 inputs) where they divide it, else t."""
    n, k = t.shape
    if not tiles(n, k, t.dtype):
        return t
    li = tile_inputs(t.dtype)
    return t.reshape(n // TILE_OUT, TILE_OUT, k // li, li).transpose(0, 2, 1, 3)


def untile(t):
    """The output-major weight [N, K] of a tiled t (`tile`); an [N, K] t itself."""
    if t.ndim == 2:
        return t
    nb, kb, to, ti = t.shape
    return t.transpose(0, 2, 1, 3).reshape(nb * to, kb * ti)


def _outputs(w) -> int:
    return w.shape[0] * (TILE_OUT if w.ndim == 4 else 1)


@jax.custom_vjp
def matvec_f32(x, w):
    """x [R, K] float32 times w float32, output-major [N, K] or tiled [N/4, K/16, 4, 16] (`tile`) -> [R, N] = x @
    w.T, R <= MAX_ROWS. Either layout gives the same bits."""
    return _call("causal_lm_matvec_f32", x.shape[0], _outputs(w), x, w)


def _f32_fwd(x, w):
    return matvec_f32(x, w), (x, w)


def _f32_bwd(res, g):
    x, w = res
    dw = g.T @ x
    return g @ untile(w), dw if w.ndim == 2 else tile(dw)


matvec_f32.defvjp(_f32_fwd, _f32_bwd)


def dequantize_out_major(data, scale, minimum, bits: int):
    """The float weight [N, K] of output-major quantized arrays (int8 data [N, K] or its tiles, int4 data [N, G,
    g/2]; scale, minimum [N, G])."""
    n, groups = scale.shape
    if bits == 8:
        return (untile(data).reshape(n, groups, -1).astype(jnp.float32) * scale[:, :, None]).reshape(n, -1)
    nib = jnp.concatenate([data & 15, data >> 4], axis=2).astype(jnp.float32)  # [N, G, g]
    off = -8.0 * scale if minimum is None else minimum
    return (nib * scale[:, :, None] + off[:, :, None]).reshape(n, -1)


@jax.custom_vjp
def matvec_quantized(x, data, scale, minimum):
    """x [R, K] float32 times an output-major quantized weight -> [R, N] float32, R <= MAX_ROWS. int8: data [N, K]
    int8 or its tiles [N/4, K/64, 4, 64] (`tile`); int4: data [N, G, g/2] uint8 (quant.py's nibble order within a
    group); scale / minimum [N, G]."""
    rows, n = x.shape[0], scale.shape[0]
    if data.dtype == jnp.int8:
        return _call("causal_lm_matvec_i8", rows, n, x, data, scale)
    if minimum is None:
        return _call("causal_lm_matvec_i4", rows, n, x, data, scale)
    return _call("causal_lm_matvec_i4m", rows, n, x, data, scale, minimum)


def _q_fwd(x, data, scale, minimum):
    return matvec_quantized(x, data, scale, minimum), (x, data, scale, minimum)


def _q_bwd(res, g):
    x, data, scale, minimum = res
    w = dequantize_out_major(data, scale, minimum, 8 if data.dtype == jnp.int8 else 4)
    # The stored arrays get no gradient (quantized weights are not trained: quant.py); integers take float0.
    zero = None if minimum is None else jnp.zeros_like(minimum)
    return g @ w, np.zeros(data.shape, jax.dtypes.float0), jnp.zeros_like(scale), zero


matvec_quantized.defvjp(_q_fwd, _q_bwd)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OutMajor:
    """A float32 weight of logical shape in_shape + out_shape stored output-major as t [prod(out), prod(in)], tiled
    where the tiles divide it (`tile`; the decode form's layout for the kernels). `project` multiplies it (`matmul`);
    `astype(float32)` is itself."""

    t: jax.Array
    in_shape: tuple = dataclasses.field(metadata=dict(static=True))
    out_shape: tuple = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple:
        return self.in_shape + self.out_shape

    @property
    def dtype(self):
        return self.t.dtype

    def astype(self, dtype) -> OutMajor:
        if jnp.dtype(dtype) != self.t.dtype:
            raise TypeError(f"an output-major decode weight is {self.t.dtype}; the layer asked for {dtype}")
        return self

    def matmul(self, x, n_in: int, preferred_element_type=None):
        lead = x.shape[: x.ndim - n_in]
        K = math.prod(self.in_shape)
        x2 = x.reshape(-1, K)
        out = jnp.dtype(preferred_element_type or self.t.dtype)
        if out == jnp.float32 and native_here(x2.shape[0], x.dtype, self.t.dtype):
            y = matvec_f32(x2, self.t)
        elif self.t.ndim == 4:  # tiled: y[r, n/4, n%4] = sum over (k/16, k%16), one dot without a copy of t
            nb, kb, to, ti = self.t.shape
            dims = (((1, 2), (1, 3)), ((), ()))
            y = jax.lax.dot_general(x2.reshape(-1, kb, ti), self.t, dims, preferred_element_type=preferred_element_type)
            y = y.reshape(-1, nb * to)
        else:
            y = jnp.matmul(x2, self.t.T, preferred_element_type=preferred_element_type)
        return y.reshape(lead + self.out_shape)


def out_major(w, n_in: int, tiled: bool = False) -> OutMajor:
    """The float weight w [*in, *out] as an OutMajor, in tiles where they divide it if `tiled`."""
    in_shape, out_shape = tuple(w.shape[:n_in]), tuple(w.shape[n_in:])
    t = jnp.asarray(w).reshape(math.prod(in_shape), -1).T
    return OutMajor(tile(t) if tiled else t, in_shape, out_shape)


def project_table(x, table):
    """x [..., K] @ table [N, K]^T through the kernel -> [..., N] float32 (a tied head, read in place)."""
    y = matvec_f32(x.reshape(-1, x.shape[-1]), table)
    return y.reshape(x.shape[:-1] + (table.shape[0],))


class OutMajorWeight(nnx.Module):
    """What replaces a float projection weight's nnx.Param in the decode form: `t` [prod(out), prod(in)] or its tiles
    (`tile`); `self.w[...]` gives the OutMajor that `project` multiplies."""

    def __init__(self, w, n_in: int, tiled: bool = False):
        o = out_major(w, n_in, tiled)
        self.t = nnx.Param(o.t)
        self.in_shape, self.out_shape = o.in_shape, o.out_shape

    def __getitem__(self, index):
        if index is not Ellipsis:
            raise TypeError("a decode-form weight is read whole: w[...]")
        return OutMajor(self.t[...], self.in_shape, self.out_shape)
