"""Weight-only quantization (causal_lm/model/quant.py): storage error bounds, the quantized product against the
dequantized float product, cached decode == recompute for the attention variants, the compiled decode step reading
the quantized bytes, checkpoints, and bad requests."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from variants import tiny_config, tiny_mla_config, tiny_model

import causal_lm
from causal_lm.decode import generate
from causal_lm.model import build_model
from causal_lm.model.quant import QArray, QuantizeError, quantize, quantize_array

FORMATS = {  # name -> (bits, group, minimums)
    "int8-channel": (8, 0, False),
    "int8-g16": (8, 16, False),
    "int4-g16": (4, 16, False),
    "int4-g32-min": (4, 32, True),
}


def _qarray(w, bits, group, minimums, in_shape=None, out_shape=None):
    NI, NO = w.shape
    g = group or NI
    data, scale, minimum = quantize_array(w, bits, g, minimums)
    return QArray(data, scale, minimum, bits, g, in_shape or (NI,), out_shape or (NO,))


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_error_is_within_half_a_step_of_each_group(fmt):
    bits, group, minimums = FORMATS[fmt]
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 24)).astype(np.float32) * rng.uniform(0.01, 3.0, (64, 24)).astype(np.float32)
    qa = _qarray(w, bits, group, minimums)
    err = np.abs(np.asarray(qa.dequantize()) - w)
    g = group or 64
    wg = w.reshape(64 // g, g, 24)
    # the step of each group: max|w| / 127 (int8), max|w| / 7 (int4 symmetric), (max - min) / 15 (minimums)
    if minimums:
        step = (wg.max(1) - wg.min(1)) / 15
    else:
        step = np.abs(wg).max(1) / (127 if bits == 8 else 7)
    bound = np.repeat(step, g, axis=0) / 2 * (1 + 1e-5) + 1e-7  # per element: its own group's half step
    assert (err <= bound).all(), float((err / bound).max())
    assert err.max() > 0  # not a float copy
    # the storage is what the format says: 1 byte per weight (int8), half a byte (int4), scales per group
    assert qa.data.dtype == (jnp.int8 if bits == 8 else jnp.uint8)
    assert qa.data.size == (64 * 24 if bits == 8 else 64 * 24 // 2)
    assert qa.scale.shape == (64 // g, 24)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 40])  # 1 and 3: the blocked reduce (decode); 40: dequantize + matmul
def test_quantized_product_equals_the_dequantized_float_product(fmt, rows):
    bits, group, minimums = FORMATS[fmt]
    rng = np.random.default_rng(2)
    w = rng.standard_normal((4, 16, 24)).astype(np.float32)  # [N, H, D]: two input dims, like attention's wo
    qa = _qarray(w.reshape(64, 24), bits, group, minimums, in_shape=(4, 16), out_shape=(24,))
    x = jnp.asarray(rng.standard_normal((rows, 1, 4, 16)), jnp.float32)
    got = jax.jit(lambda x, qa: qa.matmul(x, 2))(x, qa)
    want = np.einsum("btnh,nhd->btd", np.asarray(x, np.float64), np.asarray(qa.dequantize(), np.float64))
    assert got.shape == (rows, 1, 24)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


CACHE_VARIANTS = {
    "gqa": (tiny_config("gqa"), "int4", 16),
    "mqa": (tiny_config("mqa"), "int8", None),
    "mla": (tiny_mla_config(), "int4", 16),
    "windows": (tiny_config("gqa", sliding_window=4, layer_pattern="local,global"), "int8", 16),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", CACHE_VARIANTS)
def test_quantized_cached_decode_equals_its_own_recompute(name):
    config, fmt, group = CACHE_VARIANTS[name]
    model = quantize(tiny_model(config), fmt, group_size=group)
    prompts = [[3, 1, 4, 1, 5, 9, 2], [6, 5]]
    cached = generate(model, prompts, max_new_tokens=10, return_logits=True)
    recomputed = generate(model, prompts, max_new_tokens=10, use_cache=False, return_logits=True)
    assert cached.tokens == recomputed.tokens
    np.testing.assert_allclose(cached.logits, recomputed.logits, rtol=0, atol=1e-5)
    # and the quantized model is not the float one: its logits differ by the quantization error
    float_run = generate(tiny_model(config), prompts, max_new_tokens=10, return_logits=True)
    assert np.abs(float_run.logits - cached.logits).max() > 1e-4


def _decode_step_bytes(model) -> float:
    """'bytes accessed' of the compiled one-token step over a cache, run as generate runs it (layers sliced once)."""
    graphdef, state = nnx.split(model)
    cache = causal_lm.init_cache(model.config, batch_size=1, max_len=8)

    def step(state, layers, tokens, cache):
        return nnx.merge(graphdef, state)(tokens, cache=cache, layers=layers)[0]

    tokens = jnp.zeros((1, 1), jnp.int32)
    compiled = jax.jit(step).lower(state, model.split_layers(), tokens, cache).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["bytes accessed"])


@pytest.mark.slow
def test_the_compiled_decode_step_reads_the_quantized_bytes(monkeypatch):
    """A quantized model whose product dequantized its weights to float first would read 4x (int8) or 8x (int4)
    the bytes: the step's bytes accessed must fall with the storage (weights dominate this shape). XLA's form (the
    C++ kernels off: XLA's cost analysis does not see into a custom call; tests/test_matvec.py checks that path)."""
    monkeypatch.setenv("CAUSAL_LM_NATIVE", "0")
    config = tiny_config("gqa", d_model=128, num_heads=4, mlp_dim=512, vocab_size=512, max_seq_len=16)
    model = build_model(config)
    weights = sum(a.size * 4 for a in jax.tree.leaves(nnx.state(model, nnx.Param)))
    full = _decode_step_bytes(model)
    assert full > weights  # the float step reads every weight
    int8 = _decode_step_bytes(quantize(model, "int8"))
    int4 = _decode_step_bytes(quantize(model, "int4", group_size=32))
    # int8: 1/4 of the weight bytes (+ per-channel scales). int4: XLA:CPU writes the unpacked nibbles out as one
    # byte per weight and reads them back (see QArray.matmul), so about 2.5/4 of float32's: still well below the
    # float program, and below what dequantizing to float first would read (more than the float program).
    assert int8 < 0.35 * full, int8 / full
    assert int4 < 0.85 * full, int4 / full


@pytest.mark.slow
def test_quantized_checkpoint_saves_verifies_and_loads(tmp_path):
    from causal_lm.config import Config
    from causal_lm.data.tokenizer import ByteTokenizer
    from causal_lm.train import load_for_inference, save_for_inference
    from causal_lm.train.checkpoint import Checkpointer

    config = tiny_config("gqa", vocab_size=259, max_seq_len=128)
    model = quantize(build_model(config), "int4", group_size=16, minimums=True)
    save_for_inference(str(tmp_path), model, Config(model=model.config), ByteTokenizer())
    ckpt = Checkpointer(str(tmp_path), read_only=True)
    records = ckpt.read_integrity(0)
    ckpt.close()
    flat = str(records)
    assert "embed.data" in flat and "blocks.mlp.w_up.minimum" in flat  # the quantized arrays carry checksums
    loaded, _, loaded_config = load_for_inference(str(tmp_path))
    assert loaded_config.model.weights == "int4" and loaded_config.model.weights_minimums
    assert loaded.blocks.mlp.w_up.data[...].dtype == jnp.uint8
    tokens = jnp.asarray([[5, 17, 200, 3]])
    np.testing.assert_array_equal(np.asarray(loaded(tokens)[0]), np.asarray(model(tokens)[0]))


@pytest.mark.slow
def test_an_int8_embedding_under_int4_weights_saves_loads_and_decodes(tmp_path):
    """quantize(..., embed="int8"): the layers in int4 groups, the table / head per channel in int8 (GGUF's own
    layout), recorded in the config, so a checkpoint rebuilds it; the cached decode equals its own recompute."""
    from causal_lm.config import Config
    from causal_lm.data.tokenizer import ByteTokenizer
    from causal_lm.train import load_for_inference, save_for_inference

    config = tiny_config("gqa", vocab_size=259, max_seq_len=128)
    float_model = build_model(config)
    model = quantize(float_model, "int4", group_size=16, minimums=True, embed="int8")
    assert model.config.weights_embed == "int8" and model.blocks.mlp.w_up.data[...].dtype == jnp.uint8
    table, int8_table = model.embed[...], quantize(float_model, "int8").embed[...]
    assert table.bits == 8 and table.group == config.d_model and table.minimum is None
    np.testing.assert_array_equal(np.asarray(table.data), np.asarray(int8_table.data))
    assert quantize(float_model, "int4", 16, embed="int4").config.weights_embed == ""  # the same format: no mark
    save_for_inference(str(tmp_path), model, Config(model=model.config), ByteTokenizer())
    loaded, _, loaded_config = load_for_inference(str(tmp_path))
    assert loaded_config.model.weights_embed == "int8" and loaded.embed[...].data.dtype == jnp.int8
    tokens = jnp.asarray([[5, 17, 200, 3]])
    np.testing.assert_array_equal(np.asarray(loaded(tokens)[0]), np.asarray(model(tokens)[0]))
    cached = generate(loaded, [[5, 17, 200, 3]], max_new_tokens=6, return_logits=True)
    recomputed = generate(loaded, [[5, 17, 200, 3]], max_new_tokens=6, use_cache=False, return_logits=True)
    assert cached.tokens == recomputed.tokens
    np.testing.assert_allclose(cached.logits, recomputed.logits, rtol=0, atol=1e-5)
    with pytest.raises(QuantizeError, match="embed must be one of int8, int4"):
        quantize(float_model, "int4", 16, embed="int3")


def test_bad_formats_and_group_sizes_are_one_line_errors():
    model = tiny_model(tiny_config("gqa"))
    with pytest.raises(QuantizeError, match="weights must be one of float32, int8, int4, got 'int3'") as e:
        causal_lm.quantize(model, "int3")
    assert "\n" not in str(e.value)
    with pytest.raises(QuantizeError, match="group_size 12 does not divide the input dimension 32") as e:
        causal_lm.quantize(model, "int4", group_size=12)
    assert "\n" not in str(e.value)
    with pytest.raises(QuantizeError, match="even group_size"):
        causal_lm.quantize(model, "int4", group_size=0)
    with pytest.raises(QuantizeError, match="already quantized"):
        causal_lm.quantize(causal_lm.quantize(model, "int8"), "int4")


@pytest.mark.slow
def test_speculative_decoding_of_a_quantized_model_gives_its_greedy_tokens():
    model = quantize(tiny_model(tiny_config("gqa")), "int8", group_size=16)
    prompts = [[3, 1, 4, 1, 3, 1, 4, 1, 3, 1]]
    plain = generate(model, prompts, max_new_tokens=8)
    spec = generate(model, prompts, max_new_tokens=8, speculative="ngram", draft_tokens=3)
    assert spec.tokens == plain.tokens
