"""`causal-lm plot`: loss curves of a workdir as a PNG."""

from __future__ import annotations

from causal_lm.train.metrics import plot_metrics


def register(sub):
    p = sub.add_parser(
        "plot",
        help="plot a workdir's loss curves to a PNG",
        description="Train and validation loss (and the learning rate) from workdir/metrics.jsonl.",
    )
    p.add_argument("--workdir", required=True)
    p.add_argument("--out", default=None, help="PNG path (default: WORKDIR/loss.png)")
    p.set_defaults(func=run)


def run(args) -> int:
    print(plot_metrics(args.workdir, args.out))
    return 0
