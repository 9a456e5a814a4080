"""Data: tokenizers round-trip, the built-in corpus is real, packing keeps documents apart, the validation split is
by document, iterators reshuffle per epoch and resume exactly, and bad corpora fail with the file's name."""

import json
import os

import numpy as np
import pytest

from causal_lm.config import apply_overrides, load_config
from causal_lm.data import (
    ByteTokenizer,
    CharTokenizer,
    DataError,
    HFTokenizer,
    build_data,
    builtin_documents,
    load_tokenizer,
    pack,
    tokenizer_from_dict,
    tokenizer_from_spec,
)
from causal_lm.data.pipeline import TrainIterator, is_validation, rows_to_batch

TEXTS = ["Hello, world. The cat sat.", "多头注意力 and 因果掩码", "tabs\tand\nnewlines  é"]


def _hf_tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<pad>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXTS * 20, trainer)
    return tok.to_str()


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(_hf_tokenizer_json())
    return [ByteTokenizer(), CharTokenizer.from_texts(TEXTS), tokenizer_from_spec(str(path))]


def test_tokenizers_round_trip_and_restore(tokenizers, tmp_path):
    for tok in tokenizers:
        specials = {tok.bos_id, tok.eos_id, tok.pad_id}
        assert max(specials) < tok.vocab_size
        for text in TEXTS:
            ids = tok.encode(text, bos=True, eos=True)
            assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
            assert all(0 <= i < tok.vocab_size for i in ids)
            assert tok.decode(ids) == text, tok.kind
            # Streaming one id at a time gives the same text (multi-byte characters held back, not mangled).
            dec = tok.stream_decoder()
            assert "".join(dec([i]) for i in tok.encode(text)) == text, tok.kind
        table = tok.token_bytes()
        assert table.shape == (tok.vocab_size,) and table[tok.eos_id] == 0
        body = tok.encode(TEXTS[1])
        assert table[body].sum() == len(TEXTS[1].encode("utf-8")), tok.kind  # bits-per-byte denominators
        # Saved and restored (from a directory and from its dict), the tokenizer encodes identically.
        d = tmp_path / tok.kind
        tok.save(str(d))
        for restored in (load_tokenizer(str(d)), tokenizer_from_dict(json.loads(json.dumps(tok.to_dict())))):
            assert type(restored) is type(tok) and restored.vocab_size == tok.vocab_size
            assert restored.encode(TEXTS[0]) == tok.encode(TEXTS[0])
    char = tokenizers[1]
    assert char.decode(char.encode("Hello ¿")) == "Hello \ufffd"  # unseen character -> UNK, not a crash
    assert isinstance(tokenizers[2], HFTokenizer) and tokenizers[2].pad_id != tokenizers[2].eos_id


def test_tokenizer_spec_errors(tmp_path):
    with pytest.raises(ValueError, match="no_such.json"):
        tokenizer_from_spec(str(tmp_path / "no_such.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        tokenizer_from_spec(str(bad))


def test_builtin_corpus_is_real_prose():
    docs = builtin_documents()
    text = "\n".join(docs)
    assert len(text.encode("utf-8")) >= 400_000
    assert len(docs) > 100  # enough documents for a validation split by document
    letters = sum(c.isalpha() or c.isspace() for c in text) / len(text)
    assert letters > 0.8, "mostly words, not code or binary"
    assert text.count(" the ") > 2000


def test_pack_keeps_documents_apart():
    docs = [np.arange(1, 6), np.arange(10, 13), np.arange(20, 31)]  # lengths 5, 3, 11
    flat = np.concatenate(docs).astype(np.int32)
    rows = pack(flat, np.array([5, 3, 11]), seq_len=4, pad_id=99)
    b = rows_to_batch(rows.tokens, rows.segments)
    # Stride T, rows of T+1: every token after the first is a target exactly once, padding never.
    targets = b["targets"][b["weights"] > 0]
    expected = np.concatenate([d[1:] for d in docs])  # the first token of a document is never predicted
    np.testing.assert_array_equal(targets, expected)
    # A target is weighted only inside its input's document; segments restart at 1 in each row, 0 = padding.
    w, seg = b["weights"], b["segment_ids"]
    doc_of = {int(t): i for i, d in enumerate(docs) for t in d}
    for r in range(len(w)):
        assert seg[r, 0] == 1
        for j in range(w.shape[1]):
            src, dst = int(b["tokens"][r, j]), int(b["targets"][r, j])
            same = dst in doc_of and src in doc_of and doc_of[src] == doc_of[dst]
            assert bool(w[r, j]) == same
            assert (seg[r, j] == 0) == (src == 99)
    assert rows.tokens[-1, -1] == 99  # the last row is padded, not dropped


def _write_docs(path, n=40):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"body": f"<doc{i:03d}> " + "lorem ipsum dolor " * (i % 7 + 3), "id": i}) + "\n")


