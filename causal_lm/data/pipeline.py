"""From a corpus to batches: tokenize (`Dataset.map`, batched, cached), split by document, pack, iterate.

A batch is a dict of numpy arrays, all [B, T]:

    tokens       int32    model inputs
    targets      int32    the next token of each input
    segment_ids  int32    documents packed into a row are numbered 1, 2, ...; 0 marks padding
    weights      float32  1 where the target is a real next token of the same document (and, with a loss mask,
                          a token the task trains on: a chat's assistant tokens), else 0

Packing: each document is encoded with EOS at its end, the documents are concatenated, and the stream is cut
into rows of T+1 tokens with stride T (so every token is a target exactly once). Each row's segment ids restart
at 1, and the model restarts positions and blocks attention at every segment boundary, so a document never sees
its neighbour. Validation documents are chosen by a hash of the document's index (the same rule for in-memory
and streamed corpora), so the split does not depend on the training seed or batch shape.

Iterators are resumable: `state()` is a small JSON-able dict saved with every checkpoint and `restore(state)`
continues with exactly the batch that would have come next.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np

from causal_lm.data.corpus import DataError, load_corpus
from causal_lm.data.tokenizer import tokenizer_from_spec

Batch = dict  # str -> np.ndarray [B, T]


def is_validation(doc_index, val_fraction: float):
    """Whether document `doc_index` (int or int array) is held out: a fixed multiplicative hash of the index."""
    h = (np.asarray(doc_index, np.uint64) * np.uint64(2654435761) + np.uint64(12345)) % np.uint64(2**32)
    return (h.astype(np.float64) / 2**32) < val_fraction


# ---- tokenization ------------------------------------------------------------------------------------------


def _encode_batch(tokenizer, texts: list[str]) -> list[list[int]]:
    if hasattr(tokenizer, "encode_batch"):
        ids = tokenizer.encode_batch(texts)
        return [x + [tokenizer.eos_id] for x in ids]
    return [tokenizer.encode(t, eos=True) for t in texts]


def tokenize(ds, tokenizer):
    """Map a text dataset to an "ids" column (each document + EOS), dropping blank documents.

    Batched `Dataset.map`: for file-backed datasets the result is cached by `datasets` and reused by the next run
    with the same files and tokenizer.
    """

    def fn(batch):
        texts = [t for t in batch["text"] if t and t.strip()]
        return {"ids": _encode_batch(tokenizer, texts)}

    kwargs = {} if _is_streaming(ds) else {"desc": "tokenizing"}
    return ds.map(fn, batched=True, batch_size=1000, remove_columns=["text"], **kwargs)


def _is_streaming(ds) -> bool:
    import datasets

    return isinstance(ds, datasets.IterableDataset)


def _flat_ids(ds) -> tuple[np.ndarray, np.ndarray]:
    """(all token ids concatenated [N] int32, document lengths [D]) straight from the Arrow column."""
    import pyarrow as pa

    col = ds.with_format("arrow")["ids"]
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    flats, lens = [], []
    for ch in chunks:
        if len(ch) == 0:
            continue
        flats.append(ch.flatten().to_numpy(zero_copy_only=False).astype(np.int32))
        offs = ch.offsets.to_numpy()
        lens.append(np.diff(offs).astype(np.int64))
    if not flats:
        return np.zeros((0,), np.int32), np.zeros((0,), np.int64)
    return np.concatenate(flats), np.concatenate(lens)


# ---- packing -----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class PackedRows:
    """Rows of T+1 tokens and their per-row segment ids (0 = padding): both int32 [R, T+1]; `mask` [R, T+1] bool
    (or None: every token) says which tokens are trained on as targets (SFT: the assistant's)."""

    tokens: np.ndarray
    segments: np.ndarray
    mask: np.ndarray | None = None

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1] - 1

    @property
    def num_target_tokens(self) -> int:
        return int(_weights(self.segments, self.mask).sum())


