"""train.task=dpo and train.task=grpo inside the training loop (causal_lm/train/loop.py): their data, their steps.

Both keep a frozen reference: with LoRA the base without adapters (the `rest` a LoRA run already holds: no second
copy), otherwise the weights the run started from, held in `rest` beside the model's other state (`RefGraph`)
and written once to workdir/frozen_base (checksummed) so a resumed run compares against the same reference.

A step has the training loop's signature, `step(state, rest, batch) -> (state, metrics)`, with the same
non-finite guard as `lm` (a bad step is skipped and recorded in state.bad_step), so checkpoints, exact resume,
divergence checks, evaluation and metrics work unchanged. The metrics beyond loss/grad_norm/lr (DPO: implicit
reward margins and accuracy; GRPO: reward mean/std, ratio statistics, KL, completion lengths) go into the logged
record as the mean over the log interval.

dpo   batches of {prompt, chosen, rejected} pairs from JSONL (data.corpus), beta = train.beta; validation: the
      assistant-token loss of the held-out pairs' chosen replies.
grpo  each step draws train.prompts_per_step arithmetic questions (operands below train.max_operand), samples
      train.group_size replies to each through the serving engine on the current weights, scores them with
      train.reward (module:function), and takes train.inner_steps clipped-ratio updates on that batch
      (train.clip_eps, train.kl_coef to the reference). Validation: the assistant-token loss on held-out
      synthetic-chat conversations.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from causal_lm.config import ConfigError
from causal_lm.data.corpus import DataError
from causal_lm.data.pipeline import DataSplits, is_validation
from causal_lm.data.tokenizer import tokenizer_from_spec
from causal_lm.train import post
from causal_lm.train.dpo import dpo_loss, encode_pairs, read_preferences, sequence_logps
from causal_lm.train.grpo import (
    GRPOSettings,
    group_advantages,
    grpo_loss,
    load_reward,
    rollout,
    rollout_batch,
    token_logprobs,
)
from causal_lm.train.lora import LoraGraph, RefGraph, merge_model
from causal_lm.train.post import SYNTHETIC_CHAT, arithmetic_problem, build_sft_data
from causal_lm.train.state import (
    TrainState,
    hyperparams,
    learning_rate_schedule,
    make_optimizer,
    optimizer_structure,
)

REFERENCE_TASKS = ("dpo", "grpo")


def reference_model(graphdef, rest):
    """The frozen reference: the base without adapters (LoRA) or the starting weights (RefGraph)."""
    return nnx.merge(graphdef.graphdef, rest["base"], rest["rest"])


def policy_model(graphdef, params, rest):
    return merge_model(graphdef, params, rest)


# ---- data ----------------------------------------------------------------------------------------------------


class PairIterator:
    """Endless batches of preference pairs [2B, T] (chosen rows, then rejected), reshuffled per epoch."""

    def __init__(self, pairs: dict, batch_size: int, seed: int):
        self.pairs, self.batch_size, self.seed = pairs, batch_size, seed
        self.n = pairs["tokens"].shape[0] // 2
        self.epoch, self.index = 0, 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch):
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        picked, need = [], self.batch_size
        while need:
            take = self._perm[self.index : self.index + need]
            picked.append(take)
            need -= len(take)
            self.index += len(take)
            if self.index == self.n:
                self.epoch, self.index = self.epoch + 1, 0
                self._perm = self._permutation(self.epoch)
        idx = np.concatenate(picked)
        rows = np.concatenate([idx, idx + self.n])
        return {k: v[rows] for k, v in self.pairs.items()}

    def state(self) -> dict:
        return {"kind": "pairs", "epoch": self.epoch, "index": self.index, "num_pairs": self.n}

    def restore(self, state: dict) -> None:
        if state.get("kind") != "pairs" or state.get("num_pairs") != self.n:
            raise DataError(f"the saved data-iterator state ({state}) does not fit this preference set ({self.n})")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._perm = self._permutation(self.epoch)


class ProblemIterator:
    """Endless lists of (question, answer) problems for GRPO; batch i is drawn from a generator seeded (seed, i)."""

    def __init__(self, count: int, seed: int, problem_fn=arithmetic_problem):
        self.count, self.seed, self.problem_fn, self.index = count, seed, problem_fn, 0

    def __iter__(self):
        return self

    def __next__(self) -> list:
        rng = np.random.default_rng([self.seed, 23, self.index])
        self.index += 1
        return [self.problem_fn(rng) for _ in range(self.count)]

    def state(self) -> dict:
        return {"kind": "problems", "index": self.index}

    def restore(self, state: dict) -> None:
        if state.get("kind") != "problems":
            raise DataError(f"the saved data-iterator state ({state}) is not a GRPO problem stream")
        self.index = int(state["index"])


def build_task_data(config, tokenizer=None, **kwargs) -> DataSplits:
    """The data of `config.train.task`: lm's packed text, sft's conversations, dpo's pairs, grpo's problems."""
    if config.train.task == "dpo":
        return build_dpo_data(config, tokenizer)
    if config.train.task == "grpo":
        return build_grpo_data(config, tokenizer)
    return post.build_task_data(config, tokenizer, **kwargs)


def build_dpo_data(config, tokenizer=None) -> DataSplits:
    d, t = config.data, config.train
    if d.corpus in ("builtin", SYNTHETIC_CHAT) or d.corpus.startswith("hf:"):
        raise ConfigError(
            'train.task=dpo needs preference pairs: data.corpus=FILE.jsonl of {"prompt", "chosen", "rejected"} '
            "records (data.path is not a key; give the file as data.corpus)"
        )
    records = read_preferences(d.corpus)
    if d.max_documents:
        records = records[: d.max_documents]
    if len(records) < 2:
        raise DataError(f"data.corpus={d.corpus!r}: a validation split needs at least two preference pairs")
    if tokenizer is None:
        texts = [r[k] for r in records for k in ("prompt", "chosen", "rejected")] + ["User: Assistant: \n"]
        tokenizer = tokenizer_from_spec(d.tokenizer, texts if d.tokenizer == "char" else ())
    val = is_validation(np.arange(len(records)), d.val_fraction)
    if not val.any():
        val[-1] = True
    if val.all():
        val[0] = False
    train_recs = [r for r, v in zip(records, val, strict=True) if not v]
    val_recs = [r for r, v in zip(records, val, strict=True) if v]
    pairs = encode_pairs(tokenizer, train_recs, t.seq_len)
    held = encode_pairs(tokenizer, val_recs, t.seq_len)
    n = len(val_recs)
    chosen = {k: v[:n] for k, v in held.items()}
    val_batches = [{k: v[i : i + t.batch_size] for k, v in chosen.items()} for i in range(0, n, t.batch_size)][
        : t.eval_batches
    ]
    info = {"pairs": len(records), "train_pairs": len(train_recs), "val_pairs": n}
    return DataSplits(tokenizer, PairIterator(pairs, t.batch_size, t.seed), val_batches, info)


def build_grpo_data(config, tokenizer=None) -> DataSplits:
    t = config.train
    chat = dataclasses.replace(config, data=dataclasses.replace(config.data, corpus=SYNTHETIC_CHAT, streaming=False))
    sft = build_sft_data(chat, tokenizer)
    info = {"prompts_per_step": t.prompts_per_step, "group_size": t.group_size, "val_rows": sft.info["val_rows"]}
    problems = ProblemIterator(
        t.prompts_per_step, t.seed, functools.partial(arithmetic_problem, max_operand=t.max_operand)
    )
    return DataSplits(sft.tokenizer, problems, sft.val, info)


# ---- steps ---------------------------------------------------------------------------------------------------


def _finish(state: TrainState, grads, loss, stats, hp, structure, advance=True):
    """The optimizer update with lm's guard: a non-finite loss, gradient or update skips the step. advance=False:
    an update inside a step (GRPO's inner updates before the last): the step count and the rng stay."""
    optimizer = make_optimizer(structure, hp)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(params)]))
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & finite & (state.bad_step == 0)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa: E731
    advance = jnp.asarray(advance)  # may be traced: one program for inner and last updates
    rng = jnp.where(advance, jax.random.split(state.rng)[0], state.rng)
    new = TrainState(
        params=keep(params, state.params),
        opt_state=keep(opt_state, state.opt_state),
        step=state.step + (ok & advance).astype(jnp.int32),
        rng=keep(rng, state.rng),
        bad_step=jnp.where((state.bad_step == 0) & ~ok, state.step + 1, state.bad_step),
    )
    metrics = {"loss": loss, "grad_norm": grad_norm, "lr": learning_rate_schedule(hp)(state.step), **stats}
    return new, metrics


