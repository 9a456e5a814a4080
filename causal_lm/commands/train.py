"""`causal-lm train`: train a config in a workdir (rerunning the same command resumes)."""

from __future__ import annotations

import sys

from causal_lm.commands.common import add_config_args, config_from_args


def register(sub):
    p = sub.add_parser("train", help="train a model (resumes when the workdir has checkpoints)",
                       description="Train --config (with key=value overrides) in --workdir: progress bar, "
                                   "metrics.jsonl, TensorBoard events in workdir/tb, orbax checkpoints. Rerunning "
                                   "the same command on the same workdir resumes from its latest checkpoint.")
    add_config_args(p)
    p.add_argument("--workdir", required=True, help="directory for checkpoints, metrics and the tokenizer")
    p.set_defaults(func=run)


def run(args) -> int:
    from causal_lm.train import NonFiniteLossError, train_and_evaluate

    config = config_from_args(args)
    try:
        record = train_and_evaluate(config, args.workdir)
    except NonFiniteLossError as e:
        print(f"causal-lm train: {e}", file=sys.stderr)
        return 1
    if record.get("val_loss") is not None:
        print(f"done: step {record['step']}, val_loss {record['val_loss']:.4f}, val_ppl {record['val_ppl']:.2f}"
              + (f", {record['val_bpb']:.3f} bits/byte" if record.get("val_bpb") is not None else "")
              + f"; workdir {args.workdir}")
    return 0
