"""Tokenizers: byte-level (the default), character-level, and any `tokenizers` library `tokenizer.json`.

All three share one interface, so training, evaluation and generation never ask which one they hold:

    vocab_size, bos_id, eos_id, pad_id      ints
    encode(text, bos=False, eos=False)      -> list[int]
    decode(ids)                             -> str (special ids dropped)
    stream_decoder()                        -> callable(ids) -> text, for printing tokens as they arrive
    token_bytes()                           -> int array [vocab_size]: UTF-8 bytes each id stands for
                                               (0 for specials; used for bits per byte)
    to_dict() / save(directory)             the whole tokenizer as JSON-able data / files in a directory

`tokenizer_from_spec(spec, texts)` builds one from a config string ("byte", "char", or a path to a
tokenizer.json); `tokenizer_from_dict(d)` and `load_tokenizer(directory)` restore a saved one exactly.
"""

from __future__ import annotations

import codecs
import json
import os
import warnings
from collections.abc import Iterable

import numpy as np

TOKENIZER_FILE = "tokenizer_meta.json"


class TokenizerError(ValueError):
    """A tokenizer spec or file that cannot be used."""


class ByteTokenizer:
    """UTF-8 bytes 0..255 plus BOS 256, EOS 257, PAD 258: any language round-trips without a vocabulary file."""

    kind = "byte"

    def __init__(self):
        self.bos_id, self.eos_id, self.pad_id = 256, 257, 258
        self.vocab_size = 259

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def stream_decoder(self):
        """A callable that turns ids into text as they arrive, holding back incomplete UTF-8 sequences."""
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return lambda ids: dec.decode(bytes(int(i) for i in ids if 0 <= int(i) < 256))

    def token_bytes(self) -> np.ndarray:
        return np.array([1] * 256 + [0, 0, 0], np.int64)

    def to_dict(self) -> dict:
        return {"kind": self.kind}

    def save(self, directory: str) -> None:
        _write_meta(directory, self.to_dict())


class UnknownCharactersWarning(UserWarning):
    """Text held characters the tokenizer has no id for; they were encoded as its UNK id."""