def pack(flat: np.ndarray, doc_lengths: np.ndarray, seq_len: int, pad_id: int, mask=None) -> PackedRows:
    """Cut the concatenated documents into rows of seq_len+1 tokens, stride seq_len (last row padded).

    mask: [N] bool beside `flat` (None: all tokens): which tokens are loss targets; it travels with its tokens."""
    n = len(flat)
    doc = np.repeat(np.arange(len(doc_lengths), dtype=np.int64), doc_lengths)
    rows = max(1, -(-(n - 1) // seq_len))
    total = rows * seq_len + 1
    flat = np.concatenate([flat, np.full(total - n, pad_id, np.int32)])
    doc = np.concatenate([doc, np.full(total - n, -1, np.int64)])
    idx = np.arange(rows)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]  # [R, T+1]
    tokens, docs = flat[idx], doc[idx]
    first = np.where(docs[:, :1] >= 0, docs[:, :1], 0)
    segments = np.where(docs >= 0, docs - first + 1, 0).astype(np.int32)  # documents are consecutive: 1, 2, ...
    rows_mask = None
    if mask is not None:
        mask = np.concatenate([np.asarray(mask, bool), np.zeros(total - n, bool)])
        rows_mask = mask[idx]
    return PackedRows(tokens.astype(np.int32), segments, rows_mask)


def _weights(segments: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    w = (segments[..., 1:] == segments[..., :-1]) & (segments[..., :-1] != 0)
    if mask is not None:  # the target (the next token) must be one the task trains on
        w = w & mask[..., 1:]
    return w.astype(np.float32)


def rows_to_batch(tokens: np.ndarray, segments: np.ndarray, mask: np.ndarray | None = None) -> Batch:
    """[B, T+1] rows -> a batch of inputs, next-token targets, segment ids and loss weights ([B, T] each).
    mask [B, T+1] bool (None: all): a target outside it gets weight 0 (SFT's non-assistant tokens)."""
    return {
        "tokens": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "segment_ids": segments[:, :-1],
        "weights": _weights(segments, mask),
    }


def eval_batches(rows: PackedRows, batch_size: int, max_batches: int | None = None) -> list[Batch]:
    """Rows in order, in batches of batch_size; the last one padded with all-padding rows (weights 0), so every
    batch has the same shape and one compiled program evaluates them all."""
    out = []
    n = len(rows)
    for start in range(0, n, batch_size):
        if max_batches is not None and len(out) >= max_batches:
            break
        t, s = rows.tokens[start : start + batch_size], rows.segments[start : start + batch_size]
        m = None if rows.mask is None else rows.mask[start : start + batch_size]
        if len(t) < batch_size:
            pad = batch_size - len(t)
            t = np.concatenate([t, np.zeros((pad, t.shape[1]), np.int32)])
            s = np.concatenate([s, np.zeros((pad, s.shape[1]), np.int32)])
            if m is not None:
                m = np.concatenate([m, np.zeros((pad, m.shape[1]), bool)])
        out.append(rows_to_batch(t, s, m))
    return out


# ---- iterators ---------------------------------------------------------------------------------------------


class TrainIterator:
    """Endless batches over packed rows, reshuffled every epoch by a permutation drawn from (seed, epoch).

    The state is (epoch, index into that epoch's permutation): restoring it continues exactly.
    """

    def __init__(self, rows: PackedRows, batch_size: int, seed: int):
        if len(rows) == 0:
            raise DataError("the training split packs into no rows")
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self.epoch, self.index = 0, 0
        # Multi-host: the rows of each global batch this process feeds to its devices (`parallel.process_rows`);
        # every process walks the same permutation, so the state (and a resume) is the same on all of them.
        self.local_rows: np.ndarray | None = None
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        picked = []
        need = self.batch_size
        while need:
            take = self._perm[self.index : self.index + need]
            picked.append(take)
            need -= len(take)
            self.index += len(take)
            if self.index == len(self._perm):
                self.epoch, self.index = self.epoch + 1, 0
                self._perm = self._permutation(self.epoch)
        idx = np.concatenate(picked)
        if self.local_rows is not None:
            idx = idx[self.local_rows]
        mask = None if self.rows.mask is None else self.rows.mask[idx]
        return rows_to_batch(self.rows.tokens[idx], self.rows.segments[idx], mask)

    def state(self) -> dict:
        return {"kind": "rows", "epoch": self.epoch, "index": self.index, "num_rows": len(self.rows)}

    def restore(self, state: dict) -> None:
        if state.get("kind") != "rows" or state.get("num_rows") != len(self.rows):
            raise DataError(
                f"the saved data-iterator state ({state}) does not fit this corpus "
                f"({len(self.rows)} rows): was data.corpus, data.tokenizer or train.seq_len changed?"
            )
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._perm = self._permutation(self.epoch)


class StreamingTrainIterator:
    """Batches packed on the fly from a streamed (`IterableDataset`) corpus, for corpora too big to hold.

    Documents come in stream order (no shuffle buffer: its contents could not be restored on resume); the state
    is the `datasets` stream position plus the tokens already pulled but not yet used, so resume is exact.
    """

    def __init__(self, ds, batch_size: int, seq_len: int, val_fraction: float, max_documents: int = 0):
        self.ds, self.batch_size, self.seq_len = ds, batch_size, seq_len
        self.val_fraction, self.max_documents = val_fraction, max_documents
        self.epoch, self.doc_index = 0, 0
        self.buf_tokens: list[int] = []
        self.buf_docs: list[int] = []
        self._it = None
        self._pulled_this_epoch = False
        self.local_rows: np.ndarray | None = None  # as TrainIterator.local_rows

    def _docs(self):
        if self._it is None:
            self.ds.set_epoch(self.epoch)
            self._it = iter(self.ds)
        return self._it

    def _pull(self) -> bool:
        """Append the next training document to the buffer; False at the end of an epoch."""
        while True:
            if self.max_documents and self.doc_index >= self.max_documents:
                return False
            try:
                ex = next(self._docs())
            except StopIteration:
                return False
            i = self.doc_index
            self.doc_index += 1
            if not is_validation(i, self.val_fraction):
                self._pulled_this_epoch = True
                self.buf_tokens.extend(int(t) for t in ex["ids"])
                self.buf_docs.extend([self.epoch * 2**40 + i] * len(ex["ids"]))  # unique across epochs
                return True

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        B, T = self.batch_size, self.seq_len
        need = B * T + 1
        while len(self.buf_tokens) < need:
            if not self._pull():  # end of the stream: the next epoch starts from its beginning
                if not self._pulled_this_epoch:
                    raise DataError("the streamed corpus yielded no training documents")
                self.epoch, self.doc_index, self._it, self._pulled_this_epoch = self.epoch + 1, 0, None, False
        toks = np.asarray(self.buf_tokens[:need], np.int32)
        docs = np.asarray(self.buf_docs[:need], np.int64)
        # Keep the last token: it is the next row's first input (stride T, rows of T+1).
        self.buf_tokens, self.buf_docs = self.buf_tokens[B * T :], self.buf_docs[B * T :]
        rows = np.arange(B) if self.local_rows is None else self.local_rows
        idx = rows[:, None] * T + np.arange(T + 1)[None, :]
        d = docs[idx]
        # A change of document id starts a new segment (ids are 1, 2, ... within each row).
        change = np.concatenate([np.zeros((B, 1), bool), d[:, 1:] != d[:, :-1]], axis=1)
        segments = (np.cumsum(change, axis=1) + 1).astype(np.int32)
        return rows_to_batch(toks[idx], segments)

    def state(self) -> dict:
        return {
            "kind": "stream",
            "epoch": self.epoch,
            "doc_index": self.doc_index,
            "source": self.ds.state_dict() if self._it is not None else None,
            "buf_tokens": list(self.buf_tokens),
            "buf_docs": list(self.buf_docs),
        }

    def restore(self, state: dict) -> None:
        if state.get("kind") != "stream":
            raise DataError(
                f"the saved data-iterator state is of kind {state.get('kind')!r}, not a stream: "
                "was data.streaming changed?"
            )
        self.epoch, self.doc_index = int(state["epoch"]), int(state["doc_index"])
        self.buf_tokens, self.buf_docs = list(state["buf_tokens"]), list(state["buf_docs"])
        self._it = None
        self._pulled_this_epoch = self.doc_index > 0
        if state["source"] is not None:
            self.ds.set_epoch(self.epoch)
            self.ds.load_state_dict(state["source"])
            self._it = iter(self.ds)


# ---- everything for a config -------------------------------------------------------------------------------


@dataclasses.dataclass
class DataSplits:
    """What training and evaluation need from the data section of a config."""

    tokenizer: Any
    train: Any  # TrainIterator | StreamingTrainIterator: next(train) -> Batch, .state(), .restore(state)
    val: list  # list[Batch]: the held-out documents, fixed shapes
    info: dict  # sizes for logs: documents, tokens

    _token_bytes: np.ndarray | None = None

    @property
    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes per token id (for bits per byte)."""
        if self._token_bytes is None:
            self._token_bytes = self.tokenizer.token_bytes()
        return self._token_bytes


def build_data(config, tokenizer=None, *, corpus: str | None = None, max_val_batches: int | None = None) -> DataSplits:
    """Train iterator and validation batches for `config` (a causal_lm Config).

    tokenizer: reuse this one (e.g. restored from a checkpoint) instead of building `data.tokenizer`.
    corpus: read this corpus spec instead of `data.corpus` (evaluation on other text).
    max_val_batches: cap the validation batches (default: `train.eval_batches`; 0 = all of the split).
    The same config always gives the same batches in the same order, so two models trained from it see the
    same data.
    """
    d, t = config.data, config.train
    spec = corpus or d.corpus
    if max_val_batches is None:
        max_val_batches = t.eval_batches
    streaming = d.streaming or spec.startswith("hf:")
    ds = load_corpus(spec, text_field=d.text_field, streaming=streaming)
    if streaming:
        return _build_streaming(ds, config, tokenizer, spec, max_val_batches)

    if d.max_documents:
        ds = ds.select(range(min(d.max_documents, len(ds))))
    if tokenizer is None:
        tokenizer = tokenizer_from_spec(d.tokenizer, ds["text"] if d.tokenizer == "char" else ())
    tok = tokenize(ds, tokenizer)
    flat, lengths = _flat_ids(tok)
    ndocs = len(lengths)
    if ndocs == 0:
        raise DataError(f"data.corpus={spec!r} holds no non-blank documents")
    if ndocs < 2:
        raise DataError(
            f"data.corpus={spec!r} holds a single document; a validation split needs at least two "
            "(.txt files are split into documents at blank lines)"
        )
    val = is_validation(np.arange(ndocs), d.val_fraction)
    if not val.any():
        val[-1] = True
    if val.all():
        val[0] = False
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])

    def gather(doc_ids):
        parts = [flat[starts[i] : starts[i] + lengths[i]] for i in doc_ids]
        return np.concatenate(parts), lengths[doc_ids]

    train_ids = np.flatnonzero(~val)
    train_ids = train_ids[np.random.default_rng(t.seed).permutation(len(train_ids))]  # mix documents across rows
    train_rows = pack(*gather(train_ids), t.seq_len, tokenizer.pad_id)
    val_rows = pack(*gather(np.flatnonzero(val)), t.seq_len, tokenizer.pad_id)
    info = {
        "documents": ndocs,
        "train_documents": int(len(train_ids)),
        "val_documents": int(val.sum()),
        "train_tokens": train_rows.num_target_tokens,
        "val_tokens": val_rows.num_target_tokens,
        "train_rows": len(train_rows),
        "val_rows": len(val_rows),
    }
    return DataSplits(
        tokenizer,
        TrainIterator(train_rows, t.batch_size, t.seed),
        eval_batches(val_rows, t.batch_size, max_val_batches or None),
        info,
    )


def _build_streaming(ds, config, tokenizer, spec: str, max_val_batches: int) -> DataSplits:
    d, t = config.data, config.train
    if tokenizer is None:
        sample = []
        if d.tokenizer == "char":  # the vocabulary from the first documents; later unseen characters -> UNK
            for i, ex in enumerate(ds):
                if i >= 5000:
                    break
                sample.append(ex["text"])
        tokenizer = tokenizer_from_spec(d.tokenizer, sample)
    tok = tokenize(ds, tokenizer)
    # Validation: the held-out documents from the start of the stream, enough for max_val_batches batches.
    want = (max_val_batches or 64) * t.batch_size * t.seq_len + 1
    flat, lens, n = [], [], 0
    for i, ex in enumerate(tok):
        if d.max_documents and i >= d.max_documents:
            break
        if is_validation(i, d.val_fraction):
            flat.append(np.asarray(ex["ids"], np.int32))
            lens.append(len(ex["ids"]))
            n += len(ex["ids"])
            if n >= want:
                break
    if not lens:
        raise DataError(f"data.corpus={spec!r}: the stream yielded no validation documents")
    val_rows = pack(np.concatenate(flat), np.asarray(lens), t.seq_len, tokenizer.pad_id)
    train = StreamingTrainIterator(tok, t.batch_size, t.seq_len, d.val_fraction, d.max_documents)
    info = {"documents": None, "val_documents": len(lens), "val_tokens": val_rows.num_target_tokens, "streaming": True}
    return DataSplits(tokenizer, train, eval_batches(val_rows, t.batch_size, max_val_batches or None), info)
