"""The seed experiments as importable functions, each writing a report, a figure and results.json.

An experiment is a module here with NAME (its command-line name), HELP (one line), default_config() -> Config
and run(config, out_dir) -> dict; registering it is one line in EXPERIMENTS. `causal-lm experiment NAME --out DIR
[--config FILE] [key=value ...]` runs it.
"""

from __future__ import annotations

import importlib

EXPERIMENTS = {
    "attention-sink": "causal_lm.experiments.attention_sink",
}


def get(name: str):
    """The experiment module registered under `name`."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; choose from {', '.join(sorted(EXPERIMENTS))}")
    return importlib.import_module(EXPERIMENTS[name])
