"""The jitted training and evaluation steps: pure functions of (params or TrainState, batch).

The module is split once into graph definition + state; each jitted function takes the graph definition as a
static argument and rebuilds the module inside the trace, so a call costs no Python walk over the module graph.
Compiled functions are cached per (model config, train config), so every run with the same shapes in a process
reuses them.

Loss: token-level cross entropy in float32, summed over tokens with weight 1 (real next tokens of the same
document) and divided by the number of such tokens in the whole batch. With gradient accumulation the batch is
split into `train.microbatches` pieces; the per-piece *sums* of loss and gradient are accumulated and divided by
the total token count once, so unequal pieces are weighted by their tokens, exactly as one big batch would be.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from causal_lm import parallel
from causal_lm.config import ModelConfig, TrainConfig
from causal_lm.train.lora import merge_model
from causal_lm.train.state import (
    TrainState,
    hyperparams,
    learning_rate_schedule,
    make_optimizer,
    optimizer_structure,
    train_state_shardings,
)


def loss_sums(model, batch):
    """(sum of weighted token cross entropies, sum of weights) for one batch: float32 scalars."""
    logits, _ = model(batch["tokens"], segment_ids=batch["segment_ids"])  # [B, T, V] float32
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["targets"])  # [B, T]
    w = batch["weights"].astype(jnp.float32)
    return jnp.sum(ce * w), jnp.sum(w)


def z_loss_sums(model, batch):
    """(sum of weighted cross entropies, sum of weights, sum of weighted log(Z)^2) for one batch, where
    log Z = logsumexp of a token's logits: the auxiliary z-loss (PaLM) that keeps the softmax normaliser near 1,
    so logits do not drift (bf16 logits lose precision when they grow)."""
    logits, _ = model(batch["tokens"], segment_ids=batch["segment_ids"])
    logits = logits.astype(jnp.float32)  # [B, T, V]
    log_z = jax.nn.logsumexp(logits, axis=-1)  # [B, T]
    target = jnp.take_along_axis(logits, batch["targets"][..., None], axis=-1)[..., 0]  # [B, T]
    w = batch["weights"].astype(jnp.float32)
    return jnp.sum((log_z - target) * w), jnp.sum(w), jnp.sum(jnp.square(log_z) * w)


def _split_micro(batch, k: int):
    """[B, ...] -> [k, B/k, ...] for every array of the batch."""
    return jax.tree.map(lambda x: x.reshape((k, x.shape[0] // k) + x.shape[1:]), batch)


def loss_and_grads(graphdef, params, rest, batch, microbatches: int = 1, z_loss=None):
    """(mean cross entropy over weighted tokens, gradient of the objective, token count, z-loss term),
    accumulating over microbatches.

    The objective is the mean cross entropy, plus, when `z_loss` (a coefficient, possibly traced) is given,
    z_loss * the mean log(Z)^2 over the same tokens; the z-loss term returned is that addend (0 without z_loss).
    Both sums are divided by the whole batch's token count, so microbatches weigh by their tokens."""

    def sums(p, mb):
        model = merge_model(graphdef, p, rest)
        if z_loss is None:
            ce, n = loss_sums(model, mb)
            return ce, (ce, n, jnp.float32(0))
        ce, n, z2 = z_loss_sums(model, mb)
        return ce + z_loss * z2, (ce, n, z2)

    grad_fn = jax.value_and_grad(sums, has_aux=True)
    if microbatches == 1:
        (_, (loss_sum, count, z2_sum)), grad_sum = grad_fn(params, batch)
    else:

        def body(carry, mb):
            g_acc, loss_acc, n_acc, z2_acc = carry
            (_, (loss, n, z2)), g = grad_fn(params, mb)
            return (jax.tree.map(jnp.add, g_acc, g), loss_acc + loss, n_acc + n, z2_acc + z2), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        zero = jnp.float32(0)
        (grad_sum, loss_sum, count, z2_sum), _ = jax.lax.scan(
            body, (zeros, zero, zero, zero), _split_micro(batch, microbatches)
        )
    denom = jnp.maximum(count, 1.0)
    z_term = jnp.float32(0) if z_loss is None else z_loss * z2_sum / denom
    return loss_sum / denom, jax.tree.map(lambda g: g / denom, grad_sum), count, z_term


