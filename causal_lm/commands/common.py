"""Argument helpers shared by commands: --config FILE plus key=value overrides."""

from __future__ import annotations

from causal_lm.config import load_config


def add_config_args(p, *, default_config: str | None = "small"):
    p.add_argument(
        "--config",
        default=default_config,
        help="preset file with get_config() (configs/NAME.py, or a bare preset name)"
        + (f"; default: {default_config}" if default_config else ""),
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="config overrides, e.g. model.num_layers=4 train.steps=100 (bare keys: model first)",
    )


def config_from_args(args):
    return load_config(args.config, args.overrides)


def parse_step(text):
    """--step: None or 'latest' (the newest intact checkpoint), 'best', or a step number."""
    if text in (None, "latest", "best"):
        return text
    try:
        step = int(text)
    except ValueError:
        raise ValueError(f"--step must be a checkpoint step number, 'latest' or 'best', got {text!r}") from None
    if step < 0:
        raise ValueError(f"--step must be a checkpoint step number (>= 0), got {step}")
    return step
