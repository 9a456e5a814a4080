"""tokenizer.json (the `tokenizers` library's format, what Hugging Face folders carry) for this project's
tokenizers: a tokenizers-library tokenizer as it is, the byte tokenizer as an equivalent byte-level BPE without
merges, with tokenizer_config.json and the chat template beside it."""

from __future__ import annotations

import json
import os
from typing import Any

from causal_lm.data.tokenizer import TokenizerError


def write_tokenizer_json(tokenizer, out_dir: str) -> bool:
    """Write tokenizer.json for `tokenizer`: a tokenizers-library one as it is, the byte tokenizer as an
    equivalent byte-level BPE without merges. Returns False for tokenizers with no tokenizer.json form."""
    d = tokenizer.to_dict() if hasattr(tokenizer, "to_dict") else {}
    if d.get("kind") == "hf":
        text = d["json"]
    elif d.get("kind") == "byte":
        text = byte_tokenizer_json(tokenizer)
    else:
        return False
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(text)
    # tokenizer_config.json: load it as the plain fast tokenizer it is (a model_type-specific class such as
    # LlamaTokenizerFast could add its own normalisation or BOS handling) and name the special tokens.
    from tokenizers import Tokenizer

    inner = Tokenizer.from_str(text)
    tc: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for key, attr in (("bos_token", "bos_id"), ("eos_token", "eos_id"), ("pad_token", "pad_id")):
        i = getattr(tokenizer, attr, None)
        if i is not None and inner.id_to_token(int(i)) is not None:
            tc[key] = inner.id_to_token(int(i))
    for key, value in (getattr(tokenizer, "special_tokens", None) or {}).items():
        tc.setdefault(key, value)
    if getattr(tokenizer, "add_bos", False):
        tc["add_bos_token"] = True
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tc, f, indent=2, ensure_ascii=False)
    if getattr(tokenizer, "chat_template", None):
        with open(os.path.join(out_dir, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(tokenizer.chat_template)
    return True


def byte_tokenizer_json(tokenizer) -> str:
    """tokenizer.json text equal to the project's ByteTokenizer: id b = byte b (a BPE over byte-level
    characters with no merges), then <s>, </s>, <pad> at its bos/eos/pad ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()  # the 256 printable stand-ins GPT-2's byte-level BPE uses for bytes
    # Order them by the byte they stand for: byte b -> id b.
    byte_to_char = _bytes_to_unicode()
    assert sorted(byte_to_char.values()) == sorted(alphabet)
    vocab = {byte_to_char[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = sorted([(tokenizer.bos_id, "<s>"), (tokenizer.eos_id, "</s>"), (tokenizer.pad_id, "<pad>")])
    if [i for i, _ in specials] != list(range(256, 256 + len(specials))):
        raise TokenizerError(f"byte tokenizer special ids {specials} are not 256, 257, 258")
    tok.add_special_tokens([AddedToken(name, special=True, normalized=False) for _, name in specials])
    return tok.to_str()


def _bytes_to_unicode() -> dict:
    """GPT-2's reversible byte -> printable character map (what tokenizers' ByteLevel uses)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))
