"""The C++ decode products (causal_lm/model/matvec.py, csrc/matvec.cc): equal to XLA's product (float32) and to the
dequantized float product (int8, int4), for 1, 3 and 16 rows and odd shapes; a row's result the same bits whatever
the number of rows; a decode step of a quantized model reading the int8/int4 bytes through the custom calls with no
float copy of its weights; the decode form's cached decode equal to recompute. CI machines have gcc: there a kernel
that did not build fails the tests instead of skipping them."""

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

SHAPES = [(64, 70), (37, 131)]  # K, N: whole vectors with an odd output count; odd inputs (the scalar path)
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
    qa = QArray(data, scale, minimum, bits, g, (K,), (N,)).out_major()
    x = rng.standard_normal((16, K)).astype(np.float32)
    return x, qa, x.astype(np.float64) @ np.asarray(qa.dequantize(), np.float64)


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
    """On a CPU with AVX-512 the int8 and int4-g32 cases above take the 16-lane path; the kernels built without it
    (`CAUSAL_LM_NATIVE_FLAGS=-mno-avx512f`, in a subprocess) run the 8-lane AVX2 path on the same cases: equal to the
    dequantized float product, batch invariant, and a different order of the sums where the paths differ (so the
    subprocess did run the other build)."""
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


def _step_texts(model):
    """(StableHLO of, compiled HLO of) the one-token decode step over a cache, as generate runs it."""
    graphdef, state = nnx.split(model)
    cache = causal_lm.init_cache(model.config, batch_size=1, max_len=8)

    def step(state, layers, tokens, cache):
        return nnx.merge(graphdef, state)(tokens, cache=cache, layers=layers)[0]

    lowered = jax.jit(step).lower(state, model.split_layers(), jnp.zeros((1, 1), jnp.int32), cache)
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
    that size (so the check can fail)."""
    config = tiny_config("gqa", d_model=128, num_heads=4, mlp_dim=512, vocab_size=512, max_seq_len=16)
    model = build_model(config)
    biggest = 128 * 512  # the MLP's weights and the head
    text, hlo = _step_texts(model)
    assert {t for t, _ in _kernel_weights(text)} == {"causal_lm_matvec_f32"}
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
