"""The train state and the optimizers (AdamW, Muon, Lion, Adafactor): linear warmup + cosine decay, global-norm
clipping, decay mask, optimizer-state dtype.

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
from optax import contrib
from optax.contrib import MuonDimensionNumbers

from causal_lm import parallel
from causal_lm.config import ConfigError, ModelConfig, TrainConfig
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
# run, another z-loss weight) reuses the compiled step instead of compiling a new one.
HYPERPARAMS = (
    "learning_rate",
    "warmup_steps",
    "steps",
    "min_lr_ratio",
    "weight_decay",
    "beta1",
    "beta2",
    "grad_clip",
    "muon_momentum",
    "z_loss",
)


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


def _path_names(path) -> tuple:
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def decays(path: tuple) -> bool:
    """Whether the parameter at `path` (tuple of dict keys) is weight-decayed."""
    return not any(_NO_DECAY_NAME.match(str(k)) for k in path)


def decay_mask(params) -> Any:
    """A pytree of bools matching params: True where weight decay applies."""
    return jax.tree_util.tree_map_with_path(lambda path, _: decays(_path_names(path)), params)


# ---- Muon: which parameters are matrices, and in what 2-D form -----------------------------------------------
# Muon orthogonalises the update of a weight MATRIX, i.e. of the linear map a layer applies. Our projections keep
# their head axes apart ([D, N, H] rather than [D, N*H]) and the blocks are stacked along a leading layer axis, so
# each weight is described by (reduction axes, output axes) of its unstacked shape: the matrix Muon sees is the
# reduction axes flattened against the output axes (wq [D, N, H] -> [D, N*H], the map the layer computes; wo
# [N, H, D] -> [N*H, D]), and any further leading axis (the layer axis L of stacked blocks) is a batch axis:
# each layer's matrix is orthogonalised on its own (a vmap inside optax). Heads are NOT orthogonalised one by
# one: the heads of a projection form one linear map. Embeddings, the LM head, norm gains, biases and sinks are
# not hidden-layer matrices and go to AdamW (the split Muon's authors use; the LM head included).
MUON_MATRICES = {  # parameter name -> (reduction axes, output axes) of the unstacked weight
    "wq": ((0,), (1, 2)),  # [D, N, H]
    "wk": ((0,), (1, 2)),  # [D, K, H]
    "wv": ((0,), (1, 2)),
    "wg": ((0,), (1, 2)),  # output gate [D, N, H]
    "wo": ((0, 1), (2,)),  # [N, H, D]
    "w_gate": ((0,), (1,)),  # [D, F]
    "w_up": ((0,), (1,)),
    "w_down": ((0,), (1,)),  # [F, D]
    "wq_a": ((0,), (1,)),  # MLA: [D, r]
    "wkv_a": ((0,), (1,)),  # [D, R + Hr]
    "wq_b": ((0,), (1, 2)),  # [r, N, Hn + Hr]
    "wk_b": ((0,), (1, 2)),  # [R, N, Hn]
    "wv_b": ((0,), (1, 2)),  # [R, N, Hv]
}


def muon_dimension_numbers(path: tuple, shape: tuple):
    """optax's MuonDimensionNumbers for the parameter at `path` (names) with `shape`, or None when it is not a
    Muon matrix (then AdamW updates it). A leading axis beyond the weight's own rank (the stacked layer axis) is
    a batch axis."""

    rule = MUON_MATRICES.get(path[-1]) if path else None
    if rule is None or not decays(path):
        return None
    reduction, output = rule
    extra = len(shape) - (len(reduction) + len(output))
    if extra < 0:
        return None
    shift = lambda axes: tuple(a + extra for a in axes)  # noqa: E731
    return MuonDimensionNumbers(reduction_axis=shift(reduction), output_axis=shift(output))


def muon_labels(params) -> Any:
    """A pytree of "muon" / "adamw" matching params: which optimizer updates each parameter under
    train.optimizer=muon."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: "adamw" if muon_dimension_numbers(_path_names(path), np.shape(x)) is None else "muon", params
    )


