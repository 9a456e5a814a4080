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
from flax import nnx

from causal_lm import parallel
from causal_lm.config import ModelConfig, TrainConfig
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


def _split_micro(batch, k: int):
    """[B, ...] -> [k, B/k, ...] for every array of the batch."""
    return jax.tree.map(lambda x: x.reshape((k, x.shape[0] // k) + x.shape[1:]), batch)


def loss_and_grads(graphdef, params, rest, batch, microbatches: int = 1):
    """(mean loss over weighted tokens, gradient of that mean, token count), accumulating over microbatches."""

    def sums(p, mb):
        return loss_sums(nnx.merge(graphdef, p, rest), mb)

    grad_fn = jax.value_and_grad(sums, has_aux=True)
    if microbatches == 1:
        (loss_sum, count), grad_sum = grad_fn(params, batch)
    else:

        def body(carry, mb):
            g_acc, loss_acc, n_acc = carry
            (loss, n), g = grad_fn(params, mb)
            return (jax.tree.map(jnp.add, g_acc, g), loss_acc + loss, n_acc + n), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        (grad_sum, loss_sum, count), _ = jax.lax.scan(
            body, (zeros, jnp.float32(0), jnp.float32(0)), _split_micro(batch, microbatches)
        )
    denom = jnp.maximum(count, 1.0)
    return loss_sum / denom, jax.tree.map(lambda g: g / denom, grad_sum), count


def _all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def compiled_train_step(model_config: ModelConfig, train_config: TrainConfig, graphdef, mesh=None):
    """`step(state, rest, batch) -> (state, metrics)`: one jitted program with the state donated.

    metrics: loss, grad_norm (before clipping), lr, tokens (weighted targets). A non-finite loss, gradient or
    updated parameter skips the update and records the step in `state.bad_step`, checked by the host at log
    and checkpoint intervals: the step is named exactly without a host sync every step.
    The learning-rate schedule and AdamW settings are traced arguments, so only the model, the microbatch count
    and whether clipping is on select a compiled program.
    mesh: a `causal_lm.parallel` mesh; the new state then keeps the partition rules' shardings (the state and
    batch passed in must already be laid out on it) and the metrics come back replicated. None: one device.
    """
    jitted = _compiled_train_step(model_config, train_config.microbatches, train_config.grad_clip > 0, graphdef, mesh)
    hp = hyperparams(train_config)
    return lambda state, rest, batch: jitted(state, rest, batch, hp)


def build_train_step(model_config: ModelConfig, microbatches: int, clip: bool, graphdef, mesh=None):
    """A new jitted `step(state, rest, batch, hp)` (never cached: `compiled_train_step` reuses one per model, and
    benchmarks that time a compile build their own). hp: `hyperparams(train_config)`."""
    structure = optimizer_structure(TrainConfig(grad_clip=1.0 if clip else 0.0))

    def step(state: TrainState, rest, batch, hp):
        optimizer = make_optimizer(structure, hp)
        loss, grads, count = loss_and_grads(graphdef, state.params, rest, batch, microbatches)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & _all_finite(params) & (state.bad_step == 0)
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
    return loss_sums(nnx.merge(graphdef, params, rest), batch)


def eval_sums(graphdef, params, rest, batch):
    """Jitted (loss sum, token count) of one batch."""
    return _eval_sums(params, rest, batch, graphdef=graphdef)
