"""Weight-only quantization: projection, MLP and embedding/output weights held as int8 or int4 plus float scales.

A weight w [*in, *out] is stored flat as [NI, NO] (NI = prod(in), NO = prod(out)) in groups of g consecutive inputs,
G = NI / g groups per output column:

    int8:  q int8 [NI, NO],            scale [G, NO]:  w = q * scale             (g = NI: one scale per output channel)
    int4:  p uint8 [G, g/2, NO],      scale [G, NO]:  w = (nibble - 8) * scale  (symmetric, GGUF's Q4_0)
                                     minimum [G, NO]: w = nibble * scale + minimum  (with minimums, GGUF's Q4_1)

Two 4-bit values share a byte the way GGUF packs a block: byte j of a group holds input j in its low nibble and
input j + g/2 in its high nibble. GGUF's Q8_0 is int8 with g = 32 (blocks of 32 along the input).

The product reads the quantized bytes. For a few rows (decoding: batch x one token) it is a multiply-and-reduce
over each block, y[r, o] = sum_G scale[G, o] * sum_{i in G} x[r, i] * q[i, o], which XLA fuses into one loop that
reads the int8/uint8 array and never writes a float copy of the weight (the compiled program's bytes accessed
show it; tests/test_quant.py checks). For many rows (prefill, training-shaped calls) the weight is dequantized
once per call and multiplied by a float matmul: there the matmul's arithmetic, not the weight's bytes, dominates.
Measured on a 2-core Zen 4 (XLA:CPU, 576 x 1536, one row): float32 matmul 133 us; this blocked reduce 450 us
reading 0.9 MB; int8 activations with an int32-accumulating dot 384 us but 8.0 MB accessed (XLA:CPU widens the
int8 operands before its dot); dequantize + float dot 318 us, 8.0 MB. No int8 path beats the float dot on XLA:CPU,
so the blocked reduce is kept for what it reads (memory, and the bytes that a faster backend would make time).

`quantize(model, "int8" | "int4", group_size=...)` returns a new model whose config records the format
(`model.weights`, `model.weights_group_size`, `model.weights_minimums`), so a checkpoint of it rebuilds the same
structure (`build_model` quantizes a freshly initialised model, then the checkpoint's arrays replace its arrays).
The attention layers, MLP, decoder, cache, `generate` and speculative decoding run unchanged: the layers read
`self.w[...]`, which for a quantized weight is a `QArray` that `project` (layers.py) multiplies. Training stays
float: quantize a trained model.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from causal_lm.model import matvec

FORMATS = ("int8", "int4")
WEIGHTS = ("float32",) + FORMATS  # model.weights: float32 = the unquantized parameters (in model.param_dtype)
DEFAULT_GROUP = {"int8": 0, "int4": 32}  # 0: one group over the whole input (int8 per output channel)
# Rows up to this many take the blocked reduce (decode); more take dequantize + matmul (prefill).
REDUCE_MAX_ROWS = 16
BLOCK = 32  # inputs per partial sum of the decode product
# Outputs beyond this many (the output head: 49,152 on the 135M shape) take dequantize + matmul at decode too:
# XLA:CPU's fused reduce over a [576, 49152] int8 head takes 550 ms (88 ms stored transposed) against the float
# matmul's 7 ms, so the head's bytes are read as float there.
WIDE_OUT = 8192

# Which parameters of which modules are quantized, and how many leading dims are inputs (`project`'s n_in).
# MLA's wk_b / wv_b stay float: they are contracted over a non-leading dim (absorbed attention) and are small.
QUANTIZED = {
    "Attention": {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "wg": 1},
    "MLAttention": {"wq": 1, "wq_a": 1, "wq_b": 1, "wkv_a": 1, "wo": 2, "wg": 1},
    "MLP": {"w_gate": 1, "w_up": 1, "w_down": 1},
}


class QuantizeError(ValueError):
    """A quantization format or group size that cannot be applied to these weights."""


def check_format(weights: str, group_size: int | None = None) -> int:
    """The group size to use for `weights` (one of FORMATS); QuantizeError (one line) for a bad request."""
    if weights not in FORMATS:
        raise QuantizeError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    g = DEFAULT_GROUP[weights] if group_size is None else group_size
    if not isinstance(g, (int, np.integer)) or isinstance(g, bool) or g < 0:
        raise QuantizeError(f"group_size must be a non-negative integer, got {group_size!r}")
    if weights == "int4" and (g == 0 or g % 2):
        raise QuantizeError(f"int4 needs an even group_size > 0 (32, 64, 128), got {g}")
    return int(g)


# ---- the array view the layers multiply -----------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QArray:
    """A quantized weight of logical shape in_shape + out_shape, as the layers see it (`self.w[...]`).

    data: int8 [NI, NO] (int8) or uint8 [G, g/2, NO] (int4); scale / minimum: [G, NO] float32."""

    data: jax.Array
    scale: jax.Array
    minimum: jax.Array | None
    bits: int = dataclasses.field(metadata=dict(static=True))
    group: int = dataclasses.field(metadata=dict(static=True))
    in_shape: tuple = dataclasses.field(metadata=dict(static=True))
    out_shape: tuple = dataclasses.field(metadata=dict(static=True))
    dtype: str = dataclasses.field(default="float32", metadata=dict(static=True))  # the compute dtype
    # "in": the storage above; "out": output-major for the C++ decode kernels (matvec.py): int8 data [NO, NI] or
    # its tiles [NO/4, NI/64, 4, 64] (`matvec.tile`, where they divide it), int4 data [NO, G, g/2] (the same bytes per
    # group), scale / minimum [NO, G]
    major: str = dataclasses.field(default="in", metadata=dict(static=True))

    @property
    def shape(self) -> tuple:
        return self.in_shape + self.out_shape

    @property
    def size_in(self) -> int:
        return math.prod(self.in_shape)

    @property
    def size_out(self) -> int:
        return math.prod(self.out_shape)

    def astype(self, dtype) -> QArray:
        """The same bytes; products computed in `dtype` (the layers' `w[...].astype(dt)`)."""
        return dataclasses.replace(self, dtype=jnp.dtype(dtype).name)

    def out_major(self, tiled: bool = False) -> QArray:
        """The same values stored output-major (the decode form for the C++ kernels), int8 in tiles if `tiled`."""
        if self.major == "out":
            return self
        if self.bits == 8:  # [NO, NI], maybe in tiles
            data = matvec.tile(self.data.T) if tiled else self.data.T
        else:  # [NO, G, g/2]
            data = jnp.transpose(self.data, (2, 0, 1))
        minimum = None if self.minimum is None else self.minimum.T
        return dataclasses.replace(self, data=data, scale=self.scale.T, minimum=minimum, major="out")

    def in_major(self) -> QArray:
        """The same values in the storage of the module docstring."""
        if self.major == "in":
            return self
        data = matvec.untile(self.data).T if self.bits == 8 else jnp.transpose(self.data, (1, 2, 0))
        minimum = None if self.minimum is None else self.minimum.T
        return dataclasses.replace(self, data=data, scale=self.scale.T, minimum=minimum, major="in")

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The float weight [*in, *out] these bytes stand for (exactly the formula in the module docstring)."""
        if self.major == "out":
            return self.in_major().dequantize(dtype)
        NI, NO, g = self.size_in, self.size_out, self.group
        scale = self.scale[:, None, :]  # [G, 1, NO]
        if self.bits == 8:
            w = self.data.reshape(NI // g, g, NO).astype(jnp.float32) * scale
        else:
            w = _nibbles(self.data) * scale + (-8.0 * scale if self.minimum is None else self.minimum[:, None, :])
        return w.reshape(self.shape).astype(dtype)

    def matmul(self, x, n_in: int, preferred_element_type=None):
        """x [..., *in] @ w -> [..., *out], reading the quantized bytes (see the module docstring)."""
        if n_in != len(self.in_shape) or tuple(x.shape[x.ndim - n_in :]) != self.in_shape:
            raise ValueError(f"cannot multiply x {x.shape} by a quantized weight of shape {self.shape} (n_in={n_in})")
        out_dtype = preferred_element_type or jnp.dtype(self.dtype)
        lead = x.shape[: x.ndim - n_in]
        NI, NO, g = self.size_in, self.size_out, self.group
        rows = math.prod(lead)
        x2 = x.reshape(rows, NI)
        if self.major == "out":  # the decode form (matvec.py): the C++ kernel reads the stored bytes
            if jnp.dtype(out_dtype) == jnp.float32 and matvec.native_here(rows, x.dtype, self.dtype):
                y = matvec.matvec_quantized(x2.astype(jnp.float32), self.data, self.scale, self.minimum)
                return y.reshape(lead + self.out_shape)
            return self.in_major().matmul(x, n_in, preferred_element_type)
        if rows > REDUCE_MAX_ROWS or NO > WIDE_OUT:
            y = jnp.matmul(
                x2.astype(self.dtype), self.dequantize(self.dtype).reshape(NI, NO), preferred_element_type=out_dtype
            )
            return y.reshape(lead + self.out_shape)
        # Products of one activation by several weights of one shape (k and v, gate and up) would broadcast it
        # identically; XLA merges the identical broadcasts and writes the merged [R, NI, NO] float array out for its
        # consumers: more bytes than the weights. Adding 0 * (a byte of this weight) (not folded: 0 * x is not 0
        # for a float NaN) makes each product's broadcast its own, fused into its reduce.
        x2 = x2.astype(jnp.float32) + 0.0 * self.data.reshape(-1)[0].astype(jnp.float32)
        # Reduced in blocks of 32 inputs (b), then the blocks of each group summed: one reduce over a whole long
        # group (int8 per channel: g = NI) runs 10x slower on XLA:CPU than a blocked one.
        b = BLOCK if g % BLOCK == 0 else g
        xf = x2.reshape(rows, NI // g, g)  # [R, G, g]
        if self.bits == 8:
            q = self.data.reshape(NI // b, b, NO).astype(jnp.float32)
            part = jnp.sum(x2.reshape(rows, NI // b, b)[:, :, :, None] * q[None], axis=2)  # [R, NI / b, NO]
            part = part.reshape(rows, NI // g, g // b, NO).sum(axis=2)  # [R, G, NO]
        else:
            # Unpacked to [G, g, NO] int8 nibbles, then one multiply-and-reduce as for int8. XLA:CPU writes the
            # unpacked nibbles out (1 byte per weight) before the product: its dot-like fusion of convert, multiply
            # and reduce does not take bitwise ops or a concatenate in (every other arrangement tried, two products
            # per byte, float arithmetic for the nibbles, read more). So an int4 step reads the packed half byte,
            # then writes and reads one byte per weight: fewer bytes than float32, more than int8.
            nib = _nibbles(self.data, jnp.int8)  # [G, g, NO]
            part = jnp.sum(xf[:, :, :, None] * nib.astype(jnp.float32)[None], axis=2)  # [R, G, NO]
        y = jnp.sum(part * self.scale[None], axis=1)  # [R, NO]
        if self.bits == 4:  # the nibbles' offset: -8 * scale (symmetric) or + minimum, times each group's sum of x
            xs = jnp.sum(xf, axis=2)[:, :, None]  # [R, G, 1]
            offset = -8.0 * self.scale if self.minimum is None else self.minimum
            y = y + jnp.sum(xs * offset[None], axis=1)
        return y.astype(out_dtype).reshape(lead + self.out_shape)

    # The tied embedding: the decoder reads `embed[...]` as a [V, D] table and `embed[...].T` as the [D, V] head.
    # A quantized embedding is stored as the head (input D, output V, groups along D), flagged by `EmbedQArray`.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EmbedQArray(QArray):
    """A quantized embedding table [V, D] stored as its output head [D, V] (groups along D): rows are looked up
    with `lookup`, and `.T` is the head that `project` multiplies."""

    @property
    def shape(self) -> tuple:
        return self.out_shape + self.in_shape

    @property
    def T(self) -> QArray:
        return QArray(
            self.data, self.scale, self.minimum, self.bits, self.group, self.in_shape, self.out_shape, self.dtype
        )

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The float table [V, D]."""
        return self.T.dequantize(dtype).T

    def lookup(self, tokens) -> jax.Array:
        """Rows `tokens` [...] of the [V, D] table -> [..., D], dequantizing only those columns of the head."""
        D, g = self.size_in, self.group
        flat = jnp.reshape(tokens, (-1,))
        scale = self.scale[:, flat][:, None, :]  # [G, 1, n]
        if self.bits == 8:
            w = self.data.reshape(D // g, g, -1)[:, :, flat].astype(jnp.float32) * scale
        else:
            w = _nibbles(self.data[:, :, flat]) * scale + (
                -8.0 * scale if self.minimum is None else self.minimum[:, flat][:, None, :]
            )
        return w.reshape(D, -1).T.reshape(jnp.shape(tokens) + (D,)).astype(self.dtype)

    def __getitem__(self, tokens):
        return self.lookup(tokens)


def _nibbles(p, dtype=jnp.float32):
    """uint8 [G, g/2, n] -> [G, g, n] in dtype: the low nibbles (inputs 0..g/2-1), then the high ones."""
    return jnp.concatenate([p & 15, p >> 4], axis=1).astype(dtype)


# ---- quantizing arrays --------------------------------------------------------------------------------------


def quantize_array(w, bits: int, group: int, minimums: bool = False) -> tuple:
    """w [NI, NO] float -> (data, scale, minimum or None), the storage described in the module docstring.

    int8: scale = max|w| / 127 per group, q = round(w / scale) (|error| <= scale / 2).
    int4 symmetric: scale = max|w| / 7, nibble = round(w / scale) + 8 in 1..15 (|error| <= scale / 2).
    int4 with minimums: scale = (max - min) / 15, minimum = min, nibble = round((w - min) / scale) in 0..15."""
    w = jnp.asarray(w, jnp.float32)
    NI, NO = w.shape
    wg = w.reshape(NI // group, group, NO)  # [G, g, NO]
    minimum = None
    if bits == 8 or not minimums:
        levels = 127.0 if bits == 8 else 7.0
        scale = jnp.max(jnp.abs(wg), axis=1) / levels  # [G, NO]
        safe = jnp.where(scale > 0, scale, 1.0)[:, None, :]
        q = jnp.clip(jnp.round(wg / safe), -levels, levels)
        if bits == 8:
            return q.astype(jnp.int8).reshape(NI, NO), scale, None
        nib = (q + 8).astype(jnp.uint8)
    else:
        lo, hi = jnp.min(wg, axis=1), jnp.max(wg, axis=1)
        scale = (hi - lo) / 15.0
        safe = jnp.where(scale > 0, scale, 1.0)[:, None, :]
        nib = jnp.clip(jnp.round((wg - lo[:, None, :]) / safe), 0, 15).astype(jnp.uint8)
        minimum = lo
    h = group // 2
    data = nib[:, :h, :] | (nib[:, h:, :] << 4)  # [G, g/2, NO]
    return data, scale, minimum


# ---- the module that holds a quantized weight ------------------------------------------------------------------


class QuantizedWeight(nnx.Module):
    """What replaces a weight's nnx.Param in a quantized model: the stored arrays (`data`, `scale`, and `minimum`
    for int4 with minimums) as parameters, any leading stacked-layer axis first. `self.w[...]` gives the QArray."""

    def __init__(self, data, scale, minimum, *, bits, group, in_shape, out_shape, embed=False, major="in"):
        self.major = major
        self.data = nnx.Param(data)
        self.scale = nnx.Param(scale)
        if minimum is not None:
            self.minimum = nnx.Param(minimum)
        self.bits, self.group, self.embed = bits, group, embed
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)

    def __getitem__(self, index):
        if index is not Ellipsis:
            raise TypeError("a quantized weight is read whole: w[...]")
        minimum = self.minimum[...] if hasattr(self, "minimum") else None
        cls = EmbedQArray if self.embed else QArray
        major = getattr(self, "major", "in")
        return cls(
            self.data[...], self.scale[...], minimum, self.bits, self.group, self.in_shape, self.out_shape, major=major
        )

    def out_major(self, tiled: bool = False) -> QuantizedWeight:
        """This weight stored output-major (QArray.out_major): the decode form for the C++ kernels (matvec.py)."""
        q = self[...].out_major(tiled)
        return QuantizedWeight(
            q.data,
            q.scale,
            q.minimum,
            bits=q.bits,
            group=q.group,
            in_shape=q.in_shape,
            out_shape=q.out_shape,
            major="out",
        )


def concat_outputs(weights) -> QuantizedWeight | None:
    """One quantized weight whose outputs are those of `weights` side by side (the decode form's fused q/k/v and
    gate/up products, `Attention.fuse_products`), [*in, sum NO], the same bytes; None when they cannot share one
    product (other formats, groups, inputs or layouts)."""
    qs = [w[...] for w in weights]
    first = qs[0]
    if any(
        (q.bits, q.group, q.in_shape, q.major, q.minimum is None)
        != (first.bits, first.group, first.in_shape, "in", first.minimum is None)
        or isinstance(q, EmbedQArray)
        for q in qs
    ):
        return None
    # in-major storage keeps the outputs on the last axis of data, scale and minimum (module docstring)
    join = lambda arrays: jnp.concatenate(arrays, axis=-1)  # noqa: E731
    return QuantizedWeight(
        join([q.data for q in qs]),
        join([q.scale for q in qs]),
        None if first.minimum is None else join([q.minimum for q in qs]),
        bits=first.bits,
        group=first.group,
        in_shape=first.in_shape,
        out_shape=(sum(q.size_out for q in qs),),
    )


def _quantized(w, n_in: int, bits: int, group: int, minimums: bool, stacked: bool, name: str, embed=False):
    """A QuantizedWeight for the float array w ([L, *in, *out] when stacked); QuantizeError for a bad group."""
    shape = w.shape[1:] if stacked else w.shape
    in_shape, out_shape = shape[:n_in], shape[n_in:]
    if embed:  # the table [V, D] is stored as the head [D, V]
        in_shape, out_shape = shape[1:], shape[:1]
    NI, NO = math.prod(in_shape), math.prod(out_shape)
    g = group or NI
    if NI % g:
        raise QuantizeError(f"group_size {g} does not divide the input dimension {NI} of {name} {tuple(shape)}")
    if bits == 4 and g % 2:
        raise QuantizeError(f"int4 needs an even group size, and {name}'s input dimension {NI} is odd")

    def one(a):
        return quantize_array(a.T if embed else a.reshape(NI, NO), bits, g, minimums)

    data, scale, minimum = jax.vmap(one)(w) if stacked else one(w)
    return QuantizedWeight(
        data, scale, minimum, bits=bits, group=g, in_shape=in_shape, out_shape=out_shape, embed=embed
    )


def quantize(
    model, weights: str = "int8", group_size: int | None = None, minimums: bool = False, embed: str | None = None
):
    """A copy of `model` whose projection, MLP and embedding/output weights are stored as `weights` ("int8":
    per output channel, or groups of `group_size` inputs; "int4": groups of `group_size` (default 32) inputs,
    symmetric, or with per-group minimums). Norms, biases, MLA's wk_b / wv_b and learned positions stay float.

    embed: the embedding table and output head in another format than the rest: "int8" (per output channel) under
    int4 weights is the layout GGUF files ship (Q4_1 layers, a Q8_0 table): on SmolLM2-135M the head's 4 bits cost
    +1.75% bits/byte and 8 bits +0.02% (docs/performance.md). None: as `weights`.

    The model runs unchanged (forward, generate, the cache, speculative decoding); train float, then quantize."""
    if getattr(model.config, "weights", "float32") != "float32":
        raise QuantizeError(f"the model is already quantized ({model.config.weights}); quantize its float weights")
    g = check_format(weights, group_size)
    bits = 8 if weights == "int8" else 4
    if bits == 8 and minimums:
        raise QuantizeError("minimums apply to int4 only")
    if embed is not None and embed not in FORMATS:
        raise QuantizeError(f"embed must be one of {', '.join(FORMATS)} (or None: as weights), got {embed!r}")
    # the table's own format: as the weights, or `embed` with its default group (and no minimums)
    e_bits, e_group, e_min = (
        (bits, g, minimums) if embed in (None, weights) else (8 if embed == "int8" else 4, DEFAULT_GROUP[embed], False)
    )
    graphdef, state = nnx.split(model)
    new = nnx.merge(graphdef, state)  # a new model object sharing the (immutable) arrays
    for path, module in list(nnx.iter_graph(new)):
        names = QUANTIZED.get(type(module).__name__)
        if not names:
            continue
        stacked = bool(path) and path[0] == "blocks"
        where = ".".join(str(p) for p in path)
        for name, n_in in names.items():
            param = getattr(module, name, None)
            if isinstance(param, nnx.Param):
                setattr(module, name, _quantized(param[...], n_in, bits, g, minimums, stacked, f"{where}.{name}"))
    new.embed = _quantized(new.embed[...], 1, e_bits, e_group, e_min, False, "embed", embed=True)
    if hasattr(new, "lm_head"):
        new.lm_head = _quantized(new.lm_head[...], 1, e_bits, e_group, e_min, False, "lm_head")
    new.config = new.config.replace(
        weights=weights,
        weights_group_size=g,
        weights_minimums=bool(minimums),
        weights_embed="" if embed in (None, weights) else embed,
    )
    return new


def lookup(table, tokens, dtype):
    """embed[tokens] in `dtype`, for a float table [V, D] or a quantized one."""
    if isinstance(table, EmbedQArray):
        return table.astype(dtype).lookup(tokens)
    return table.astype(dtype)[tokens]


def weight_bytes(model) -> int:
    """Bytes of every parameter array (what one decode step reads, less what it skips: the embedding rows)."""
    return int(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(nnx.state(model, nnx.Param))))
