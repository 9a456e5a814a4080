"""GGUF quants kept quantized (`load_gguf(path, dequantize=False)`): Q8_0 / Q4_0 / Q4_1 weights held as the file's
own int8 / int4 blocks, equal to the dequantized model's weights and logits; K-quants still load (as float)."""

import jax
import numpy as np
import pytest
from test_gguf import HIDDEN, LAYERS, MLP, Q, _random_q4k_blocks, make_hf_model, tok, tokens_for, write_gguf  # noqa: F401

from causal_lm import load_gguf
from causal_lm.decode import generate
from causal_lm.model.quant import QuantizedWeight


@pytest.fixture(scope="module")
def hf_model(tok):  # noqa: F811
    return make_hf_model("llama", tok.get_vocab_size())


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_kept_quants_are_the_files_values_and_give_the_dequantized_logits(hf_model, tok, tmp_path, qtype):  # noqa: F811
    path = write_gguf(tmp_path / f"tiny-{qtype}.gguf", hf_model, tok, qtypes={"*": Q[qtype]})
    floats, _ = load_gguf(path, load_tokenizer=False)
    kept, _ = load_gguf(path, load_tokenizer=False, dequantize=False)
    bits = 8 if qtype == "Q8_0" else 4
    assert kept.config.weights == f"int{bits}" and kept.config.weights_minimums == (qtype == "Q4_1")
    attn, mlp = kept.blocks.attn, kept.blocks.mlp
    for module, name in [(attn, "wq"), (attn, "wk"), (mlp, "w_down"), (kept, "embed")]:
        w = getattr(module, name)
        assert isinstance(w, QuantizedWeight) and w.bits == bits and w.group == 32, name
        assert w.data[...].dtype == (np.int8 if bits == 8 else np.uint8)
    # exactly the file's values: every stored weight dequantizes to what the float loader read (gguf's dequantize)
    for i in range(LAYERS):
        for module, fmodule, name in [
            (kept.blocks.attn, floats.blocks.attn, "wq"),  # permuted rows (llama)
            (kept.blocks.attn, floats.blocks.attn, "wo"),  # two input dims
            (kept.blocks.mlp, floats.blocks.mlp, "w_down"),
        ]:
            qa = jax.tree.map(lambda a, i=i: a[i], getattr(module, name)[...])
            np.testing.assert_array_equal(np.asarray(qa.dequantize()), np.asarray(getattr(fmodule, name)[...][i]))
    np.testing.assert_array_equal(np.asarray(kept.embed[...].dequantize()), np.asarray(floats.embed[...]))
    tokens = tokens_for(tok.get_vocab_size())[:1, :8]
    want = np.asarray(floats(tokens)[0])
    np.testing.assert_allclose(np.asarray(kept(tokens)[0]), want, rtol=0, atol=1e-4 * np.abs(want).max())
    a = generate(kept, [list(tokens[0])], max_new_tokens=6, return_logits=True)  # the one-row product
    b = generate(floats, [list(tokens[0])], max_new_tokens=6, return_logits=True)
    assert a.tokens == b.tokens
    np.testing.assert_allclose(a.logits, b.logits, rtol=0, atol=1e-4 * np.abs(b.logits).max())


def test_k_quants_load_dequantized_beside_kept_q8(hf_model, tok, tmp_path):  # noqa: F811
    qtypes = {"*": Q.Q8_0, **{f"blk.{i}.ffn_down.weight": _random_q4k_blocks(HIDDEN, MLP, i) for i in range(LAYERS)}}
    path = write_gguf(tmp_path / "mixed.gguf", hf_model, tok, qtypes=qtypes)
    kept, _ = load_gguf(path, load_tokenizer=False, dequantize=False)
    assert isinstance(kept.blocks.mlp.w_up, QuantizedWeight)
    assert not isinstance(kept.blocks.mlp.w_down, QuantizedWeight)  # Q4_K: dequantized float
    assert np.isfinite(np.asarray(kept(tokens_for(tok.get_vocab_size())[:1, :8])[0])).all()


def test_cli_convert_quantize_and_bad_weights_are_one_line(hf_model, tok, tmp_path, capsys):  # noqa: F811
    from causal_lm.cli import main
    from causal_lm.train import load_for_inference

    path = write_gguf(tmp_path / "tiny.gguf", hf_model, tok)
    wd = str(tmp_path / "wd")
    assert main(["convert", "--from-gguf", path, "--workdir", wd, "--quantize", "int8"]) == 0
    assert "weights stored int8" in capsys.readouterr().out
    model, _, config = load_for_inference(wd)
    assert config.model.weights == "int8" and model.blocks.mlp.w_up.data[...].dtype == np.int8
    # GGUF's own layout in a workdir: int4 groups with minimums, the table and head int8 per channel
    q4 = write_gguf(tmp_path / "tiny-q41.gguf", hf_model, tok, qtypes={"*": Q.Q4_1})
    wd4 = str(tmp_path / "wd4")
    quant = ["--quantize", "int4", "--minimums", "--embed-weights", "int8"]
    assert main(["convert", "--from-gguf", q4, "--workdir", wd4, *quant]) == 0
    assert "weights stored int4 (groups of 32 with minimums; int8 embedding)" in capsys.readouterr().out
    model4, _, config4 = load_for_inference(wd4)
    m4 = config4.model
    assert (m4.weights, m4.weights_minimums, m4.weights_embed) == ("int4", True, "int8")
    assert model4.blocks.mlp.w_up.data[...].dtype == np.uint8 and model4.embed[...].data.dtype == np.int8
    floats, _ = load_gguf(q4, load_tokenizer=False)  # the file's Q4_1 layers are held exactly by int4 + minimums
    w = jax.tree.map(lambda a: a[0], model4.blocks.mlp.w_down[...]).dequantize()
    np.testing.assert_allclose(np.asarray(w), np.asarray(floats.blocks.mlp.w_down[...][0]), rtol=0, atol=1e-6)
    for argv, expected in [
        (["convert", "--from-gguf", path, "--workdir", wd + "3", "--minimums"], "--minimums applies with --quantize"),
        (["generate", "--workdir", wd, "--weights", "int3"], "--weights must be one of float32, int8, int4"),
        (["generate", "--config", "tiny", "--weights", "int4", "--group-size", "12"], "group_size 12 does not divide"),
        (["generate", "--workdir", wd, "--weights", "int4"], "the model's weights are int8"),
        (["generate", "--workdir", wd, "--weights", "int8", "--minimums"], "--minimums applies with --weights int4"),
        (["generate", "--workdir", wd, "--embed-weights", "int8"], "--embed-weights applies with --weights int8|int4"),
        (["convert", "--from-gguf", path, "--workdir", wd + "2", "--quantize", "int3"], "--quantize must be int8"),
    ]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "error:" in err[0] and expected in err[0], err