def _muon_dims(updates):
    # The Muon part of optax.partition sees the other parameters as MaskedNodes (no leaves): tree_map skips them.
    return jax.tree_util.tree_map_with_path(
        lambda path, x: muon_dimension_numbers(_path_names(path), np.shape(x)), updates
    )


# ---- optimizer-state dtype -----------------------------------------------------------------------------------


def _cast_state(tree, dtype):
    """Floating arrays of an optimizer state cast to `dtype`, except constants that are not running statistics
    (Muon's Newton-Schulz coefficients) and scalars."""

    def cast(path, x):
        if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating) or np.ndim(x) == 0:
            return x
        if "ns_coeffs" in _path_names(path):
            return x
        return x.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, tree)


def with_state_dtype(inner: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
    """`inner` with its running statistics (moments, factored second moments) STORED in `dtype` (e.g. bfloat16:
    half the memory of float32 moments) and updated in float32: the state is widened before each update and
    rounded (to nearest) after it."""

    def init(params):
        return _cast_state(inner.init(params), dtype)

    def update(updates, state, params=None):
        new_updates, new_state = inner.update(updates, _cast_state(state, jnp.float32), params)
        return new_updates, _cast_state(new_state, dtype)

    return optax.GradientTransformation(init, update)


# ---- the optimizers ------------------------------------------------------------------------------------------


def _scale_to_rms(rms: float) -> optax.GradientTransformation:
    """Scale each orthogonalised update to RMS `rms`: an m x n matrix with unit singular values has RMS
    1/sqrt(max(m, n)). With 0.2, AdamW's typical update RMS (Liu et al. 2025, "Muon is scalable for LLM
    training"), train.learning_rate and train.weight_decay mean for Muon what they mean for AdamW."""

    def scale(x, dims):
        fan_in = math.prod(x.shape[a] for a in dims.reduction_axis)
        fan_out = math.prod(x.shape[a] for a in dims.output_axis)
        return x * (rms * math.sqrt(max(fan_in, fan_out)))

    def update(updates, state, params=None):

        dims = _muon_dims(updates)
        return jax.tree.map(scale, updates, dims, is_leaf=lambda d: isinstance(d, MuonDimensionNumbers)), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _adamw(hp):
    return optax.adamw(
        learning_rate_schedule(hp), b1=hp["beta1"], b2=hp["beta2"], weight_decay=hp["weight_decay"], mask=decay_mask
    )


def _muon(hp):

    schedule = learning_rate_schedule(hp)
    matrices = optax.chain(
        contrib.scale_by_muon(beta=hp["muon_momentum"], nesterov=True, weight_dimension_numbers=_muon_dims),
        _scale_to_rms(0.2),
        optax.add_decayed_weights(hp["weight_decay"]),  # every Muon parameter is a matrix: all decayed
        optax.scale_by_learning_rate(schedule),
    )
    return optax.partition({"muon": matrices, "adamw": _adamw(hp)}, muon_labels)


def _lion(hp):
    return optax.lion(
        learning_rate_schedule(hp), b1=hp["beta1"], b2=hp["beta2"], weight_decay=hp["weight_decay"], mask=decay_mask
    )


def _adafactor(hp):
    # optax.adafactor adds weight decay AFTER the learning rate (p -= lr * u + wd * p: a decay of 0.1 would shrink
    # every weight by 10% a step); here decay is decoupled as in AdamW (p -= lr * (u + wd * p)). No momentum (the
    # memory saving is the point), factored second moments for dims >= 128 with Adafactor's own step-dependent
    # decay 1 - t^-0.8, updates clipped to block RMS 1, no relative (parameter-scale) step size, so the
    # learning rate is an absolute one like AdamW's.
    return optax.chain(
        optax.scale_by_factored_rms(decay_rate=0.8),
        optax.clip_by_block_rms(1.0),
        optax.add_decayed_weights(hp["weight_decay"], mask=decay_mask),
        optax.scale_by_learning_rate(learning_rate_schedule(hp)),
    )


_OPTIMIZERS = {"adamw": _adamw, "muon": _muon, "lion": _lion, "adafactor": _adafactor}


def make_optimizer(t: TrainConfig, hp=None) -> optax.GradientTransformation:
    """Global-norm clipping (when train.grad_clip > 0), then train.optimizer with the warmup + cosine schedule and
    decoupled weight decay on matrices and embeddings only:

        adamw      AdamW (beta1, beta2)
        muon       Muon (optax.contrib) on the hidden weight matrices (`MUON_MATRICES`), Nesterov momentum
                   train.muon_momentum, updates scaled to RMS 0.2; AdamW on embeddings, LM head, gains, biases, sinks
        lion       Lion (beta1, beta2 as its two interpolation rates); its sign update has RMS 1, so it wants a
                   learning rate several times smaller than AdamW's
        adafactor  Adafactor: factored second moments, no momentum, block-RMS clipping

    With train.opt_state_dtype set, the optimizer state is stored in that dtype (`with_state_dtype`).
    `hp` overrides the values of `t` with (traced) `hyperparams`; the optimizer state's structure depends only on
    `optimizer_structure(t)`."""
    hp = hyperparams(t) if hp is None else hp
    parts = []
    if t.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(hp["grad_clip"]))
    parts.append(_OPTIMIZERS[t.optimizer](hp))
    optimizer = optax.chain(*parts)
    if t.opt_state_dtype != "auto":
        optimizer = with_state_dtype(optimizer, jnp.dtype(t.opt_state_dtype))
    return optimizer