def test_validation_split_is_by_document_and_deterministic(tmp_path):
    path = tmp_path / "docs.jsonl"
    _write_docs(path)
    config = load_config(
        "tiny",
        [
            f"data.corpus={path}",
            "data.text_field=body",
            "data.val_fraction=0.2",
            "train.batch_size=4",
            "train.seq_len=32",
            "data.max_documents=0",
        ],
    )
    data = build_data(config)
    tok = data.tokenizer
    train_text = tok.decode(data.train.rows.tokens[:, :-1].ravel())  # rows overlap by one token
    val_text = "".join(
        tok.decode(b["tokens"][i]) for b in build_data(config, max_val_batches=0).val for i in range(len(b["tokens"]))
    )
    val_ids = [i for i in range(40) if is_validation(i, 0.2)]
    assert 2 <= len(val_ids) <= 20
    for i in range(40):
        marker = f"<doc{i:03d}>"
        assert (marker in val_text) == (i in val_ids)
        assert (marker in train_text) == (i not in val_ids)
    # Same config -> same batches; a different seed reorders them but never changes the split.
    again = build_data(config)
    np.testing.assert_array_equal(next(data.train)["tokens"], next(again.train)["tokens"])
    other = build_data(apply_overrides(config, ["train.seed=1"]))
    assert not np.array_equal(next(other.train)["tokens"], next(build_data(config).train)["tokens"])
    np.testing.assert_array_equal(other.val[0]["tokens"], data.val[0]["tokens"])


def test_iterator_reshuffles_each_epoch_and_resumes_exactly():
    rows = pack(np.arange(1, 200, dtype=np.int32), np.array([199]), seq_len=9, pad_id=0)
    assert len(rows) == 22
    it = TrainIterator(rows, batch_size=5, seed=3)
    first_tokens = [next(it)["tokens"][:, 0] for _ in range(5)]  # 25 rows: crosses into epoch 1
    epoch0 = np.concatenate(first_tokens)[:22]
    assert sorted(epoch0.tolist()) == sorted(rows.tokens[:, 0].tolist())  # each row once per epoch
    assert it.epoch == 1
    state = json.loads(json.dumps(it.state()))
    ahead = [next(it)["tokens"] for _ in range(7)]  # into epoch 2
    it2 = TrainIterator(rows, batch_size=5, seed=3)
    it2.restore(state)
    for a in ahead:
        np.testing.assert_array_equal(next(it2)["tokens"], a)
    perms = [it._permutation(e) for e in range(3)]
    assert not np.array_equal(perms[0], perms[1]) and not np.array_equal(perms[1], perms[2])
    with pytest.raises(DataError, match="does not fit"):
        TrainIterator(pack(np.arange(1, 50, dtype=np.int32), np.array([49]), 9, 0), 5, 3).restore(state)


def test_local_formats_txt_parquet_glob_and_streaming_resume(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.txt").write_text("first paragraph here.\n\nsecond one, longer than the first.\n\nthird.\n")
    (tmp_path / "b.txt").write_text("another file.\n\nand its second paragraph.\n")
    config = load_config(
        "tiny", [f"data.corpus={tmp_path}/*.txt", "train.batch_size=2", "train.seq_len=16", "data.val_fraction=0.3"]
    )
    data = build_data(config)
    assert data.info["documents"] == 5  # paragraphs are documents
    pq.write_table(pa.table({"text": [f"row {i} " * 5 for i in range(30)]}), tmp_path / "t.parquet")
    assert build_data(apply_overrides(config, [f"data.corpus={tmp_path / 't.parquet'}"])).info["documents"] == 30

    path = tmp_path / "docs.jsonl"
    _write_docs(path)
    stream = apply_overrides(
        config,
        [
            f"data.corpus={path}",
            "data.text_field=body",
            "data.streaming=true",
            "train.batch_size=4",
            "train.seq_len=64",
        ],
    )  # ~17 batches per epoch
    it = build_data(stream).train
    seen = [next(it) for _ in range(3)]
    assert all(b["tokens"].shape == (4, 64) for b in seen)
    state = json.loads(json.dumps(it.state()))
    ahead = [next(it) for _ in range(40)]  # runs past the end of the stream into the next epoch
    assert it.epoch >= 1
    resumed = build_data(stream).train
    resumed.restore(state)
    for a in ahead:
        b = next(resumed)
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


def test_bad_corpora_name_the_file(tmp_path):
    base = load_config("tiny")

    def build(corpus, *extra):
        return build_data(apply_overrides(base, [f"data.corpus={corpus}", *extra]))

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match=r"empty\.txt.*empty"):
        build(empty)
    blank = tmp_path / "blank.txt"
    blank.write_text("  \n\n \n")
    with pytest.raises(DataError, match="blank.txt"):
        build(blank)
    with pytest.raises(DataError, match="missing.txt"):
        build(tmp_path / "missing.txt")
    with pytest.raises(DataError, match="no files match"):
        build(tmp_path / "*.parquet")
    binary = tmp_path / "latin1.txt"
    binary.write_bytes("caf\xe9 ol\xe9\n\nmore".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.txt.*not UTF-8.*offset 3"):
        build(binary)
    jl = tmp_path / "d.jsonl"
    _write_docs(jl, 5)
    with pytest.raises(DataError, match="no field 'text'.*body"):
        build(jl)
    one = tmp_path / "one.txt"
    one.write_text("a single paragraph and nothing else")
    with pytest.raises(DataError, match="single document"):
        build(one)
    odd = tmp_path / "notes.docx"
    odd.write_text("x")
    with pytest.raises(DataError, match="notes.docx"):
        build(odd)
    assert not os.path.exists(tmp_path / "checkpoints")