def _structure(t):
    return optimizer_structure(t)


def dpo_step(config, graphdef):
    t = config.train
    structure, beta = _structure(t), float(t.beta)

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, rest, batch, hp):
        n = batch["tokens"].shape[0] // 2
        ref = jax.lax.stop_gradient(sequence_logps(reference_model(graphdef, rest), batch))

        def loss_fn(p):
            logps = sequence_logps(policy_model(graphdef, p, rest), batch)
            return dpo_loss(logps[:n], logps[n:], ref[:n], ref[n:], beta)

        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        new, metrics = _finish(state, grads, loss, stats, hp, structure)
        metrics["tokens"] = batch["weights"].sum()
        return new, metrics

    hp = hyperparams(t)
    return lambda state, rest, batch: step(state, rest, batch, hp)


def grpo_settings(t) -> GRPOSettings:
    return GRPOSettings(
        group_size=t.group_size,
        prompts_per_step=t.prompts_per_step,
        max_new_tokens=t.max_new_tokens,
        temperature=t.rollout_temperature,
        top_k=t.rollout_top_k,
        top_p=t.rollout_top_p,
        clip_eps=t.clip_eps,
        kl_coef=t.kl_coef,
        learning_rate=t.learning_rate,
        reward=t.reward,
        seed=t.seed,
        inner_steps=t.inner_steps,
    )