class CharTokenizer:
    """One id per character seen in the training text (sorted), then BOS, EOS, PAD and UNK.

    Characters not in the vocabulary encode to UNK and decode to U+FFFD, so new text never breaks encoding, and
    never silently: `encode` warns (UnknownCharactersWarning) naming them, and `encode_batch` (the corpus path)
    warns once per batch of documents.
    """

    kind = "char"

    def __init__(self, chars: Iterable[str]):
        self.chars = sorted(set(chars))
        if not self.chars:
            raise TokenizerError("a character tokenizer needs at least one character of training text")
        if any(len(c) != 1 for c in self.chars):
            raise TokenizerError("CharTokenizer vocabulary entries must be single characters")
        n = len(self.chars)
        self._index = {c: i for i, c in enumerate(self.chars)}
        self.bos_id, self.eos_id, self.pad_id, self.unk_id = n, n + 1, n + 2, n + 3
        self.vocab_size = n + 4

    @classmethod
    def from_texts(cls, texts: Iterable[str]) -> CharTokenizer:
        chars: set[str] = set()
        for t in texts:
            chars.update(t)
        return cls(chars)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        get, unk = self._index.get, self.unk_id
        ids = [get(c, unk) for c in text]
        if unk in ids:
            self._warn_unknown(text, 1)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text (no BOS/EOS), with one warning for the whole batch."""
        get, unk = self._index.get, self.unk_id
        out = [[get(c, unk) for c in t] for t in texts]
        hit = [t for t, ids in zip(texts, out, strict=True) if unk in ids]
        if hit:
            self._warn_unknown("".join(hit), len(hit))
        return out

    def unknown_characters(self, text: str) -> list[str]:
        """The distinct characters of `text` that have no id (in order of first appearance)."""
        return list(dict.fromkeys(c for c in text if c not in self._index))

    def _warn_unknown(self, text: str, texts: int) -> None:

        unknown = self.unknown_characters(text)
        shown = ", ".join(f"{c!r} (U+{ord(c):04X})" for c in unknown[:10])
        more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
        where = "the text contains" if texts == 1 else f"{texts} documents contain"
        warnings.warn(
            f"{where} {len(unknown)} character(s) the char tokenizer has no id for: {shown}{more}; "
            f"each was encoded as UNK (id {self.unk_id}), which decodes to U+FFFD",
            UnknownCharactersWarning,
            stacklevel=3,
        )

    def decode(self, ids) -> str:
        n = len(self.chars)
        return "".join(self.chars[i] if i < n else "\ufffd" for i in map(int, ids) if 0 <= i < n or i == self.unk_id)

    def stream_decoder(self):
        return self.decode  # every id is a whole character: nothing to hold back

    def token_bytes(self) -> np.ndarray:
        return np.array([len(c.encode("utf-8")) for c in self.chars] + [0, 0, 0, 3], np.int64)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "chars": "".join(self.chars)}

    def save(self, directory: str) -> None:
        _write_meta(directory, self.to_dict())


# Special tokens looked up (in this order) in a tokenizer.json that does not say which ids BOS/EOS/PAD are.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<|startoftext|>", "[CLS]", "<|endoftext|>", "<bos>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<|im_end|>", "[SEP]", "<eos>")
_PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|finetune_right_pad_id|>")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer.json (BPE, WordPiece, Unigram ...), with the checkpoint's settings.

    BOS/EOS/PAD are found among the usual special-token names; a tokenizer with none of them uses EOS for all
    three (documents are separated by EOS during training). The JSON text itself is what gets saved, so a
    checkpoint restores the exact tokenizer, and with it what the checkpoint says about using it:

    add_bos         prepend BOS to a prompt (`encode_prompt`): the tokenizer config's `add_bos_token`, or the
                    tokenizer.json post-processor's own BOS. `encode` never applies the post-processor, and
                    `encode_prompt` adds BOS once (not when the text already starts with it), so it is never doubled.
    stop_ids        ids that end a generation: EOS, every EOS id of generation_config.json and the chat template's
                    end-of-turn token.
    chat_template   the Jinja chat template (None: the checkpoint has none); `causal_lm.apply_chat_template`.
    special_tokens  the named special tokens the checkpoint declares ({"bos_token": "<s>", ...}): the variables a
                    chat template sees.
    """

    kind = "hf"

    def __init__(
        self,
        json_text: str,
        *,
        bos_id=None,
        eos_id=None,
        pad_id=None,
        source: str = "tokenizer.json",
        add_bos: bool | None = None,
        stop_ids: Iterable[int] | None = None,
        chat_template: str | None = None,
        special_tokens: dict | None = None,
    ):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_str(json_text)
        except Exception as e:  # the library raises plain Exceptions with a serde message
            raise TokenizerError(f"{source} is not a valid tokenizers tokenizer.json: {e}") from None
        self._json = json_text
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        vocab = self._tok.get_vocab(with_added_tokens=True)

        def find(names):
            return next((vocab[n] for n in names if n in vocab), None)

        self.eos_id = eos_id if eos_id is not None else find(_EOS_NAMES)
        if self.eos_id is None:
            raise TokenizerError(f"{source} has no end-of-text token (looked for {', '.join(_EOS_NAMES)})")
        self.bos_id = (
            bos_id if bos_id is not None else (find(_BOS_NAMES) if find(_BOS_NAMES) is not None else self.eos_id)
        )
        self.pad_id = (
            pad_id if pad_id is not None else (find(_PAD_NAMES) if find(_PAD_NAMES) is not None else self.eos_id)
        )
        self._special = {self.bos_id, self.eos_id, self.pad_id}
        self._byte_level = '"ByteLevel"' in json_text.replace(" ", "")
        self.add_bos = bool(add_bos) or self._post_processor_adds_bos()
        stops = [self.eos_id] + [int(i) for i in (stop_ids or ())]
        self.stop_ids = tuple(dict.fromkeys(i for i in stops if 0 <= i < self.vocab_size))  # ordered, unique
        if chat_template is not None and not isinstance(chat_template, str):
            raise TokenizerError(f"{source}: chat_template must be a string (got {type(chat_template).__name__})")
        self.chat_template = chat_template or None
        if special_tokens is None:
            special_tokens = {
                name: self._tok.id_to_token(i)
                for name, i in (("bos_token", bos_id), ("eos_token", eos_id), ("pad_token", pad_id))
                if i is not None and self._tok.id_to_token(i) is not None
            }
        self.special_tokens = {k: str(v) for k, v in special_tokens.items() if v is not None}

    def _post_processor_adds_bos(self) -> bool:
        """Whether tokenizer.json's post-processor puts BOS in front of a text (Llama 3, Gemma: TemplateProcessing)."""
        try:
            with_specials = self._tok.encode("a", add_special_tokens=True).ids
            plain = self._tok.encode("a", add_special_tokens=False).ids
        except Exception:  # a post-processor that cannot run on its own: treat as no BOS
            return False
        return len(with_specials) > len(plain) and with_specials[:1] == [self.bos_id] and plain[:1] != [self.bos_id]

    @classmethod
    def from_file(cls, path: str) -> HFTokenizer:
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise TokenizerError(
                f"tokenizer file {path!r} does not exist (data.tokenizer takes 'byte', 'char' "
                "or the path of a tokenizers tokenizer.json)"
            )
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError:
            raise TokenizerError(f"tokenizer file {path!r} is not UTF-8 text") from None
        return cls(text, source=path)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_prompt(self, text: str) -> list[int]:
        """`text` as a model input: BOS in front when the checkpoint asks for it and the text does not already
        start with it (a rendered chat template usually writes its own BOS)."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id] + ids if self.add_bos and ids[:1] != [self.bos_id] else ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size], skip_special_tokens=True)

    def stream_decoder(self):
        """Decode the whole sequence so far and emit what is new; hold back text ending in a partial character."""
        ids: list[int] = []
        emitted = [0]

        def step(new_ids):
            ids.extend(int(i) for i in new_ids)
            text = self.decode(ids)
            if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the next token
                return ""
            out = text[emitted[0] :]
            emitted[0] = len(text)
            return out

        return step

    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes per id. Byte-level BPE tokens are strings over GPT-2's 256-character byte alphabet (one
        character per byte, so a token may hold part of a character); byte-fallback tokens "<0xNN>" are one byte;
        other tokens are measured by decoding them."""
        byte_alphabet = set(_gpt2_byte_chars())
        out = np.zeros(self.vocab_size, np.int64)
        for i in range(self.vocab_size):
            if i in self._special:
                continue
            piece = self._tok.id_to_token(i) or ""
            if self._byte_level and piece and all(ch in byte_alphabet for ch in piece):
                out[i] = len(piece)
            elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                out[i] = 1
            else:
                out[i] = len(self._tok.decode([i], skip_special_tokens=True).encode("utf-8"))
        return out

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "json": self._json,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "pad_id": self.pad_id,
            "add_bos": self.add_bos,
            "stop_ids": list(self.stop_ids),
            "chat_template": self.chat_template,
            "special_tokens": dict(self.special_tokens),
        }

    def save(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "tokenizer.json"), "w", encoding="utf-8") as f:
            f.write(self._json)
        meta = {k: v for k, v in self.to_dict().items() if k != "json"}
        _write_meta(directory, meta)


