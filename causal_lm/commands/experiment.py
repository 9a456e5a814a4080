"""`causal-lm experiment NAME --out DIR [--config FILE] [key=value ...]`: run one of the seed experiments."""

from __future__ import annotations

from causal_lm.config import apply_overrides, load_config
from causal_lm.experiments import EXPERIMENTS, get


def register(sub):
    p = sub.add_parser(
        "experiment",
        help="run a seed experiment: report.md, a PNG figure and results.json",
        description="Run a seed experiment into --out: report.md, a PNG figure, results.json and the "
        "training workdirs (rerunning resumes them). Experiments: " + ", ".join(sorted(EXPERIMENTS)),
    )
    p.add_argument("name", choices=sorted(EXPERIMENTS), metavar="NAME", help=", ".join(sorted(EXPERIMENTS)))
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--config", default=None, help="preset or config file (default: the experiment's own)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. train.steps=100")
    p.set_defaults(func=run)


def run(args) -> int:
    exp = get(args.name)
    config = load_config(args.config) if args.config else exp.default_config()
    config = apply_overrides(config, args.overrides)
    results = exp.run(config, args.out)
    if hasattr(exp, "summary"):
        print(f"{args.name}: {exp.summary(results)}")
    print(f"{args.name}: wrote {args.out}/report.md")
    return 0
