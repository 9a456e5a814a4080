"""Tokenizers. Byte-level is the default: 256 byte values + BOS, EOS, PAD, so any language (the seeds' Chinese
included) round-trips without a vocabulary file."""

from __future__ import annotations

import codecs
import json
import os


class ByteTokenizer:
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

    def to_dict(self) -> dict:
        return {"kind": self.kind}

    def save(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "tokenizer_meta.json"), "w") as f:
            json.dump(self.to_dict(), f)