def grpo_step(config, graphdef, tokenizer, console=None):
    """The GRPO step: rollout on the host through the engine (the current weights), rewards, then inner_steps
    jitted updates on that batch (the step count advances once, at the last). The first update's max |ratio - 1|
    (sampler vs trainer log-probabilities) is printed."""
    t = config.train
    s = grpo_settings(t)
    reward = load_reward(t.reward)
    structure = _structure(t)
    length = t.seq_len
    first = [True]

    @functools.partial(jax.jit, donate_argnums=0)
    def update(state, rest, batch, adv, hp, advance):
        args = (batch["tokens"], batch["targets"], batch["segment_ids"], s.temperature, s.top_k, s.top_p)
        ref = None
        if s.kl_coef > 0:
            ref = jax.lax.stop_gradient(token_logprobs(reference_model(graphdef, rest), *args))

        def loss_fn(p):
            new = token_logprobs(policy_model(graphdef, p, rest), *args)
            return grpo_loss(new, batch["old_logp"], adv, batch["weights"], s.clip_eps, ref, s.kl_coef)

        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        new, metrics = _finish(state, grads, loss, stats, hp, structure, advance)
        metrics["tokens"] = batch["weights"].sum()
        return new, metrics

    hp = hyperparams(t)

    def step(state, rest, problems):
        model = policy_model(graphdef, state.params, rest)
        seed = int(jax.device_get(state.step))
        groups = rollout(model, tokenizer, problems, s, seed)
        rewards = np.asarray(
            [[reward(tokenizer.decode(r.tokens), a) for r in g] for g, (_, a) in zip(groups, problems, strict=True)],
            np.float32,
        )
        batch, adv = rollout_batch(groups, group_advantages(rewards), length)
        inner = []  # the first inner update's metrics are the step's (its ratio: the sampler/trainer parity)
        for i in range(s.inner_steps):
            state, m = update(state, rest, batch, adv, hp, np.bool_(i == s.inner_steps - 1))
            inner.append(m)
        metrics = dict(inner[0])
        if s.inner_steps > 1:
            metrics.update(
                {f"last_{k}": inner[-1][k] for k in ("ratio_mean", "ratio_min", "ratio_max", "ratio_max_dev")}
            )
        lengths = [len(r.tokens) for g in groups for r in g]
        metrics.update(
            reward_mean=float(rewards.mean()),
            reward_std=float(rewards.std()),
            length_mean=float(np.mean(lengths)),
            length_max=float(np.max(lengths)),
        )
        if first[0]:
            first[0] = False
            dev = float(jax.device_get(metrics["ratio_max_dev"]))
            line = (
                f"GRPO first update: max |ratio - 1| = {dev:.3g} (sampler vs trainer log-probabilities of the same "
                f"tokens; 0: bitwise equal, every ratio exactly 1)"
            )
            if console is not None:
                console.print(line)
            metrics["first_ratio_max_dev"] = dev
        return state, metrics

    return step


def task_step(config, graphdef, tokenizer, console=None):
    if config.train.task == "dpo":
        return dpo_step(config, graphdef)
    return grpo_step(config, graphdef, tokenizer, console)


def with_reference(graphdef, rest, reference):
    """(graphdef, rest) of a full-weight DPO/GRPO run: the reference params held in rest."""
    if isinstance(graphdef, LoraGraph):
        return graphdef, rest  # the LoRA base is the reference
    return RefGraph(graphdef), {"base": reference, "rest": rest}
