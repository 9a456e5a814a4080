"""Corpora as `datasets` datasets with one text column: the built-in offline corpus, local files, hub names.

    "builtin"                the Python reference documentation that ships with the interpreter (the standard
                             library's `pydoc_data` package): about 460 KB of English prose, no network needed.
                             Each help topic is split at its section headings into documents.
    path, directory or glob  .txt (one document per blank-line-separated paragraph), .jsonl / .json (one
                             document per record, `data.text_field`), .parquet (same); several files and globs
                             separated by commas.
    "hf:NAME[:CONFIG]"       a Hugging Face hub dataset, streamed (needs a network), train split.

Every problem with a source is a `DataError` naming the file and what is wrong with it, raised before any
training starts.
"""

from __future__ import annotations

import codecs
import glob
import os
import re

BUILTIN_MIN_BYTES = 400_000
_EXT_BUILDER = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
}


class DataError(ValueError):
    """A corpus that cannot be read: missing, empty, undecodable, wrong format or missing its text field."""


# ---- built-in corpus ---------------------------------------------------------------------------------------

_HEADING = re.compile(r"\n(?=[^\n]+\n[*=\-^~]{3,}\n)")


def builtin_documents() -> list[str]:
    """The built-in corpus: the interpreter's help topics (`pydoc_data.topics`), split at section headings."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip it out
        raise DataError(
            "the built-in corpus needs the standard library's pydoc_data package, which this Python "
            "installation lacks; pass data.corpus=PATH to a text file instead"
        ) from None
    docs = []
    for name in sorted(topics):
        for part in _HEADING.split(topics[name]):
            part = part.strip()
            if part:
                docs.append(part)
    size = sum(len(d.encode("utf-8")) for d in docs)
    if size < BUILTIN_MIN_BYTES:
        raise DataError(
            f"the built-in corpus (pydoc_data.topics) has only {size:,} bytes in this Python "
            f"installation; at least {BUILTIN_MIN_BYTES:,} are needed. Pass data.corpus=PATH instead"
        )
    return docs


# ---- local files -------------------------------------------------------------------------------------------


def resolve_files(spec: str) -> list[str]:
    """Expand a comma-separated list of files, directories and globs into sorted file paths."""
    files: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if any(ch in part for ch in "*?["):
            matched = sorted(f for f in glob.glob(part, recursive=True) if os.path.isfile(f))
            if not matched:
                raise DataError(f"data.corpus: no files match {part!r}")
            files.extend(matched)
        elif os.path.isdir(part):
            matched = sorted(
                f
                for f in glob.glob(os.path.join(part, "**", "*"), recursive=True)
                if os.path.isfile(f) and os.path.splitext(f)[1].lower() in _EXT_BUILDER
            )
            if not matched:
                raise DataError(f"data.corpus: directory {part!r} holds no {'/'.join(sorted(_EXT_BUILDER))} files")
            files.extend(matched)
        elif os.path.isfile(part):
            files.append(part)
        else:
            raise DataError(
                f"data.corpus: no such file {part!r} (use 'builtin', a path, a glob, or 'hf:NAME' for a hub dataset)"
            )
    return files


def _builder_for(files: list[str]) -> str:
    builders = set()
    for f in files:
        ext = os.path.splitext(f)[1].lower()
        if ext not in _EXT_BUILDER:
            raise DataError(
                f"data.corpus: cannot read {f!r}: unknown extension {ext or '(none)'!r} "
                f"(known: {', '.join(sorted(_EXT_BUILDER))})"
            )
        builders.add(_EXT_BUILDER[ext])
    if len(builders) > 1:
        raise DataError(f"data.corpus mixes file formats ({', '.join(sorted(builders))}); use one format per run")
    return builders.pop()


def _check_file(path: str, builder: str) -> None:
    """Empty and undecodable files fail here with the file's name, not deep inside a dataset builder."""
    if os.path.getsize(path) == 0:
        raise DataError(f"data.corpus: file {path!r} is empty")
    if builder in ("text", "json"):
        dec = codecs.getincrementaldecoder("utf-8")()
        offset = 0
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                try:
                    dec.decode(chunk)
                except UnicodeDecodeError as e:
                    raise DataError(
                        f"data.corpus: file {path!r} is not UTF-8 text (undecodable byte at offset {offset + e.start})"
                    ) from None
                offset += len(chunk)
            try:
                dec.decode(b"", final=True)
            except UnicodeDecodeError:
                raise DataError(
                    f"data.corpus: file {path!r} is not UTF-8 text (truncated character at the end)"
                ) from None
        with open(path, encoding="utf-8") as f:
            if not f.read(1 << 20).strip() and os.path.getsize(path) <= (1 << 20):
                raise DataError(f"data.corpus: file {path!r} holds only whitespace")


# ---- all sources -------------------------------------------------------------------------------------------


def load_corpus(spec: str, *, text_field: str = "text", streaming: bool = False):
    """A `datasets.Dataset` (or `IterableDataset` when streaming) with one column, "text".

    Raises DataError for a missing, empty or undecodable file, a wrong format, or a missing text field.
    """
    import datasets

    datasets.disable_progress_bars()
    if spec == "builtin":
        ds = datasets.Dataset.from_dict({"text": builtin_documents()})
        return ds.to_iterable_dataset() if streaming else ds
    if spec.startswith("hf:"):
        name, _, cfg = spec[3:].partition(":")
        try:
            ds = datasets.load_dataset(name, cfg or None, split="train", streaming=True)
        except Exception as e:  # no network, unknown name, ...: say which dataset
            raise DataError(f"data.corpus={spec!r}: could not open hub dataset {name!r}: {e}") from None
        return _select_text(ds, text_field, spec)

    files = resolve_files(spec)
    builder = _builder_for(files)
    for f in files:
        _check_file(f, builder)
    kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
    try:
        ds = datasets.load_dataset(builder, data_files=files, split="train", streaming=streaming, **kwargs)
    except Exception as e:
        raise DataError(
            f"data.corpus: could not read {', '.join(map(repr, files))} as {builder}: {type(e).__name__}: {e}"
        ) from None
    ds = _select_text(ds, text_field, spec)
    if not streaming and len(ds) == 0:
        raise DataError(f"data.corpus: {', '.join(map(repr, files))} holds no documents")
    return ds


def _select_text(ds, text_field: str, spec: str):
    columns = ds.column_names
    if columns is not None and text_field not in columns:
        raise DataError(
            f"data.corpus={spec!r} has no field {text_field!r} (fields: {', '.join(columns)}); set data.text_field"
        )
    if text_field != "text":
        ds = ds.rename_column(text_field, "text")
    if columns is not None:
        extra = [c for c in ds.column_names if c != "text"]
        if extra:
            ds = ds.remove_columns(extra)
    return ds