def split_params(model) -> tuple[Any, dict, dict]:
    """(graphdef, params as a pure dict, other state as a pure dict) of an NNX model."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(rest)


def init_params(model_config: ModelConfig, seed: int) -> tuple[Any, dict, dict]:
    """(graphdef, params, rest) of a freshly initialised model, built eagerly: each initialiser op runs as its own
    small compiled program, cached by shape, so a second model of the same widths compiles nothing. One jitted
    program for the whole initialisation (this function's earlier form) compiled again for every configuration:
    about 3 CPU-s per tiny config under the suite's flags against 0.1-0.5 s eagerly, and 32 CPU-s for the 135M
    shape at XLA's default flags against 7 s eagerly (2-core Zen 4)."""
    return split_params(build_model(model_config, seed))


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
    """The part of a TrainConfig that shapes the optimizer state: which optimizer, its state dtype and whether
    clipping is on (everything else enters the step as traced hyperparameters). Compiled steps and inits are
    cached per this structure."""
    return TrainConfig(
        grad_clip=1.0 if train_config.grad_clip > 0 else 0.0,
        optimizer=train_config.optimizer,
        opt_state_dtype=train_config.opt_state_dtype,
    )


def optimizer_changes(saved_train: dict, train_config: TrainConfig) -> list[str]:
    """Lines naming the settings that shape the optimizer state (optimizer, state dtype, clipping on/off) and
    differ between a checkpoint's train config (the saved dict; missing keys are the defaults) and
    `train_config`: a state saved under the one cannot be restored into the other."""
    defaults = TrainConfig()
    out = []
    for k in ("optimizer", "opt_state_dtype"):
        old, new = saved_train.get(k, getattr(defaults, k)), getattr(train_config, k)
        if old != new:
            out.append(f"train.{k}: {old!r} -> {new!r}")
    old_clip = saved_train.get("grad_clip", defaults.grad_clip)
    if (old_clip > 0) != (train_config.grad_clip > 0):
        out.append(f"train.grad_clip: {old_clip} -> {train_config.grad_clip} (clipping turned on or off)")
    return out


def check_optimizer_resume(saved_train: dict, train_config: TrainConfig, where: str) -> None:
    """Raise ConfigError when the optimizer state saved with `saved_train` (a checkpoint's train config) cannot
    continue under `train_config`, naming the settings that differ."""
    changed = optimizer_changes(saved_train, train_config)
    if changed:
        raise ConfigError(
            f"{where} holds the state of another optimizer ({'; '.join(changed)}); it cannot continue under this "
            "one: keep those settings, or use a new --workdir"
        )


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
