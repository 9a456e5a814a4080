"""The train state and the optimizer: AdamW, linear warmup + cosine decay, global-norm clipping, decay mask.

The state is a plain pytree of arrays, so it can be jitted, donated and checkpointed as is:

    params      nested dict of parameter arrays (the model's `nnx.Param`s as a pure dict)
    opt_state   optax state over params
    step        int32: optimizer steps applied
    rng         uint32 [2]: advanced every step; the eval-time sample draws from it
    bad_step    int32: 0, or the first step whose loss, gradient or update was non-finite (that update and
                every later one is skipped, so the state stays the last finite one)

The model's graph definition is not in the state: `nnx.merge(graphdef, params)` rebuilds the module inside jit.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from causal_lm import parallel
from causal_lm.config import ModelConfig, TrainConfig
from causal_lm.model import build_model


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    params: Any
    opt_state: Any
    step: jax.Array
    rng: jax.Array
    bad_step: jax.Array


# Optimizer hyperparameters that enter the jitted step as traced scalars, so changing them (an lr sweep, a longer
# run) reuses the compiled step instead of compiling a new one.
HYPERPARAMS = ("learning_rate", "warmup_steps", "steps", "min_lr_ratio", "weight_decay", "beta1", "beta2", "grad_clip")


def hyperparams(t: TrainConfig) -> dict:
    """The traced hyperparameters of `t` as float32 scalars."""
    return {k: np.float32(getattr(t, k)) for k in HYPERPARAMS}


def learning_rate_schedule(hp):
    """lr for the update with 0-based `count`: linear warmup to `learning_rate` over `warmup_steps` updates (the
    first update already gets lr/warmup, never 0), then cosine decay to `min_lr_ratio * learning_rate` at
    `steps`. `hp`: a TrainConfig or `hyperparams(...)` (possibly traced)."""
    if isinstance(hp, TrainConfig):
        hp = hyperparams(hp)
    peak, warm, total, floor = hp["learning_rate"], hp["warmup_steps"], hp["steps"], hp["min_lr_ratio"]

    def schedule(count):
        s = jnp.asarray(count, jnp.float32) + 1.0  # the 1-based step this update makes
        warmup = peak * s / jnp.maximum(warm, 1.0)
        progress = jnp.clip((s - warm) / jnp.maximum(total - warm, 1.0), 0.0, 1.0)
        cosine = peak * (floor + (1.0 - floor) * 0.5 * (1.0 + jnp.cos(math.pi * progress)))
        return jnp.where(s <= warm, warmup, cosine)

    return schedule


# Parameters that are not weight-decayed: norm gains, biases and per-head scalars (sinks). Decaying a gain pulls
# it toward 0 and a bias toward 0 for no regularisation benefit; matrices and embeddings are decayed.
_NO_DECAY_NAME = re.compile(r"^(scale|bias|b[a-z]?|b_[a-z_]+|sink|.*_bias|.*norm.*)$")


def decays(path: tuple) -> bool:
    """Whether the parameter at `path` (tuple of dict keys) is weight-decayed."""
    return not any(_NO_DECAY_NAME.match(str(k)) for k in path)


def decay_mask(params) -> Any:
    """A pytree of bools matching params: True where weight decay applies."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: decays(tuple(getattr(k, "key", getattr(k, "name", k)) for k in path)), params
    )


def make_optimizer(t: TrainConfig, hp=None) -> optax.GradientTransformation:
    """Global-norm clipping (when train.grad_clip > 0), then AdamW with the warmup + cosine schedule and weight
    decay on matrices and embeddings only. `hp` overrides the values of `t` with (traced) `hyperparams`; the
    optimizer state's structure depends only on `t.grad_clip > 0`."""
    hp = hyperparams(t) if hp is None else hp
    parts = []
    if t.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(hp["grad_clip"]))
    parts.append(
        optax.adamw(
            learning_rate_schedule(hp), b1=hp["beta1"], b2=hp["beta2"], weight_decay=hp["weight_decay"], mask=decay_mask
        )
    )
    return optax.chain(*parts)


def split_params(model) -> tuple[Any, dict, dict]:
    """(graphdef, params as a pure dict, other state as a pure dict) of an NNX model."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(rest)


@functools.lru_cache(maxsize=8)
def _jitted_init(model_config: ModelConfig):
    return jax.jit(lambda seed: split_params(build_model(model_config, jax.random.key(seed)))[1:])


def init_params(model_config: ModelConfig, seed: int) -> tuple[Any, dict, dict]:
    """(graphdef, params, rest) of a freshly initialised model, built in one compiled program (building the module
    eagerly dispatches and compiles every initialiser op separately, which takes seconds on a CPU)."""
    graphdef = split_params(nnx.eval_shape(lambda: build_model(model_config, 0)))[0]
    params, rest = _jitted_init(model_config)(seed)
    return graphdef, params, rest


def init_train_state(params: dict, optimizer: optax.GradientTransformation, seed: int) -> TrainState:
    return TrainState(
        params=params,
        opt_state=optimizer.init(params),
        step=jnp.int32(0),
        rng=jax.random.PRNGKey(seed),
        bad_step=jnp.int32(0),
    )


def param_shapes(params) -> dict[str, list[int]]:
    """{"blocks.attn.wq": [L, D, N, H], ...} for error messages and checkpoint metadata."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {".".join(str(getattr(k, "key", k)) for k in path): list(leaf.shape) for path, leaf in flat}


# ---- sharded initialisation (the partition rules live in causal_lm.parallel) ----------------------------------


def optimizer_structure(train_config: TrainConfig) -> TrainConfig:
    """The part of a TrainConfig that shapes the optimizer state: only whether clipping is on (everything else
    enters the step as traced hyperparameters). Compiled steps and inits are cached per this structure."""
    return TrainConfig(grad_clip=1.0 if train_config.grad_clip > 0 else 0.0)


def train_state_shardings(model_config: ModelConfig, train_config: TrainConfig, mesh):
    """(TrainState of shardings, shardings of the non-parameter model state) for a model and optimizer, from
    their abstract shapes (nothing is allocated)."""
    _, params, rest = split_params(nnx.eval_shape(lambda: build_model(model_config, 0)))
    abstract = jax.eval_shape(lambda p: init_train_state(p, make_optimizer(train_config), 0), params)
    return parallel.tree_shardings(abstract, mesh), parallel.tree_shardings(rest, mesh)


def init_sharded_train_state(model_config: ModelConfig, train_config: TrainConfig, seed: int, mesh):
    """(graphdef, TrainState, rest) initialised directly in their shardings: no device ever holds the whole
    model. Values equal the single-device `init_params` + `init_train_state` (JAX's threefry RNG is
    partitionable: a sharded draw gives the same numbers)."""
    graphdef = split_params(nnx.eval_shape(lambda: build_model(model_config, 0)))[0]
    state, rest = _sharded_init(model_config, optimizer_structure(train_config), seed, mesh)(jax.random.key(seed))
    return graphdef, state, rest


@functools.lru_cache(maxsize=8)
def _sharded_init(model_config: ModelConfig, train_config: TrainConfig, seed: int, mesh):
    def init(key):
        _, params, rest = split_params(build_model(model_config, key))
        return init_train_state(params, make_optimizer(train_config), seed), rest

    return jax.jit(init, out_shardings=train_state_shardings(model_config, train_config, mesh))
