"""Helpers the seed experiments share: variants of one config, training them into workdirs, held-out batches,
JSON and figure output, and token labels for plots."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from causal_lm.config import Config, load_config
from causal_lm.data.pipeline import build_data
from causal_lm.train import load_for_inference, train_and_evaluate


def base_config(overrides: Sequence[str] = ()) -> Config:
    """The experiments' default model: the tiny preset's shape (2 layers, d_model 64, byte-level) on all of the
    built-in corpus, so one training run takes well under a minute on a laptop CPU."""
    return load_config("tiny", ["data.max_documents=0", "train.progress=false", "train.sample_tokens=0", *overrides])


def with_model(config: Config, **changes) -> Config:
    """`config` with model fields replaced (the one thing a variant changes)."""
    return dataclasses.replace(config, model=config.model.replace(**changes))


def train_variant(config: Config, workdir: str):
    """Train `config` in `workdir` (a rerun resumes or reuses it); returns (last record, model, tokenizer, config
    as trained)."""

    record = train_and_evaluate(config, workdir)
    model, tokenizer, trained = load_for_inference(workdir)
    return record, model, tokenizer, trained


def held_out_batches(config: Config, tokenizer, rows: int) -> list:
    """At least `rows` rows of the validation split (all of it if smaller), in fixed-shape batches."""

    bs = config.train.batch_size
    return build_data(config, tokenizer, max_val_batches=max(1, -(-rows // bs))).val


def document_positions(segment_ids: np.ndarray) -> np.ndarray:
    """Positions restarting at 0 wherever the segment id changes: what the model uses for packed rows."""
    T = segment_ids.shape[1]
    idx = np.broadcast_to(np.arange(T), segment_ids.shape)
    start = np.concatenate([np.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
    return idx - np.maximum.accumulate(np.where(start, idx, 0), axis=1)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _hidden(state, tokens, segment_ids, *, graphdef):
    return nnx.merge(graphdef, state).hidden_states(tokens, segment_ids=segment_ids)


def hidden_states(model, tokens, segment_ids=None) -> np.ndarray:
    """Jitted `model.hidden_states`: float32 [L+1, B, T, D]."""
    graphdef, state = nnx.split(model)
    return np.asarray(
        _hidden(
            state,
            np.asarray(tokens, np.int32),
            None if segment_ids is None else np.asarray(segment_ids, np.int32),
            graphdef=graphdef,
        ),
        np.float32,
    )


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed), with a CJK font as fallback when one is
    installed, so labels such as 小明 render; without one, `token_labels` avoids characters it cannot draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cjk = _cjk_font()
    if cjk and cjk not in plt.rcParams["font.sans-serif"]:
        plt.rcParams["font.sans-serif"] = ["DejaVu Sans", cjk] + list(plt.rcParams["font.sans-serif"])
        plt.rcParams["font.family"] = "sans-serif"
    return plt


_CJK_NAMES = (
    "Noto Sans CJK SC",
    "Noto Sans SC",
    "Noto Sans CJK JP",
    "Source Han Sans SC",
    "WenQuanYi Micro Hei",
    "WenQuanYi Zen Hei",
    "SimHei",
    "Microsoft YaHei",
    "PingFang SC",
    "Hiragino Sans GB",
    "Heiti SC",
    "AR PL UMing CN",
    "Droid Sans Fallback",
)


@functools.lru_cache(maxsize=1)
def _cjk_font() -> str | None:
    from matplotlib import font_manager

    names = {f.name for f in font_manager.fontManager.ttflist}
    return next((n for n in _CJK_NAMES if n in names), None)


def _drawable(ch: str) -> bool:
    return ch.isprintable() and (ord(ch) < 0x2E80 or _cjk_font() is not None)


def token_labels(tokenizer, ids: Sequence[int]) -> tuple[list[str], list[str]]:
    """(tick labels, legend lines) for the tokens of a plot axis.

    A byte-level tokenizer splits a CJK character into 3 tokens: the first byte is labelled with the character
    (or "c<k>", the k-th character, when no CJK font is installed; the legend then says which character that is)
    and the continuation bytes with "·". Other tokens are labelled with their text.
    """
    labels, legend = [], []
    if getattr(tokenizer, "kind", None) == "byte":
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        text = data.decode("utf-8", errors="replace")
        k = 0
        out = []
        for ch in text:
            n = len(ch.encode("utf-8")) if ch != "\ufffd" else 1
            k += 1
            name = ch if _drawable(ch) else f"c{k}"
            if name != ch:
                legend.append(f"c{k} = {ch} (bytes {' '.join(f'{b:02x}' for b in ch.encode('utf-8'))})")
            out += [name] + ["·"] * (n - 1)
        labels = out if len(out) == len(ids) else [f"{int(i):02x}" for i in ids]
        return labels, legend
    for i in ids:
        s = tokenizer.decode([int(i)])
        s = s if s and all(_drawable(c) for c in s) else f"#{int(i)}"
        labels.append(s.replace(" ", "␣").replace("\n", "⏎"))
    return labels, legend