def _all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def compiled_train_step(model_config: ModelConfig, train_config: TrainConfig, graphdef, mesh=None):
    """`step(state, rest, batch) -> (state, metrics)`: one jitted program with the state donated.

    metrics: loss (the mean cross entropy), grad_norm (before clipping), lr, tokens (weighted targets), and
    z_loss (the auxiliary term's value) when train.z_loss > 0. A non-finite loss, gradient or updated parameter
    skips the update and records the step in `state.bad_step`, checked by the host at log and checkpoint
    intervals: the step is named exactly without a host sync every step.
    The learning-rate schedule, the optimizer's settings and the z-loss coefficient are traced arguments, so only
    the model, the microbatch count and `optimizer_structure` (optimizer, state dtype, clipping on/off) and
    whether the z-loss is on select a compiled program.
    mesh: a `causal_lm.parallel` mesh; the new state then keeps the partition rules' shardings (the state and
    batch passed in must already be laid out on it) and the metrics come back replicated. None: one device.
    """
    jitted = train_step_program(model_config, train_config, graphdef, mesh)
    hp = hyperparams(train_config)
    return lambda state, rest, batch: jitted(state, rest, batch, hp)


def train_step_program(model_config: ModelConfig, train_config: TrainConfig, graphdef, mesh=None):
    """The jitted `step(state, rest, batch, hyperparams(train_config)) -> (state, metrics)` behind
    `compiled_train_step`, cached per structure (one object per model config, microbatch count, optimizer
    structure and z-loss on/off); `.lower(...)` on it gives the compiled program, e.g. for a benchmark."""
    return _compiled_train_step(*train_step_key(model_config, train_config, graphdef, mesh))


def train_step_key(model_config: ModelConfig, train_config: TrainConfig, graphdef, mesh=None) -> tuple:
    """What selects a compiled training step: the arguments of `build_train_step`."""
    return (
        model_config,
        train_config.microbatches,
        train_config.grad_clip > 0,
        graphdef,
        mesh,
        train_config.optimizer,
        train_config.opt_state_dtype,
        train_config.z_loss > 0,
    )


def build_train_step(
    model_config: ModelConfig,
    microbatches: int,
    clip: bool,
    graphdef,
    mesh=None,
    optimizer: str = "adamw",
    opt_state_dtype: str = "auto",
    z_loss: bool = False,
):
    """A new jitted step (never cached: `train_step_program` reuses one per structure; a benchmark that times a
    compile builds its own with `build_train_step(*train_step_key(...))`)."""
    structure = optimizer_structure(
        TrainConfig(grad_clip=1.0 if clip else 0.0, optimizer=optimizer, opt_state_dtype=opt_state_dtype)
    )

    def step(state: TrainState, rest, batch, hp):
        optimizer = make_optimizer(structure, hp)
        loss, grads, count, z_term = loss_and_grads(
            graphdef, state.params, rest, batch, microbatches, hp["z_loss"] if z_loss else None
        )
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        ok = (
            jnp.isfinite(loss)
            & jnp.isfinite(z_term)
            & jnp.isfinite(grad_norm)
            & _all_finite(params)
            & (state.bad_step == 0)
        )
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa: E731
        rng, _ = jax.random.split(state.rng)
        new = TrainState(
            params=keep(params, state.params),
            opt_state=keep(opt_state, state.opt_state),
            step=state.step + ok.astype(jnp.int32),
            rng=keep(rng, state.rng),
            bad_step=jnp.where((state.bad_step == 0) & ~ok, state.step + 1, state.bad_step),
        )
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": learning_rate_schedule(hp)(state.step), "tokens": count}
        if z_loss:
            metrics["z_loss"] = z_term
        return new, metrics

    if mesh is None:
        return jax.jit(step, donate_argnums=0)
    # Pinning the output state to the input's shardings keeps the layout (and the compiled program) fixed from
    # step to step; XLA's partitioner derives the collectives (gradient reduce-scatter, weight all-gathers).
    state_sh, _ = train_state_shardings(model_config, structure, mesh)
    return jax.jit(step, donate_argnums=0, out_shardings=(state_sh, parallel.replicated(mesh)))


_compiled_train_step = functools.lru_cache(maxsize=16)(build_train_step)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _eval_sums(params, rest, batch, *, graphdef):
    return loss_sums(merge_model(graphdef, params, rest), batch)


def eval_sums(graphdef, params, rest, batch):
    """Jitted (loss sum, token count) of one batch."""
    return _eval_sums(params, rest, batch, graphdef=graphdef)
