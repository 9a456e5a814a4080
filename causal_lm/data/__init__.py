"""Data: tokenizers, corpora through `datasets`, packing with segment ids, resumable iterators.

build_data(config, tokenizer=None)   -> DataSplits(tokenizer, train iterator, val batches, info)
load_corpus(spec)                    a corpus spec as a `datasets` dataset with a "text" column
tokenizer_from_spec / load_tokenizer / ByteTokenizer / CharTokenizer / HFTokenizer
"""

from causal_lm.data.corpus import DataError, builtin_documents, load_corpus
from causal_lm.data.pipeline import (
    DataSplits,
    PackedRows,
    StreamingTrainIterator,
    TrainIterator,
    build_data,
    eval_batches,
    pack,
    rows_to_batch,
)
from causal_lm.data.tokenizer import (
    ByteTokenizer,
    CharTokenizer,
    HFTokenizer,
    TokenizerError,
    load_tokenizer,
    tokenizer_from_dict,
    tokenizer_from_spec,
)

__all__ = [
    "DataError",
    "builtin_documents",
    "load_corpus",
    "DataSplits",
    "PackedRows",
    "StreamingTrainIterator",
    "TrainIterator",
    "build_data",
    "eval_batches",
    "pack",
    "rows_to_batch",
    "ByteTokenizer",
    "CharTokenizer",
    "HFTokenizer",
    "TokenizerError",
    "load_tokenizer",
    "tokenizer_from_dict",
    "tokenizer_from_spec",
]