def _gpt2_byte_chars() -> list[str]:
    """The 256 printable characters byte-level BPE (GPT-2) uses to stand for bytes 0..255."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def _write_meta(directory: str, meta: dict) -> None:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, TOKENIZER_FILE), "w", encoding="utf-8") as f:
        json.dump(meta, f, ensure_ascii=False)


def tokenizer_from_dict(d: dict):
    """Rebuild a tokenizer from its `to_dict()`."""
    kind = d.get("kind")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "char":
        return CharTokenizer(d["chars"])
    if kind == "hf":  # the settings keys are absent in tokenizers saved before they existed: defaults then
        return HFTokenizer(
            d["json"],
            bos_id=d.get("bos_id"),
            eos_id=d.get("eos_id"),
            pad_id=d.get("pad_id"),
            add_bos=d.get("add_bos"),
            stop_ids=d.get("stop_ids"),
            chat_template=d.get("chat_template"),
            special_tokens=d.get("special_tokens"),
        )
    raise TokenizerError(f"unknown tokenizer kind {kind!r} (known: byte, char, hf)")


def load_tokenizer(directory: str):
    """The tokenizer saved in `directory` by `save()` (a workdir's tokenizer/ folder)."""
    meta_path = os.path.join(directory, TOKENIZER_FILE)
    if not os.path.isfile(meta_path):
        if os.path.isfile(os.path.join(directory, "tokenizer.json")):  # a bare Hugging Face tokenizer folder
            return HFTokenizer.from_file(directory)
        raise TokenizerError(f"no saved tokenizer in {directory!r} (expected {TOKENIZER_FILE})")
    with open(meta_path, encoding="utf-8") as f:
        meta = json.load(f)
    if meta.get("kind") == "hf" and "json" not in meta:
        with open(os.path.join(directory, "tokenizer.json"), encoding="utf-8") as f:
            meta["json"] = f.read()
    return tokenizer_from_dict(meta)


def tokenizer_from_spec(spec: str, texts: Iterable[str] = ()):
    """Build the tokenizer `data.tokenizer` names: "byte", "char" (vocabulary from `texts`), or a tokenizer.json
    path (a file, or a directory holding one)."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == "char":
        return CharTokenizer.from_texts(texts)
    if spec.endswith(".json") or os.path.exists(spec):
        return HFTokenizer.from_file(spec)
    raise TokenizerError(
        f"data.tokenizer={spec!r}: expected 'byte', 'char' or the path of a tokenizer.json (no such file)"
    )
