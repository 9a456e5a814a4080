"""LoRA: low-rank adapters on the projection matrices, the base weights frozen.

For a target weight W (a projection with its head axes kept apart, e.g. wq [L, D, N, H], stacked over layers),
the adapter is a pair A [L, prod(in), r], B [L, r, prod(out)] (in/out: the weight's reduction and output axes, as
Muon sees them: `causal_lm.train.state.MUON_MATRICES`), and the weight the model uses is

    W' = W + (alpha / r) * (A @ B).reshape(W.shape)

computed in float32 and cast to W's dtype. A starts N(0, 1/fan_in), B at zero, so step 0 is the base model exactly.
`train.lora_targets` names the weights: q, k, v, o (attention), gate, up, down (MLP).

Our own small implementation, not a library (qwix): the model's projections are raw `nnx.Param` arrays with head
axes apart, contracted by `causal_lm.model.layers.project`, not nnx.Linear/Einsum modules that an interception
library rewrites; a parameter-space adapter needs no model change at all, the same code serves training,
evaluation, sampling and `convert --merge-lora`, and a merged checkpoint is by construction the model the adapter
trained. The cost: the forward materialises W' (one weight-sized add per target per step) and the backward forms
dL/dW' before projecting it onto A and B, so a step computes what full fine-tuning computes; what LoRA saves here is
the optimizer state (moments of A and B only) and the checkpoints (adapters only).

In training (`train.lora_rank > 0`) the TrainState's params ARE the adapters: only they get gradients, optimizer
state and checkpoint space; the frozen base travels in the step's non-donated `rest` (`LoraModel`), and is written
once to `workdir/frozen_base/` (an orbax checkpoint with the same integrity checksums) so a resumed run, `generate`
and `convert --merge-lora` find it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from causal_lm.config import LORA_TARGETS, ConfigError
from causal_lm.train.state import MUON_MATRICES

TARGETS = dict(zip(LORA_TARGETS, ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"), strict=True))
FROZEN_DIR = "frozen_base"  # workdir/frozen_base/checkpoints/0: the frozen base of a LoRA run


def parse_targets(spec) -> tuple[str, ...]:
    """('q', 'v', ...) from 'q,v' (ConfigError naming an unknown name)."""
    names = tuple(s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip())
    bad = [n for n in names if n not in TARGETS]
    if bad or not names:
        raise ConfigError(
            f"train.lora_targets={spec!r}: expected a comma-separated subset of {', '.join(TARGETS)}"
            + (f" ({', '.join(map(repr, bad))} unknown)" if bad else "")
        )
    return names


def _names(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def _split_shape(name: str, shape: tuple) -> tuple[tuple, int, int]:
    """(leading layer axes, prod(in), prod(out)) of a target weight."""
    reduction, output = MUON_MATRICES[name]
    extra = len(shape) - len(reduction) - len(output)
    lead = tuple(shape[:extra])
    fan_in = int(np.prod([shape[extra + a] for a in reduction]))
    fan_out = int(np.prod([shape[extra + a] for a in output]))
    return lead, fan_in, fan_out


def target_paths(params, targets) -> dict[tuple, tuple]:
    """{path names: shape} of the weights the targets name (ConfigError if a target names no weight)."""
    wanted = {TARGETS[t]: t for t in parse_targets(targets)}
    found: dict[tuple, tuple] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = _names(path)
        if names and names[-1] in wanted and "mla" not in names:
            found[names] = tuple(leaf.shape)
    missing = sorted({t for n, t in wanted.items() if not any(p[-1] == n for p in found)})
    if missing:
        raise ConfigError(
            f"train.lora_targets: {', '.join(map(repr, missing))} name no weight of this model "
            "(LoRA adapts the q/k/v/o projections of standard attention and the gated MLP's gate/up/down)"
        )
    return found


def _set(tree: dict, names: tuple, value) -> None:
    for k in names[:-1]:
        tree = tree.setdefault(k, {})
    tree[names[-1]] = value


def _get(tree: dict, names: tuple):
    for k in names:
        if not isinstance(tree, dict) or k not in tree:
            return None
        tree = tree[k]
    return tree


def init_adapters(params, targets, rank: int, seed: int) -> dict:
    """Nested dict {..., 'wq': {'lora_a': A, 'lora_b': B}} mirroring the targets' paths in `params` (float32)."""
    if not (isinstance(rank, int) and rank > 0):
        raise ConfigError(f"train.lora_rank must be a positive integer, got {rank!r}")
    out: dict = {}
    key = jax.random.key(seed)
    for i, (names, shape) in enumerate(sorted(target_paths(params, targets).items())):
        lead, fan_in, fan_out = _split_shape(names[-1], shape)
        a = jax.random.normal(jax.random.fold_in(key, i), lead + (fan_in, rank), jnp.float32) / np.sqrt(fan_in)
        _set(out, names, {"lora_a": a, "lora_b": jnp.zeros(lead + (rank, fan_out), jnp.float32)})
    return out


def merge(base, adapters, scale: float):
    """The base params with each adapted weight replaced by W + scale * A @ B (float32 sum, W's dtype)."""

    def one(path, w):
        ad = _get(adapters, _names(path))
        if ad is None:
            return w
        delta = jnp.matmul(ad["lora_a"], ad["lora_b"]).reshape(w.shape)
        return (w.astype(jnp.float32) + scale * delta).astype(w.dtype)

    return jax.tree_util.tree_map_with_path(one, base)


@dataclasses.dataclass(frozen=True)
class LoraGraph:
    """The graph definition of a LoRA run: `merge_model(LoraGraph, adapters, {'base', 'rest'})` is the model."""

    graphdef: Any
    scale: float


@dataclasses.dataclass(frozen=True)
class RefGraph:
    """The graph definition of a full-weight DPO/GRPO run: params train, rest = {'base': reference, 'rest': ...}."""

    graphdef: Any


def merge_model(graphdef, params, rest):
    """nnx.merge for every kind of run: with a `LoraGraph`, params are the adapters and rest holds the base; with a
    `RefGraph` (DPO/GRPO), rest holds the frozen reference beside the model's other state."""
    if isinstance(graphdef, LoraGraph):
        return nnx.merge(graphdef.graphdef, merge(rest["base"], params, graphdef.scale), rest["rest"])
    if isinstance(graphdef, RefGraph):
        return nnx.merge(graphdef.graphdef, params, rest["rest"])
    return nnx.merge(graphdef, params, rest)


def lora_scale(train_config) -> float:
    return float(train_config.lora_alpha) / float(train_config.lora_rank)


def adapter_count(adapters) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(adapters))
