"""llama.cpp as a peer (causal_lm/bench/llamacpp.py): the GGUF files `write_gguf` writes load in llama.cpp's own CPU
library and in ours (`load_gguf(dequantize=False)`, the file's Q8_0 / Q4_0 / Q4_1 blocks kept), and both decode the
same greedy tokens; F32 logits agree to float tolerance. So `bench llama-cpp` compares like with like, and our
reading of llama.cpp's quantized blocks is checked against llama.cpp itself. The peer is optional (.ci/run
installs it when its index has the wheel); without it these tests skip, except the one-line install error."""

import importlib.util

import numpy as np
import pytest
from variants import tiny_config

from causal_lm.bench import llamacpp
from causal_lm.decode import generate
from causal_lm.interop.gguf import load_gguf
from causal_lm.model import build_model


def _peer_or_skip():
    try:
        llamacpp.library()
    except llamacpp.LlamaCppError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    _peer_or_skip()
    # init_std 0.2: activations small enough that llama.cpp's 8-bit activation rounding stays well inside the
    # tolerances below through two layers (at 0.5 it reached 15% of the largest logit on some steps)
    config = tiny_config("gqa", d_model=64, num_heads=4, mlp_dim=128, vocab_size=320, max_seq_len=64, init_std=0.2)
    model = build_model(config, seed=3)
    folder = tmp_path_factory.mktemp("llamacpp")
    files = {t: llamacpp.write_gguf(model, str(folder / f"m-{t}.gguf"), t) for t in llamacpp.TYPES}
    files["source"] = model
    return files


PROMPT = [300, 261, 270, 299, 305, 262, 280, 290, 311, 264]


# max |ours - llama.cpp| / max |llama.cpp's logit| allowed: float rounding for F32; for the quantized types
# llama.cpp also quantizes the activations to 8 bits per block of 32 (its Q8_0 / Q4 dot products), we do not
RELATIVE = {"F32": 2e-4, "Q8_0": 0.15, "Q4_0": 0.15, "Q4_1": 0.15}


@pytest.mark.parametrize("qtype", llamacpp.TYPES)
def test_llamacpp_and_we_read_each_file_alike(files, qtype):
    """Teacher-forced along llama.cpp's greedy path, 12 steps: our logits (the file's blocks kept quantized) are
    llama.cpp's to within its activation quantization, and wherever llama.cpp's top choice leads its second by
    more than twice the difference, ours is the same token. A misread block (nibble order, scale, minimum) is
    off by the size of the logits themselves."""
    ours, _ = load_gguf(files[qtype], dequantize=False)
    expected = {"F32": "float32", "Q8_0": "int8", "Q4_0": "int4", "Q4_1": "int4"}[qtype]
    assert ours.config.weights == expected
    assert ours.config.weights_minimums == (qtype == "Q4_1")
    peer = llamacpp.LlamaCpp(files[qtype], n_ctx=48, threads=2)
    seq, checked = list(PROMPT), 0
    try:
        peer._fresh_context()
        peer._decode(seq)
        for _ in range(12):
            theirs = np.frombuffer(
                peer.ffi.buffer(peer.lib.llama_get_logits_ith(peer.ctx, -1), 4 * peer.n_vocab), np.float32
            ).copy()
            mine = generate(ours, [seq], max_new_tokens=1, return_logits=True).logits[0, 0]
            diff = float(np.abs(mine - theirs).max())
            assert diff <= RELATIVE[qtype] * np.abs(theirs).max(), (qtype, len(seq), diff, np.abs(theirs).max())
            top2 = np.sort(theirs)[-2:]
            if top2[1] - top2[0] > 2 * diff:
                assert int(mine.argmax()) == int(theirs.argmax())
                checked += 1
            tok = int(theirs.argmax())
            seq.append(tok)
            peer._decode([tok])
    finally:
        peer.close()
    assert checked >= 4  # the argmax check ran at most steps


def test_llamacpp_and_we_decode_float32_to_the_same_greedy_tokens(files):
    """...and the F32 file is the model it was written from (a writer that left q/k in the wrong rotary layout
    would still have llama.cpp and our loader agree with each other, on another model)."""
    ours, _ = load_gguf(files["F32"])
    source = generate(files["source"], [PROMPT], max_new_tokens=4, return_logits=True)
    loaded = generate(ours, [PROMPT], max_new_tokens=4, return_logits=True)
    np.testing.assert_allclose(loaded.logits, source.logits, rtol=0, atol=1e-5)
    peer = llamacpp.LlamaCpp(files["F32"], n_ctx=48, threads=2)
    try:
        theirs, _ = peer.generate(PROMPT, 16)
    finally:
        peer.close()
    assert generate(ours, [PROMPT], max_new_tokens=16).tokens[0] == theirs


def test_without_the_wheel_the_error_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama" else real(name, *a))
    with pytest.raises(llamacpp.LlamaCppError, match="pip install --no-deps llama-cpp-cffi"):
        llamacpp.library()


def test_bench_llamacpp_times_again_a_rate_above_the_floor_on_both_sides(monkeypatch):
    """`bench llama-cpp` end to end on a tiny model: the two engines' reps alternate; with the reads saying 1 KB/s,
    every rate is above its floor, so both are timed again (llama.cpp in a fresh context) and the row is marked on
    both sides."""
    _peer_or_skip()
    from causal_lm.bench import common
    from causal_lm.config import Config, TrainConfig
    from causal_lm.train import Note

    monkeypatch.setattr(common, "SETTLE_SECONDS", 0.0)
    monkeypatch.setattr(llamacpp, "read_bandwidth", lambda quick=False: 1e3)
    monkeypatch.setattr(llamacpp, "machine_ceilings", lambda quick=False: {"mem_bw_bytes_per_s": 1e3})
    model = tiny_config("gqa", d_model=64, num_heads=4, mlp_dim=128, vocab_size=320, max_seq_len=64)
    config = Config(model=model, train=TrainConfig(seq_len=16))
    calls = []  # which engine each generation call ran on, in order
    peer_generate, ours_runner = llamacpp.LlamaCpp.generate, llamacpp._ours_runner
    monkeypatch.setattr(
        llamacpp.LlamaCpp, "generate", lambda self, *a: (calls.append("llama.cpp"), peer_generate(self, *a))[1]
    )

    def logged_runner(*a, **kw):
        run = ours_runner(*a, **kw)
        return lambda k: (calls.append("ours"), run(k))[1]

    monkeypatch.setattr(llamacpp, "_ours_runner", logged_runner)
    with pytest.warns(Note, match="timing artifact"):
        r = llamacpp.bench_llamacpp(config, types=("F32",), context=8, new_tokens=4, reps=2, threads=2)
    (w,) = r["rows"]
    assert w["retimed"] and w["ours_implausible"] and w["llama_cpp_implausible"]
    # after a warm-up of each, the two engines' reps alternate (so both meet the same minutes of a shared machine)
    assert calls[4:16] == ["llama.cpp"] * 3 + ["ours"] * 3 + ["llama.cpp"] * 3 + ["ours"] * 3, calls
    assert w["greedy_equal"] == w["new_tokens"] == 5
    table = llamacpp.format_llamacpp(r)
    assert table.count("%!") == 2 and "timing artifact" in table
