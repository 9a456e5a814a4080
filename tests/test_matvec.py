"""The C++ decode products (causal_lm/model/matvec.py, csrc/matvec.cc): equal to XLA's product (float32) and to the
dequantized float product (int8, int4), for 1, 3 and 16 rows and odd shapes; a row's result the same bits whatever
the number of rows; a decode step of a quantized model reading the int8/int4 bytes through the custom calls with no
float copy of its weights; the decode form's cached decode equal to recompute. CI machines have gcc: there a kernel
that did not build fails the tests instead of skipping them."""

import dataclasses
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from variants import tiled_weights, tiny_config, tiny_model

import causal_lm
from causal_lm.decode import generate
from causal_lm.model import build_model, matvec, native, quant
from causal_lm.model.quant import QArray, quantize, quantize_array


@pytest.fixture(scope="module", autouse=True)
def _kernels_built():
    if native.compiler() is None and not os.environ.get("CI"):
        pytest.skip("no C++ compiler here")
    if os.environ.get(native.ENV, "1") == "0":
        pytest.skip("CAUSAL_LM_NATIVE=0")
    assert matvec.usable(), f"the matvec kernels did not build: {native.failure(matvec.NAME)}"


_f32 = jax.jit(matvec.matvec_f32)
_quant = jax.jit(matvec.matvec_quantized)

# K, N: whole vectors with an odd output count; odd inputs (the scalar path); int8 (and float32) in tiles
SHAPES = [(64, 70), (37, 131), (128, 36)]
# bits, group (0: per channel), minimums; g=4 is an int4 group of less than a vector (the scalar path). On a CPU with
# AVX-512, int8 groups of a multiple of 16 and int4 groups of 32 take the 16-lane path; int8 g=8 and int4 g=64 take
# the 8-lane AVX2 path on every x86 CPU (test_the_avx2_build_on_a_cpu_with_avx512 runs the rest there too).
FORMATS = {
    "int8": (8, 0, False),
    "int8-g16": (8, 16, False),
    "int8-g8": (8, 8, False),
    "int4-g32": (4, 32, False),
    "int4-g32-min": (4, 32, True),
    "int4-g64": (4, 64, False),
    "int4-g4-min": (4, 4, True),
}


@pytest.mark.parametrize("K,N", SHAPES)
def test_float32_kernel_equals_xla_and_is_batch_invariant(K, N):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((K, N)).astype(np.float32)
    x = rng.standard_normal((16, K)).astype(np.float32)
    wt = jnp.asarray(w.T.copy())
    want = x.astype(np.float64) @ w
    ys = {rows: np.asarray(_f32(x[:rows], wt)) for rows in (1, 3, 6, 16)}
    for rows, y in ys.items():
        np.testing.assert_allclose(y, want[:rows], rtol=1e-5, atol=1e-5 * np.abs(want).max())
        np.testing.assert_array_equal(y, ys[16][:rows])  # bitwise: the same sum order at any row count


TILED = [(48, 36), (1536, 8)]  # K, N that tile (4 | N, 16 | K): a few tiles; one block of 8 outputs, 96 tiles deep


