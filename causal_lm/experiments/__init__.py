"""The seed experiments as importable functions, each writing a report, a figure and results.json.

An experiment is a module here with NAME (its command-line name), HELP (one line), default_config() -> Config
and run(config, out_dir) -> dict, and optionally summary(results) -> str (the line the command prints);
registering it is one line in EXPERIMENTS. `causal-lm experiment NAME --out DIR
[--config FILE] [key=value ...]` runs it.
"""

from __future__ import annotations

import importlib

EXPERIMENTS = {
    "attention-sink": "causal_lm.experiments.attention_sink",
    "mask-ablation": "causal_lm.experiments.mask_ablation",
    "mask-placement": "causal_lm.experiments.mask_placement",
    "prefix-cost": "causal_lm.experiments.prefix_cost",
    "kv-memory": "causal_lm.experiments.kv_memory",
    "kv-concurrency": "causal_lm.experiments.kv_concurrency",
    "nope-position": "causal_lm.experiments.nope_position",
    "grpo-arithmetic": "causal_lm.experiments.grpo_arithmetic",
}


def get(name: str):
    """The experiment module registered under `name`."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; choose from {', '.join(sorted(EXPERIMENTS))}")
    return importlib.import_module(EXPERIMENTS[name])
