"""`causal-lm <command>`: a thin argparse front over importable functions.

Each command lives in `causal_lm/commands/<name>.py` with a `register(subparsers)` that adds its parser and
sets `func`; adding a command is one line in COMMANDS.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = [
    "causal_lm.commands.info",
    "causal_lm.commands.generate",
    "causal_lm.commands.train",
    "causal_lm.commands.eval",
    "causal_lm.commands.plot",
    "causal_lm.commands.kv_bytes",
    "causal_lm.commands.experiment",
    "causal_lm.commands.convert",
    "causal_lm.commands.bench",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="causal-lm",
        description="Small decoder-only language models in JAX/Flax: train, generate, compare cache vs recompute.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse fills a trailing `KEY=VALUE ...` positional together with the positional before it, so in
    # `experiment NAME --out DIR k=v` the k=v arrive as extras: give them to the command's overrides.
    if (
        extra
        and isinstance(getattr(args, "overrides", None), list)
        and all("=" in e and not e.startswith("-") for e in extra)
    ):
        args.overrides = args.overrides + extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from causal_lm.config import ConfigError

    try:
        return int(args.func(args) or 0)
    except (ConfigError, ValueError, FileNotFoundError) as e:  # clear one-line errors, no traceback
        print(f"causal-lm {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
