"""GGUF files (llama.cpp's format, the one most small models are shared in) -> this project's Decoder.

A GGUF file holds the whole checkpoint: metadata (architecture, shapes, RoPE base, the tokenizer's vocabulary,
merges, special ids and chat template) and the tensors, most of them quantized in blocks. It is read with the
`gguf` package (the GGUF project's own Python reader) and every tensor is dequantized to float32 with its
`dequantize` (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants Q2_K..Q6_K, the IQ types, ...). The
dequantized weights are exact: they are what llama.cpp itself multiplies with, so a file loads as the model it
is, quantization error included.

Names and layouts, per layer i (numpy order: the row of an nn.Linear weight first, as in Hugging Face):

    token_embd.weight        [V, D]        model.embed_tokens.weight
    blk.i.attn_norm.weight   [D]           input_layernorm.weight
    blk.i.attn_q.weight      [N*H, D]      self_attn.q_proj.weight   (rows permuted for llama, see below)
    blk.i.attn_k.weight      [K*H, D]      self_attn.k_proj.weight   (likewise)
    blk.i.attn_v.weight      [K*H, D]      self_attn.v_proj.weight
    blk.i.attn_output.weight [D, N*H]      self_attn.o_proj.weight
    blk.i.attn_{q,k,v}.bias                q/k/v biases (qwen2)
    blk.i.ffn_norm.weight    [D]           post_attention_layernorm.weight
    blk.i.ffn_{gate,up}      [F, D]        mlp.{gate,up}_proj.weight
    blk.i.ffn_down.weight    [D, F]        mlp.down_proj.weight
    output_norm.weight       [D]           model.norm.weight
    output.weight            [V, D]        lm_head.weight (absent: tied to the embedding)

so after renaming, the Hugging Face parameter table of interop/hf_weights.py applies unchanged: the weights are
read through its `read_params`, as a Hugging Face folder's are.

**The Q/K permutation.** llama.cpp's `llama` architecture rotates interleaved pairs (dims 2j, 2j+1) where
Hugging Face's Llama rotates halves (dims j, j + H/2). Its converter therefore permutes the rows of q_proj and
k_proj within each head, sending row j + h*(H/2) (half h of pair j) to row 2j + h. That is undone here; without it
the model runs with the wrong rotary pairs and writes fluent-looking nonsense. `qwen2` is converted without the
permutation (llama.cpp runs it with the halves layout), so it is read as is.

**The tokenizer** is rebuilt from the vocabulary as a `tokenizers` tokenizer: `gpt2`-type (byte-level BPE)
vocabularies with their merges and the pre-tokenizer `tokenizer.ggml.pre` names (gpt-2, llama-bpe for Llama 3,
qwen2, smollm/starcoder), and `llama`-type (SentencePiece BPE, Llama 2 and TinyLlama) with merges derived from the
token scores, byte fallback and the "▁" space. Tokens marked control become special tokens, user-defined ones
added tokens. BOS is
prepended when `tokenizer.ggml.add_bos_token` says so (llama.cpp's defaults where it is absent), and the stop ids
are EOS, the end-of-turn id and the chat template's end-of-turn token.

Refused, each with an error naming the setting: other architectures, mixture-of-experts files, RoPE scaling
(including Llama 3.1+'s `rope_freqs.weight`: not computed by the model here, so not approximated), partial
RoPE, per-layer head counts, tensor types `gguf` cannot dequantize, and vocabularies of other kinds (unigram
`t5`, byte-level BPE with an unknown pre-tokenizer, ...; pass a tokenizer.json with `--tokenizer` for those).
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np

from causal_lm.data.tokenizer import HFTokenizer
from causal_lm.interop.chat import end_of_turn_id
from causal_lm.interop.hf_config import HFFormatError, model_config_from_hf
from causal_lm.interop.hf_weights import model_from_params, param_table, read_params
from causal_lm.model.quant import QUANTIZED, QuantizedWeight
from causal_lm.model.weights import check_tensor

# general.architecture -> the Hugging Face architecture computing the same network
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# Architectures whose converter permutes the rows of attn_q / attn_k (interleaved RoPE pairs in llama.cpp).
_PERMUTED = {"llama"}

# Hugging Face tensor name (interop/hf_weights.py's table) -> GGUF tensor name
_HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.self_attn.q_proj.bias": "blk.{i}.attn_q.bias",
    "model.layers.{i}.self_attn.k_proj.bias": "blk.{i}.attn_k.bias",
    "model.layers.{i}.self_attn.v_proj.bias": "blk.{i}.attn_v.bias",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
}


def gguf_tensor_name(hf_name: str) -> str:
    """The GGUF name llama.cpp's converter gives a Hugging Face tensor (`model.layers.3.mlp.up_proj.weight` ->
    `blk.3.ffn_up.weight`); KeyError for a tensor the table above does not name."""
    if hf_name.startswith("model.layers."):
        i, rest = hf_name.removeprefix("model.layers.").split(".", 1)
        return _HF_TO_GGUF["model.layers.{i}." + rest].format(i=i)
    return _HF_TO_GGUF[hf_name]


# tokenizer.ggml.token_type values
_CONTROL, _USER_DEFINED = 3, 4

# tokenizer.ggml.pre -> how text is split before BPE (llama.cpp's table of pre-tokenizers, for the ones here).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# name -> (split regex, digits one by one first, NFC normalization, ignore_merges)
_PRE_TOKENIZERS = {
    "default": (_GPT2_SPLIT, False, False, False),
    "gpt-2": (_GPT2_SPLIT, False, False, False),
    "gpt2": (_GPT2_SPLIT, False, False, False),
    "llama-bpe": (_LLAMA3_SPLIT, False, False, True),
    "llama3": (_LLAMA3_SPLIT, False, False, True),
    "llama-v3": (_LLAMA3_SPLIT, False, False, True),
    "qwen2": (_QWEN2_SPLIT, False, True, False),
    "smollm": (_GPT2_SPLIT, True, False, False),
    "starcoder": (_GPT2_SPLIT, True, False, False),
    "refact": (_GPT2_SPLIT, True, False, False),
}


class GGUFFormatError(HFFormatError):
    """A GGUF file that is malformed or describes a model or tokenizer not supported here."""


# ---- reading ------------------------------------------------------------------------------------------------


def _reader(path: str):
    try:
        from gguf import GGUFReader
    except ImportError:
        raise GGUFFormatError(
            "reading GGUF files needs the gguf package: pip install -e '.[interop]' (or pip install gguf)"
        ) from None
    if not os.path.isfile(path):
        raise GGUFFormatError(f"{path!r} is not a file; expected a .gguf file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFFormatError(f"{path!r} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        return GGUFReader(path)
    except Exception as e:
        raise GGUFFormatError(f"{path!r}: the gguf reader cannot parse it: {type(e).__name__}: {e}") from None


def read_gguf_metadata(reader) -> dict:
    """Every metadata key of the file as plain Python values (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def _get(meta: dict, key: str, kind=int, default=None, *, required: bool = False):
    if key not in meta:
        if required:
            raise GGUFFormatError(f"the file has no {key!r} metadata, which describes the model's shape")
        return default
    v = meta[key]
    if isinstance(v, list):
        if len(set(v)) != 1:
            raise GGUFFormatError(f"{key}={v} differs between layers; only the same value on every layer is supported")
        v = v[0]
    return kind(v)


# ---- config -------------------------------------------------------------------------------------------------


def hf_config_from_gguf(meta: dict, tensors: dict) -> dict:
    """The Hugging Face config.json equivalent of a GGUF file's metadata (refusing what is not computed here).

    tensors: {name: shape in numpy order}."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFFormatError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)} "
            "(Llama, Mistral, SmolLM, TinyLlama ... files are 'llama'; Qwen2 and Qwen2.5 are 'qwen2')"
        )
    p = arch + "."
    if _get(meta, p + "expert_count", default=0):
        raise GGUFFormatError(
            f"{p}expert_count={meta[p + 'expert_count']}: a mixture-of-experts model, which is not supported"
        )
    if "rope_freqs.weight" in tensors:
        raise GGUFFormatError(
            "the file has rope_freqs.weight: Llama 3.1+ RoPE frequency scaling (rope_type 'llama3'), which the "
            "model here does not compute yet; refusing rather than loading it with plain RoPE"
        )
    scaling = meta.get(p + "rope.scaling.type", "none")
    factor = _get(meta, p + "rope.scaling.factor", float, 1.0)
    if scaling not in ("none", "") and not (scaling == "linear" and factor == 1.0):
        raise GGUFFormatError(
            f"{p}rope.scaling.type={scaling!r} (factor {factor:g}): RoPE scaling is not supported; only plain RoPE"
        )
    D = _get(meta, p + "embedding_length", required=True)
    N = _get(meta, p + "attention.head_count", required=True)
    K = _get(meta, p + "attention.head_count_kv", default=N) or N
    L = _get(meta, p + "block_count", required=True)
    F = _get(meta, p + "feed_forward_length", required=True)
    H = _get(meta, p + "attention.key_length", default=D // N)
    Hv = _get(meta, p + "attention.value_length", default=H)
    if Hv != H:
        raise GGUFFormatError(f"{p}attention.value_length={Hv} differs from key_length={H}; not supported")
    rope_dim = _get(meta, p + "rope.dimension_count", default=H)
    if rope_dim != H:
        raise GGUFFormatError(
            f"{p}rope.dimension_count={rope_dim} but the head dim is {H}: partial RoPE is not supported for {arch}"
        )
    if "token_embd.weight" not in tensors:
        raise GGUFFormatError("the file has no token_embd.weight (the token embedding)")
    vocab = tensors["token_embd.weight"][0]
    return {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": D,
        "intermediate_size": F,
        "num_hidden_layers": L,
        "num_attention_heads": N,
        "num_key_value_heads": K,
        "head_dim": H,
        "hidden_act": "silu",
        "max_position_embeddings": _get(meta, p + "context_length", default=2048),
        "rms_norm_eps": _get(meta, p + "attention.layer_norm_rms_epsilon", float, 1e-5),
        "rope_theta": _get(meta, p + "rope.freq_base", float, 10_000.0),
        "tie_word_embeddings": "output.weight" not in tensors,
    }


# ---- weights ------------------------------------------------------------------------------------------------


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: within each head, row 2j + h (pair j, element h) goes back to row
    j + h*(H/2), the rotate-half layout. Works on weights [n_heads*H, D] and biases [n_heads*H]."""
    H = w.shape[0] // n_heads
    return w.reshape(n_heads, H // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's conversion of q_proj / k_proj rows (the inverse of unpermute_qk), for writing test files."""
    H = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, H // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_tensor(t) -> np.ndarray:
    """A reader tensor as float32 in numpy order (GGUF lists dims innermost first)."""
    from gguf import GGMLQuantizationType, dequantize

    shape = tuple(int(n) for n in reversed(t.shape.tolist()))
    qtype = GGMLQuantizationType(t.tensor_type)
    try:
        w = dequantize(np.asarray(t.data), qtype)
    except NotImplementedError:
        raise GGUFFormatError(
            f"tensor {t.name!r} is {qtype.name}, which the gguf package cannot dequantize (this version: "
            "F32, F16, BF16, Q4_0/1, Q5_0/1, Q8_0, the K-quants and the IQ types)"
        ) from None
    return np.asarray(w, np.float32).reshape(shape)


class _GGUFTensors:
    """A GGUF file's tensors by Hugging Face name (hf_weights.TensorSource): dequantized, Q/K rows unpermuted, and
    checked finite and within a sane magnitude (GGUF carries no checksum)."""

    def __init__(self, reader, config, arch: str, source: str = "the GGUF file"):
        self.tensors = {t.name: t for t in reader.tensors}
        self.config, self.arch, self.source = config, arch, source

    def name(self, hf_name: str) -> str:
        gname = _HF_TO_GGUF.get(hf_name)
        if gname is None:
            raise GGUFFormatError(f"no GGUF name for parameter {hf_name!r} (an architecture this loader does not map)")
        return gname

    def read(self, name: str, spec: tuple) -> np.ndarray:
        expected = tuple(n for n, _ in spec)
        if name not in self.tensors:
            raise GGUFFormatError(f"the file has no tensor {name!r} (expected shape {list(expected)})")
        w = dequantize_tensor(self.tensors[name])
        check_tensor(w, name, self.source)
        if w.shape != expected:
            raise GGUFFormatError(f"tensor {name!r} has shape {list(w.shape)}, expected {list(expected)}")
        if self.arch in _PERMUTED and (".attn_q." in name or ".attn_k." in name):
            w = unpermute_qk(w, self.config.num_heads if ".attn_q." in name else self.config.num_kv_heads)
        return w


def load_gguf_params(reader, config, arch: str, source: str = "the GGUF file") -> dict:
    """Our parameters (nested dict of numpy arrays in config.param_dtype), dequantized, unpermuted, checked (shapes,
    and every tensor finite and within a sane magnitude)."""
    source = _GGUFTensors(reader, config, arch, source)
    params, used = read_params(config, source)
    extra = sorted(set(source.tensors) - used)
    if extra:
        shown = ", ".join(repr(n) for n in extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        raise GGUFFormatError(
            f"tensors {shown} have no place in this architecture (a feature not supported here); refusing to "
            "drop weights silently"
        )
    return params


# ---- tokenizer ----------------------------------------------------------------------------------------------


def _default_add_bos(model: str, pre: str) -> bool:
    """llama.cpp's default when tokenizer.ggml.add_bos_token is absent: SentencePiece and Llama 3 vocabularies
    prepend BOS, other byte-level ones do not."""
    return model == "llama" or pre in ("llama-bpe", "llama3", "llama-v3")


def _byte_level_bpe(meta: dict, tokens: list, source: str):
    """A `gpt2`-type vocabulary: byte-level BPE with the file's merges and the pre-tokenizer it names."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise GGUFFormatError(
            f"{source}: tokenizer.ggml.pre={pre!r} is a pre-tokenizer not reproduced here (known: "
            f"{', '.join(sorted(_PRE_TOKENIZERS))}); pass the model's tokenizer.json with --tokenizer"
        )
    split, digits, nfc, ignore_merges = _PRE_TOKENIZERS[pre]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    if not merges:
        raise GGUFFormatError(f"{source}: a byte-level BPE vocabulary without tokenizer.ggml.merges")
    tok = Tokenizer(models.BPE(vocab=_vocab(tokens, source), merges=merges, ignore_merges=ignore_merges))
    if nfc:
        tok.normalizer = normalizers.NFC()
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    steps += [
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    return tok, _default_add_bos("gpt2", pre)


def spm_merges(tokens: list, scores: list) -> list[tuple[str, str]]:
    """BPE merges equivalent to a SentencePiece BPE vocabulary, which stores scores instead of merges.

    Every way of cutting a token into two tokens of the vocabulary is a merge producing it; merges are ranked by
    the produced token's score (higher first), then by the lengths of the two parts (longer first), then by the
    vocabulary's order. This is the rule transformers uses to convert such vocabularies (tested equal).
    """
    vocab = set(tokens)
    merges = []
    for piece, score in zip(tokens, scores, strict=True):
        cuts = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        merges.extend((left, right, float(score)) for left, right in cuts)
    # Two cuts of one token differ in length, so full ties are between tokens: the sort is stable, they keep the
    # vocabulary's order.
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _sentencepiece_bpe(meta: dict, tokens: list, source: str):
    """A `llama`-type vocabulary (SentencePiece BPE: Llama 1/2, Mistral v0.1, TinyLlama): "▁" for spaces, byte
    tokens <0xNN> for characters outside the vocabulary, merges from the file or derived from the scores."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    elif "tokenizer.ggml.scores" in meta:
        merges = spm_merges(tokens, list(meta["tokenizer.ggml.scores"]))
    else:
        raise GGUFFormatError(f"{source}: a SentencePiece vocabulary with neither merges nor scores")
    tok = Tokenizer(models.BPE(vocab=_vocab(tokens, source), merges=merges, fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))  # a space before the text, as SentencePiece
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok, _default_add_bos("llama", "")


def _vocab(tokens: list, source: str) -> dict:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    if len(vocab) != len(tokens):
        raise GGUFFormatError(f"{source}: the vocabulary lists {len(tokens) - len(vocab)} tokens twice")
    return vocab


def gguf_tokenizer(meta: dict, source: str = "the GGUF file"):
    """The file's vocabulary as an HFTokenizer (a `tokenizers` BPE), with BOS handling, stop ids and the chat
    template from its metadata."""
    from tokenizers import AddedToken

    kind = meta.get("tokenizer.ggml.model")
    if kind is None or "tokenizer.ggml.tokens" not in meta:
        raise GGUFFormatError(f"{source} has no tokenizer (tokenizer.ggml.model / tokens); pass a tokenizer.json")
    builders = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}
    if kind not in builders:
        raise GGUFFormatError(
            f"{source}: tokenizer.ggml.model={kind!r} is not supported (rebuilt here: 'gpt2', byte-level BPE, and "
            "'llama', SentencePiece BPE); pass the model's tokenizer.json with --tokenizer"
        )
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    tok, default_add_bos = builders[kind](meta, tokens, source)
    added = [
        AddedToken(t, special=ty == _CONTROL, normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty in (_CONTROL, _USER_DEFINED)
    ]
    tok.add_tokens(added)

    def token_id(key):
        i = meta.get(f"tokenizer.ggml.{key}")
        return int(i) if isinstance(i, int) and 0 <= i < len(tokens) else None

    bos, eos, pad, unk = (token_id(k) for k in ("bos_token_id", "eos_token_id", "padding_token_id", "unknown_token_id"))
    special = {
        name: tokens[i]
        for name, i in (("bos_token", bos), ("eos_token", eos), ("unk_token", unk), ("pad_token", pad))
        if i is not None
    }
    template = meta.get("tokenizer.chat_template") or None
    stops = [i for i in (eos, token_id("eot_token_id")) if i is not None]
    if template is not None:
        eot = end_of_turn_id(tok, template, special)
        if eot is not None:
            stops.append(eot)
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    return HFTokenizer(
        tok.to_str(),
        bos_id=bos,
        eos_id=eos,
        pad_id=pad,
        source=source,
        add_bos=bool(add_bos) if add_bos is not None else default_add_bos,
        stop_ids=stops,
        chat_template=template,
        special_tokens=special,
    )


# ---- entry point --------------------------------------------------------------------------------------------


# ---- quantized tensors kept quantized ------------------------------------------------------------------------

# type -> (bytes per 32-element block, bits, has a minimum); the layouts of ggml-common.h
_KEPT = {"Q8_0": (34, 8, False), "Q4_0": (18, 4, False), "Q4_1": (20, 4, True)}


def raw_blocks(t):
    """A Q8_0 / Q4_0 / Q4_1 tensor's exact stored values in numpy order [rows, cols] (blocks of 32 along cols):
    (values, scale per element, minimum per element or None, bits); values are int8 q (Q8_0: w = q * d) or the
    nibbles 0..15 (Q4_0: w = (n - 8) * d, Q4_1: w = n * d + m). None for any other type."""
    from gguf import GGMLQuantizationType

    kind = GGMLQuantizationType(t.tensor_type).name
    if kind not in _KEPT:
        return None
    size, bits, has_min = _KEPT[kind]
    rows, cols = (int(n) for n in reversed(t.shape.tolist()))
    b = np.asarray(t.data).reshape(-1).view(np.uint8).reshape(rows, cols // 32, size)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, blocks]
    m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if has_min else None
    qs = b[..., 4 if has_min else 2 :]
    if bits == 8:
        v = qs.view(np.int8)
    else:  # byte j of a block: element j in its low nibble, element j + 16 in its high one
        v = np.concatenate([qs & 15, qs >> 4], axis=-1)
    spread = lambda a: np.repeat(a, 32, axis=1)  # noqa: E731  (per block -> per element)
    return v.reshape(rows, cols), spread(d), None if m is None else spread(m), bits


def keep_quantized(model, reader, arch: str):
    """The model read from the file with each weight the file stores as Q8_0 / Q4_0 / Q4_1 replaced by those exact
    blocks (model/quant.py's int8 / int4 storage, groups of 32 along the input): no requantization error. Weights
    of other types (F32, F16, the K-quants, ...), and a stacked weight whose layers differ in type, stay as read
    (dequantized float)."""

    c = model.config
    tensors = {t.name: t for t in reader.tensors}
    table = {p.ours: p for p in param_table(c)}
    targets = [(("embed",), model, "embed", 1), (("lm_head",), model, "lm_head", 1)]
    for mod_name, module in (("attn", model.blocks.attn), ("mlp", model.blocks.mlp)):
        for name, n_in in QUANTIZED.get(type(module).__name__, {}).items():
            targets.append((("blocks", mod_name, name), module, name, n_in))
    kinds = []
    for ours, module, name, n_in in targets:
        p = table.get(ours)
        if p is None or not hasattr(module, name):
            continue
        gname = _HF_TO_GGUF[p.hf]
        names = [gname.format(i=i) for i in range(c.num_layers)] if p.per_layer else [gname]
        raws = [raw_blocks(tensors[n]) for n in names]
        if any(r is None for r in raws) or len({(r[3], r[2] is None) for r in raws}) != 1:
            continue
        bits, has_min = raws[0][3], raws[0][2] is not None
        embed = ours == ("embed",)
        layers = []
        for n, (v, d, m, _) in zip(names, raws, strict=True):
            parts = []
            for a in (v, d) + ((m,) if has_min else ()):
                if arch in _PERMUTED and (".attn_q." in n or ".attn_k." in n):
                    a = unpermute_qk(a, c.num_heads if ".attn_q." in n else c.num_kv_heads)
                a = p.to_ours(a, c)  # the float path's own layout change, applied to the values and their scales
                a = a.T if embed else a.reshape(int(np.prod(a.shape[:n_in])), -1)  # [NI, NO], blocks along NI
                parts.append(np.ascontiguousarray(a))
            v, d = parts[0], parts[1]
            ni, no = v.shape
            scale = d.reshape(ni // 32, 32, no)[:, 0, :]
            minimum = parts[2].reshape(ni // 32, 32, no)[:, 0, :] if has_min else None
            if bits == 8:
                data = v.astype(np.int8)
            else:
                nib = v.astype(np.uint8).reshape(ni // 32, 32, no)
                data = nib[:, :16] | (nib[:, 16:] << 4)
            layers.append((data, scale, minimum))
        stack = (lambda xs: np.stack(xs)) if p.per_layer else (lambda xs: xs[0])
        data, scale = stack([x[0] for x in layers]), stack([x[1] for x in layers])
        minimum = stack([x[2] for x in layers]) if has_min else None
        shape = tuple(getattr(module, name)[...].shape[1 if p.per_layer else 0 :])
        in_shape, out_shape = (shape[1:], shape[:1]) if embed else (shape[:n_in], shape[n_in:])
        q = QuantizedWeight(
            jnp.asarray(data), jnp.asarray(scale), None if minimum is None else jnp.asarray(minimum),
            bits=bits, group=32, in_shape=in_shape, out_shape=out_shape, embed=embed,
        )  # fmt: skip
        setattr(module, name, q)
        kinds.append((bits, has_min))
    if kinds:  # the format most weights have (a file may mix them; such a model is not rebuilt from its config)
        bits, has_min = max(set(kinds), key=kinds.count)
        model.config = c.replace(weights=f"int{bits}", weights_group_size=32, weights_minimums=has_min)
    return model


def load_gguf(
    path: str,
    *,
    param_dtype: str = "float32",
    dtype: str | None = None,
    max_seq_len: int | None = None,
    load_tokenizer: bool = True,
    dequantize: bool = True,
):
    """Read a GGUF file (Llama or Qwen2 family, any quantization `gguf` dequantizes): (model, tokenizer or None).

    Weights are dequantized to float32 and stored in param_dtype (default float32; "bfloat16" halves memory);
    dtype: compute dtype (default: param_dtype). max_seq_len: the context to allow (default: the file's
    context_length). The tokenizer is rebuilt from the file's vocabulary (None with load_tokenizer=False).
    dequantize=False: Q8_0 / Q4_0 / Q4_1 weights stay quantized, exactly the file's blocks (int8 / int4 with
    scales, and minimums for Q4_1; see `keep_quantized`); other types (the K-quants) load dequantized.
    """
    path = os.fspath(path)
    reader = _reader(path)
    meta = read_gguf_metadata(reader)
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape.tolist())) for t in reader.tensors}
    hf = hf_config_from_gguf(meta, shapes)
    try:
        config = model_config_from_hf(hf, param_dtype=param_dtype, dtype=dtype, max_seq_len=max_seq_len)
    except HFFormatError as e:
        raise GGUFFormatError(f"{path!r}: {str(e).replace('config.json', 'the GGUF metadata')}") from None
    # The tokenizer first: it is quick, and a vocabulary that cannot be rebuilt should fail before the weights.
    tokenizer = gguf_tokenizer(meta, source=path) if load_tokenizer else None
    model = model_from_params(config, load_gguf_params(reader, config, meta["general.architecture"], path))
    if not dequantize:
        model = keep_quantized(model, reader, meta["general.architecture"])
    return model, tokenizer
