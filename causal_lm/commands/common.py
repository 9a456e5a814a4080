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


def add_quantize_args(p, flag: str = "--weights") -> None:
    """--minimums and --embed-weights, which refine the format `flag` (--weights, convert's --quantize) asks for."""
    p.add_argument(
        "--minimums",
        action="store_true",
        help=f"with {flag} int4: each group stores its minimum besides its scale (asymmetric, as GGUF's Q4_1): "
        "4 bytes more per group, a closer fit (measured: docs/performance.md#weight-only-quantization)",
    )
    p.add_argument(
        "--embed-weights",
        choices=("int8", "int4"),
        default=None,
        help=f"with {flag}: the embedding table and output head in this format instead (int8 under int4 weights: "
        "the layout GGUF files ship)",
    )


def check_quantize_args(weights, minimums: bool, embed=None, flag: str = "--weights") -> None:
    """--minimums needs int4 weights, --embed-weights quantized ones (refused before anything loads)."""
    if minimums and weights != "int4":
        raise ValueError(f"--minimums applies with {flag} int4")
    if embed is not None and weights not in ("int8", "int4"):
        raise ValueError(f"--embed-weights applies with {flag} int8|int4")