@pytest.mark.parametrize("K,N", TILED)
def test_tiled_float32_weights_give_the_untiled_bits(K, N):
    """The decode form stores a float32 weight in tiles of 4 outputs x 16 inputs (`matvec.tile`) where they divide
    it: the kernel's product over the tiles is the product over [N, K] bit for bit, at every row count (whole tiles
    of 4 rows x 4 outputs, and the rows left over), and the XLA form of a tiled OutMajor (more rows than the kernels
    take) and its gradient through the kernel's custom_vjp equal XLA's."""
    x, w = _float32_case(K, N)
    x = np.concatenate([x, x[::-1] * 0.5])  # 32 rows
    tiled = matvec.tile(jnp.asarray(w))
    assert tiled.shape == (N // 4, K // 16, 4, 16)
    np.testing.assert_array_equal(np.asarray(matvec.untile(tiled)), w)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 13, 16):
        np.testing.assert_array_equal(np.asarray(_f32(x[:rows], tiled)), np.asarray(_f32(x[:rows], jnp.asarray(w))))
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    o = matvec.out_major(jnp.asarray(w.T), 1, tiled=True)
    assert o.t.ndim == 4
    y = np.asarray(jax.jit(lambda x: o.matmul(x, 1))(x))  # 32 rows: XLA's product over the tiles
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    gx, gw = jax.jit(jax.grad(lambda x, t: jnp.sum(jnp.sin(matvec.matvec_f32(x, t))), argnums=(0, 1)))(x[:3], tiled)
    rx, rw = jax.grad(lambda x, w: jnp.sum(jnp.sin(x @ w.T)), argnums=(0, 1))(x[:3], jnp.asarray(w))
    np.testing.assert_allclose(gx, rx, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(matvec.untile(gw), rw, rtol=1e-4, atol=1e-4)


def test_weights_that_do_not_tile_stay_output_major():
    for K, N in [(64, 70), (37, 131), (48, 30), (40, 36)]:
        assert matvec.out_major(jnp.zeros((K, N)), 1, tiled=True).t.shape == (N, K)
    for K, N, tiled in [(128, 36, True), (64, 36, True), (48, 36, False), (128, 70, False)]:
        qa = QArray(*quantize_array(np.ones((K, N), np.float32), 8, K, False), 8, K, (K,), (N,)).out_major(tiled=True)
        assert qa.data.shape == ((N // 4, K // 64, 4, 64) if tiled else (N, K))
        np.testing.assert_array_equal(np.asarray(qa.in_major().data), np.ones((K, N), np.int8) * 127)


def test_only_a_decode_form_of_at_most_max_rows_is_tiled():
    """Tiles only where every product goes to the kernels: `split_layers(rows=...)` up to MAX_ROWS (generate's decode
    loop, the engine's calls of at most MAX_ROWS token slots) tiles every float32 / int8 weight and gives a tied
    float32 head a tiled copy; more rows, or no bound (speculative decoding's verify passes), keep [out, in] and read
    the table in place (XLA's product, which more rows take, is 1.2-5x slower over tiles)."""
    model = build_model(tiny_config("gqa", d_model=128, num_heads=4, mlp_dim=512, vocab_size=512, max_seq_len=16))
    for m in (model, quantize(model, "int8")):
        tiled = tiled_weights(m.split_layers(rows=matvec.MAX_ROWS))
        assert tiled and all(tiled)
        for rows in (None, matvec.MAX_ROWS + 1):
            assert not any(tiled_weights(m.split_layers(rows=rows)))
    assert model.split_layers(rows=1).head is not None and model.split_layers().head is None


@pytest.mark.parametrize("K,N", [(128, 36), (1536, 8)])
@pytest.mark.parametrize("fmt", ["int8", "int8-g16", "int8-g8"])
def test_tiled_int8_weights_give_the_untiled_bits(K, N, fmt):
    """int8 decode weights are stored in tiles of 4 outputs x 64 inputs where they divide it: the kernel's product
    is the product over [N, K] bit for bit at every row count, and the gradient through its custom_vjp is XLA's."""
    x, qa, want = _quantized_case(K, N, fmt)
    assert qa.data.shape == (N // 4, K // 64, 4, 64)
    rows_form = dataclasses.replace(qa, data=matvec.untile(qa.data))
    for rows in (1, 2, 3, 4, 5, 8, 13, 16):
        y = np.asarray(_quant(x[:rows], qa.data, qa.scale, qa.minimum))
        np.testing.assert_array_equal(y, np.asarray(_quant(x[:rows], rows_form.data, qa.scale, qa.minimum)))
        np.testing.assert_allclose(y, want[:rows], rtol=1e-5, atol=2e-6 * np.abs(want).max())
    g = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(matvec.matvec_quantized(x, qa.data, qa.scale, None)))))(x[:3])
    w = np.asarray(qa.dequantize(), np.float32)
    np.testing.assert_allclose(g, jax.grad(lambda x: jnp.sum(jnp.sin(x @ w)))(x[:3]), rtol=1e-3, atol=1e-3)


QUANT_CASES = [  # the formats whose groups fit each shape (int4 needs even groups that divide K)
    (K, N, fmt)
    for K, N in SHAPES
    for fmt, (bits, group, _) in FORMATS.items()
    if K % (group or K) == 0 and not (bits == 4 and (group or K) % 2)
]


@pytest.mark.parametrize("K,N,fmt", QUANT_CASES)
def test_quantized_kernels_equal_the_dequantized_float_product(K, N, fmt):
    bits = FORMATS[fmt][0]
    x, qa, want = _quantized_case(K, N, fmt)
    assert qa.data.dtype == (jnp.int8 if bits == 8 else jnp.uint8)
    ys = {rows: np.asarray(_quant(x[:rows], qa.data, qa.scale, qa.minimum)) for rows in (1, 3, 6, 16)}
    for rows, y in ys.items():
        np.testing.assert_allclose(y, want[:rows], rtol=1e-5, atol=2e-6 * np.abs(want).max())
        np.testing.assert_array_equal(y, ys[16][:rows])
    # the same values through QArray.matmul's XLA form (major="in" storage)
    xla = np.asarray(jax.jit(lambda x, q: q.in_major().matmul(x, 1))(x[:3], qa))
    np.testing.assert_allclose(ys[3], xla, rtol=1e-5, atol=2e-6 * np.abs(want).max())


def _quantized_case(K, N, fmt):
    """(x [16, K], the out-major QArray, the dequantized float product in float64) of one case."""
    bits, group, minimums = FORMATS[fmt]
    g = group or K
    rng = np.random.default_rng(1)
    w = rng.standard_normal((K, N)).astype(np.float32) * rng.uniform(0.1, 2.0, (1, N)).astype(np.float32)
    data, scale, minimum = quantize_array(w, bits, g, minimums)
    qa = QArray(data, scale, minimum, bits, g, (K,), (N,)).out_major(tiled=True)
    x = rng.standard_normal((16, K)).astype(np.float32)
    return x, qa, x.astype(np.float64) @ np.asarray(qa.dequantize(), np.float64)


def _float32_case(K, N):
    """(x [16, K], the out-major weight [N, K]) of one float32 case."""
    rng = np.random.default_rng(2)
    return rng.standard_normal((16, K)).astype(np.float32), rng.standard_normal((N, K)).astype(np.float32)


def _documented_order(x, w, scale, g, lanes):
    """[R, N] float32: the sums in the order csrc/matvec.cc documents, for float32 (scale None) and int8 weights
    (w: the int8 values as floats, scale [N, G]): per group, lane l a fused multiply-add chain over the inputs
    i = l (mod lanes); per group acc = fma(part, scale, acc); 16 lanes folded to 8, l[j] + l[j + 8]; then
    ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)). A fused multiply-add is emulated in float64 (the product of
    two float32 values is exact there) with one rounding to float32: a double rounding would need a tie at float32's
    precision, which these random operands do not meet."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    R, K = x.shape
    acc = np.zeros((R, w.shape[0], lanes), np.float32)
    for G in range(K // g):
        part = np.zeros_like(acc)
        for i in range(g):
            k, lane = G * g + i, i % lanes
            part[:, :, lane] = (x64[:, k, None] * w64[None, :, k] + part[:, :, lane]).astype(np.float32)
        if scale is None:
            acc = part
        else:
            sc = scale[None, :, G, None].astype(np.float64)
            acc = (part.astype(np.float64) * sc + acc).astype(np.float32)
    if lanes == 16:
        acc = acc[..., :8] + acc[..., 8:]
    a = [acc[..., j] for j in range(8)]
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))


def _lanes(K, g, wide: bool) -> int:
    """How many lanes the kernels take for float32 / int8 weights of K inputs in groups of g."""
    return 16 if wide and g % 16 == 0 else 8


ORDER_CASES = [
    (64, 70, "float32"),
    (37, 131, "float32"),
    (48, 36, "float32-tiled"),
    (64, 70, "int8"),
    (128, 36, "int8"),
    (128, 36, "int8-g8"),
    (64, 70, "int8-g16"),
    (64, 70, "int8-g8"),
]


def _order_case(K, N, fmt):
    """(x, the kernel's product, the documented order's product at `wide` or not) of one ORDER_CASES case."""
    if fmt.startswith("float32"):
        x, w = _float32_case(K, N)
        stored = matvec.tile(jnp.asarray(w)) if fmt == "float32-tiled" else jnp.asarray(w)
        return x, np.asarray(_f32(x, stored)), lambda wide: _documented_order(x, w, None, K, _lanes(K, K, wide))
    x, qa, _ = _quantized_case(K, N, fmt)
    g = FORMATS[fmt][1] or K
    q, scale = np.asarray(matvec.untile(qa.data), np.float32), np.asarray(qa.scale, np.float32)
    y = np.asarray(_quant(x, qa.data, qa.scale, qa.minimum))
    return x, y, lambda wide: _documented_order(x, q, scale, g, _lanes(K, g, wide))


@pytest.mark.parametrize("K,N,fmt", ORDER_CASES)
def test_float32_and_int8_products_sum_in_the_documented_order(K, N, fmt):
    """Bit for bit the order of the sums csrc/matvec.cc documents (16 lanes on a CPU with AVX-512 where the group
    is a multiple of 16 inputs, else 8; the scalar path for 37 inputs), for 16 rows: the lanes' chains, the per-group
    scales, the fold of 16 lanes and the last sum of 8 are each pinned, not only close to the exact product."""
    _, y, documented = _order_case(K, N, fmt)
    np.testing.assert_array_equal(y, documented("avx512f" in _cpu_flags()))


_AVX2_BUILD = """
import sys, numpy as np
sys.path.insert(0, sys.argv[1])
import test_matvec as t
from causal_lm.model import matvec
assert matvec.usable()
out = {}
for K, N, fmt in t.QUANT_CASES:
    x, qa, _ = t._quantized_case(K, N, fmt)
    for rows in (1, 3, 16):
        out[f"{K}-{N}-{fmt}-{rows}"] = np.asarray(t._quant(x[:rows], qa.data, qa.scale, qa.minimum))
for K, N, fmt in t.ORDER_CASES:
    out[f"order-{K}-{N}-{fmt}"] = t._order_case(K, N, fmt)[1]
for K, N in t.TILED:
    x, w = t._float32_case(K, N)
    for rows in (1, 3, 4, 6, 8, 16):
        out[f"tiled-{K}-{N}-{rows}"] = np.asarray(t._f32(x[:rows], matvec.tile(w)))
        out[f"rows-{K}-{N}-{rows}"] = np.asarray(t._f32(x[:rows], w))
np.savez(sys.argv[2], **out)
"""


def _cpu_flags() -> set:
    try:
        lines = open("/proc/cpuinfo").read().splitlines()
    except OSError:
        return set()
    return {f for ln in lines if ln.startswith("flags") for f in ln.split(":", 1)[1].split()}


@pytest.mark.skipif("avx512f" not in _cpu_flags(), reason="without AVX-512 the tests above run the AVX2 path")
def test_the_avx2_build_on_a_cpu_with_avx512(tmp_path):
    """On a CPU with AVX-512 the float32, int8 and int4-g32 cases above take the 16-lane path; the kernels built
    without it (`CAUSAL_LM_NATIVE_FLAGS=-mno-avx512f`, in a subprocess) run the 8-lane AVX2 path on the same cases:
    equal to the dequantized float product, batch invariant, a different order of the sums where the paths differ
    (so the subprocess did run the other build), and for float32 and int8 the documented 8-lane order bit for bit."""
    env = dict(os.environ, **{native.FLAGS_ENV: "-mno-avx512f"})
    out = tmp_path / "avx2.npz"
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", _AVX2_BUILD, here, str(out)], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = np.load(out)
    differ = 0
    for K, N, fmt in QUANT_CASES:
        x, qa, want = _quantized_case(K, N, fmt)
        for rows in (1, 3, 16):
            y = got[f"{K}-{N}-{fmt}-{rows}"]
            np.testing.assert_allclose(y, want[:rows], rtol=1e-5, atol=2e-6 * np.abs(want).max())
            np.testing.assert_array_equal(y, got[f"{K}-{N}-{fmt}-16"][:rows])
        differ += not np.array_equal(got[f"{K}-{N}-{fmt}-16"], np.asarray(_quant(x, qa.data, qa.scale, qa.minimum)))
    assert differ >= 3, "the AVX2 build gave the 16-lane path's bits: it was not the AVX2 build"
    for K, N, fmt in ORDER_CASES:  # the AVX2 build's float32 and int8 sums: the documented 8-lane order
        np.testing.assert_array_equal(got[f"order-{K}-{N}-{fmt}"], _order_case(K, N, fmt)[2](False))
    for K, N in TILED:  # its tiles (4 rows x 2 outputs twice): the bits of [N, K]
        for rows in (1, 3, 4, 6, 8, 16):
            np.testing.assert_array_equal(got[f"tiled-{K}-{N}-{rows}"], got[f"rows-{K}-{N}-{rows}"])


def _step_texts(model):
    """(StableHLO of, compiled HLO of) the one-token decode step over a cache, as generate runs it."""
    graphdef, state = nnx.split(model)
    cache = causal_lm.init_cache(model.config, batch_size=1, max_len=8)

    def step(state, layers, tokens, cache):
        return nnx.merge(graphdef, state)(tokens, cache=cache, layers=layers)[0]

    lowered = jax.jit(step).lower(state, model.split_layers(rows=1), jnp.zeros((1, 1), jnp.int32), cache)
    return lowered.as_text(), lowered.compile().as_text()


_CALL = re.compile(r"stablehlo\.custom_call @(causal_lm_matvec_\w+)\(.*?\).*?: \(([^)]*)\) ->")
_F32 = re.compile(r"\bf32\[([\d,]*)\]")


def _kernel_weights(stablehlo: str) -> list:
    """(target, weight operand type) of each kernel call in the step."""
    calls = []
    for target, types in _CALL.findall(stablehlo):
        operands = re.findall(r"tensor<([^>]*)>", types)
        calls.append((target, operands[1]))
    return calls


def _largest_f32(hlo: str) -> int:
    return max(int(np.prod([int(d) for d in s.split(",") if d] or [1])) for s in _F32.findall(hlo))


@pytest.mark.slow
def test_the_decode_step_reads_int8_and_int4_weights_through_the_kernels():
    """Every projection (and the head) of a quantized model's decode step is a kernel call whose weight operand is
    the stored int8 / uint8 array (bytes: 1 or 1/2 per weight), and the compiled step holds no float array as large
    as a weight: nothing dequantizes a weight up front. The float model's step, for contrast, has float weights of
    that size (so the check can fail), each in the kernels' tiles."""
    config = tiny_config("gqa", d_model=128, num_heads=4, mlp_dim=512, vocab_size=512, max_seq_len=16)
    model = build_model(config)
    biggest = 128 * 512  # the MLP's weights and the head
    text, hlo = _step_texts(model)
    assert {t for t, _ in _kernel_weights(text)} == {"causal_lm_matvec_f32"}
    # every float weight, the tied head too, in the kernels' tiles [N/4, K/16, 4, 16] (the shapes tile)
    assert [op.split("x")[-3:-1] for _, op in _kernel_weights(text)] == [["4", "16"]] * (2 * 4 + 1), text
    assert _largest_f32(hlo) >= biggest
    for fmt, dtype, per_weight in (("int8", "i8", 1), ("int4", "ui8", 0.5)):
        qmodel = quantize(model, fmt, group_size=None if fmt == "int8" else 32)
        text, hlo = _step_texts(qmodel)
        calls = _kernel_weights(text)
        # fused as the float form (q/k/v, o, gate/up, down: 4 products) x 2 layers, plus the head
        assert len(calls) == 2 * 4 + 1, calls
        for _, operand in calls:
            *dims, kind = operand.split("x")
            assert kind == dtype, (fmt, operand)
        # the operands are the stored bytes: as many as the model's quantized arrays hold (the head: the table's)
        read = sum(int(np.prod([int(d) for d in op.split("x")[:-1]])) for _, op in calls)
        stored = sum(a.size for p, a in jax.tree_util.tree_flatten_with_path(nnx.state(qmodel))[0] if "data" in str(p))
        assert read == stored, (read, stored)
        weights = sum(a.size for a in jax.tree.leaves(nnx.state(model, nnx.Param)))
        assert stored * 4 / per_weight > 0.9 * weights  # nearly every weight is one of them
        assert _largest_f32(hlo) < biggest, (fmt, _largest_f32(hlo))


@pytest.mark.parametrize("fmt", ["float32"])  # quantized: tests/test_quant.py (through the kernels too)
def test_the_kernel_decode_form_decodes_as_its_recompute(fmt):
    config = tiny_config("gqa")
    model = tiny_model(config)
    if fmt != "float32":
        model = quantize(model, fmt, group_size=16)
    prompts = [[3, 1, 4, 1, 5, 9, 2], [6, 5]]
    cached = generate(model, prompts, max_new_tokens=6, return_logits=True)
    recomputed = generate(model, prompts, max_new_tokens=6, use_cache=False, return_logits=True)
    assert cached.tokens == recomputed.tokens
    np.testing.assert_allclose(cached.logits, recomputed.logits, rtol=0, atol=1e-5)


def test_turned_off_the_step_has_no_kernel_call(monkeypatch):
    monkeypatch.setenv(native.ENV, "0")
    model = tiny_model(tiny_config("gqa"))
    text, _ = _step_texts(model)
    assert "causal_lm_matvec" not in text


@pytest.mark.parametrize(
    "fmt,group,minimums", [("int8", 0, False), ("int8", 32, False), ("int4", 32, True), ("int4", 16, False)]
)
def test_fused_quantized_products_are_the_separate_ones_side_by_side(fmt, group, minimums):
    """The decode form fuses q/k/v and gate/up of a quantized layer into one weight (`quant.concat_outputs`): its
    kernel product is the separate products' outputs side by side, bit for bit (each output's sum is its own)."""
    rng = np.random.default_rng(5)
    bits = 8 if fmt == "int8" else 4
    parts = [
        quant._quantized(jnp.asarray(rng.standard_normal((64, n)), jnp.float32), 1, bits, group, minimums, False, "w")
        for n in (48, 16, 16)
    ]
    fused = quant.concat_outputs(parts)
    assert fused is not None and fused.out_shape == (80,)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)

    @jax.jit
    def products(x, qs):
        with matvec.native_products():
            return [q.out_major().matmul(x, 1) for q in qs]

    (whole,), separate = products(x, [fused[...]]), products(x, [w[...] for w in parts])
    np.testing.assert_array_equal(np.asarray(whole), np.concatenate([np.asarray(y) for y in separate], axis=1))
    # formats that cannot share one product are not fused
    other = quant._quantized(jnp.ones((64, 8), jnp.float32), 1, 8 if bits == 4 else 4, 32, False, False, "w")
    assert quant.concat_outputs([parts[0], other]) is None
