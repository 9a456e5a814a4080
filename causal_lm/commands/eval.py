"""`causal-lm eval`: validation loss, perplexity and bits per byte of a workdir's model."""

from __future__ import annotations

import itertools
import json

from causal_lm.commands.common import parse_step
from causal_lm.data import build_data
from causal_lm.train import evaluate, load_for_inference


def register(sub):
    p = sub.add_parser(
        "eval",
        help="evaluate a workdir's checkpoint on held-out text",
        description="Loss (nats/token), perplexity and bits per byte of a trained (or converted) "
        "workdir's model on the validation split of its training corpus, or of --data.",
    )
    p.add_argument("--workdir", required=True)
    p.add_argument(
        "--data",
        default=None,
        help="corpus spec: builtin, a path or glob of txt/jsonl/parquet, or "
        "hf:NAME (default: the corpus the model was trained on)",
    )
    p.add_argument(
        "--split",
        choices=("val", "train"),
        default="val",
        help="which split of the corpus (documents are split the same way as in training)",
    )
    p.add_argument("--step", default=None, help="checkpoint step, 'latest' (default) or 'best'")
    p.add_argument("--max-batches", type=int, default=0, help="cap on batches (0 = the whole split)")
    p.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    p.set_defaults(func=run)


def evaluate_workdir(
    workdir: str, data: str | None = None, split: str = "val", step=None, max_batches: int = 0
) -> dict:
    """The metrics `causal-lm eval` prints, as a dict."""

    model, tokenizer, config = load_for_inference(workdir, step)
    splits = build_data(config, tokenizer, corpus=data, max_val_batches=max_batches)
    if split == "val":
        batches = splits.val
    else:
        n = max_batches or max(1, splits.info.get("train_rows", 0) // config.train.batch_size)
        batches = list(itertools.islice(splits.train, n))
    out = evaluate(model, batches, splits.token_bytes)
    out.update(corpus=data or config.data.corpus, split=split, batches=len(batches))
    return out


def run(args) -> int:
    step = parse_step(args.step)
    if args.max_batches < 0:
        raise ValueError(f"--max-batches must be >= 0 (0 = the whole split), got {args.max_batches}")
    r = evaluate_workdir(args.workdir, args.data, args.split, step, args.max_batches)
    if args.json:
        print(json.dumps(r))
    else:
        bpb = f", {r['bits_per_byte']:.4f} bits/byte" if r.get("bits_per_byte") is not None else ""
        print(
            f"{r['corpus']} ({r['split']}, {r['tokens']:,} tokens): loss {r['loss']:.4f}, "
            f"perplexity {r['perplexity']:.3f}{bpb}"
        )
    return 0
