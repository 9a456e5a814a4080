"""GRPO: reinforcement learning with verifiable rewards, sampling through the serving engine in this process.

One update:
  1. rollout: for each of the step's prompts, G samples through `causal_lm.Engine.submit_samples` (the samples
     share the prompt's pages), each token with `sample_logprob`, its log-probability under the distribution it was
     actually drawn from (temperature, top-k, top-p applied: `causal_lm.decode.sampling.sampled_logprobs`);
  2. rewards from a Python function (`module:function`, called as fn(completion_text, answer) -> float), and
     group-normalized advantages A = (r - mean(group)) / (std(group) + 1e-6), one per sample, for all its tokens;
  3. the clipped surrogate over completion tokens, ratio = exp(logp_trainer - logp_sampler), both computed by
     `sampled_logprobs` from float32 logits, loss = -mean(min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)),
     plus kl_coef * the k3 estimate of KL(policy || reference) when kl_coef > 0 (the reference: the starting
     weights).
  4. steps 2-3's batch gives `inner_steps` clipped updates in a row (GRPO's inner epochs, default 1), each on
     the weights the previous one left, against the same sampler log-probabilities: the first inner update's ratio
     is the sampler/trainer mismatch itself, the later ones' is how far the policy has moved since the rollout
     (what the clip bounds).
The log reports the first inner update's ratio mean, min, max and max |ratio - 1| (and, with inner_steps > 1, the
last one's as last_ratio_*). With `batch_invariant=True` (the default) both sides run the model's batch-invariant
scoring mode (the rollout engine with `batch_invariant=True`, `token_logprobs` with `forward(batch_invariant=True)`):
each token's computation has the same shapes in a decode step and in the update's forward pass, so on a CPU in
float32 the two are bitwise equal and the first update's ratio is exactly 1 (docs/post-training.md: the conditions,
and the bfloat16 bound). `batch_invariant=False` runs both sides in the default mode: faster, and a first ratio
within ~1e-5 of 1.

The rollout engine's page pool is sized to the rollout (`rollout_engine_kwargs`: group_size * prompts_per_step
sequences of prompt + max_new_tokens tokens), not the engine's default 1 GiB, which a fresh engine per step would
allocate and clear each time.

Built-in rewards: `arithmetic_reward` (exact match of the last number of the reply with the answer) and
`format_reward` (the reply ends with "The answer is N."), on arithmetic prompts made on the fly
(`causal_lm.train.post.arithmetic_problem`).
"""

from __future__ import annotations

import dataclasses
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from causal_lm.config import ConfigError
from causal_lm.decode.sampling import sampled_logprobs
from causal_lm.model.paged_cache import pages_for
from causal_lm.serve.engine import Engine
from causal_lm.train.post import arithmetic_problem, end_of_turn_ids, prompt_ids

_NUMBER = re.compile(r"-?\d+")
_FORMAT = re.compile(r"The answer is -?\d+\.\s*$")


def arithmetic_reward(completion: str, answer) -> float:
    """1.0 when the last number in the reply is the answer, else 0.0."""
    nums = _NUMBER.findall(completion)
    return float(bool(nums) and int(nums[-1]) == int(answer))


def format_reward(completion: str, answer) -> float:
    """1.0 when the reply ends with 'The answer is N.' (any N), else 0.0."""
    return float(bool(_FORMAT.search(completion)))


def arithmetic_and_format_reward(completion: str, answer) -> float:
    """The exact-match reward plus a tenth of the format reward."""
    return arithmetic_reward(completion, answer) + 0.1 * format_reward(completion, answer)


def load_reward(spec: str):
    """A reward function from 'module:function' (ConfigError naming what is missing)."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ConfigError(f"train.reward must be 'module:function', got {spec!r}")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"train.reward={spec!r}: cannot import {module!r} ({e})") from None
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise ConfigError(f"train.reward={spec!r}: {module} has no function {name!r}")
    return fn


def group_advantages(rewards) -> np.ndarray:
    """rewards [P, G] -> advantages [P, G]: each group's rewards minus its mean, over its std (+1e-6)."""
    r = np.asarray(rewards, np.float64)
    return ((r - r.mean(axis=1, keepdims=True)) / (r.std(axis=1, keepdims=True) + 1e-6)).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class GRPOSettings:
    """What one GRPO run samples and optimizes (the train.* keys of the same names)."""

    group_size: int = 8  # G samples per prompt
    prompts_per_step: int = 4
    max_new_tokens: int = 24
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    learning_rate: float = 1e-3
    reward: str = "causal_lm.train.grpo:arithmetic_and_format_reward"
    seed: int = 0
    inner_steps: int = 1  # clipped updates per rollout batch (GRPO's inner epochs)
    batch_invariant: bool = True  # both sides in the batch-invariant mode: the first ratio exactly 1 on a CPU

    def __post_init__(self):
        if not isinstance(self.inner_steps, int) or self.inner_steps < 1:
            raise ConfigError(f"inner_steps must be a positive integer, got {self.inner_steps!r}")


def rollout_engine_kwargs(s: GRPOSettings, max_seq_len: int, prompt_tokens: int, page_size: int = 8) -> dict:
    """The rollout engine's size: one row per sample (group_size * prompts_per_step) and a page pool holding each
    of them at prompt_tokens + max_new_tokens (rounded up to a power of two >= 64, at most max_seq_len, so that a
    run sees few pool shapes and compiles the engine's programs few times), instead of the default 1 GiB pool."""
    seqs = s.group_size * s.prompts_per_step
    tokens = min(max_seq_len, max(64, 1 << max(0, prompt_tokens + s.max_new_tokens - 1).bit_length()))
    return dict(max_seqs=seqs, page_size=page_size, num_pages=seqs * pages_for(tokens, page_size))


def token_logprobs(model, tokens, targets, segment_ids, temperature, top_k, top_p, invariant=True):
    """[B, T] log-probabilities of `targets` under the distribution the sampler draws from, from one forward pass
    over `tokens` (the trainer's side of the parity with the engine's `sample_logprobs`); invariant: the
    batch-invariant scoring mode (what a rollout engine with batch_invariant=True runs)."""
    logits = model.forward(tokens, segment_ids=segment_ids, batch_invariant=invariant).logits
    return sampled_logprobs(logits.astype(jnp.float32), targets, temperature, top_k, top_p, invariant=invariant)


def grpo_loss(new_logp, old_logp, advantages, weights, clip_eps, ref_logp=None, kl_coef=0.0):
    """(loss, stats): the clipped surrogate over weighted tokens (mean over all of them), + kl_coef * k3 KL."""
    ratio = jnp.exp(new_logp - old_logp)
    adv = advantages[:, None]
    surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv)
    n = jnp.maximum(weights.sum(), 1.0)
    loss = -(surrogate * weights).sum() / n
    kl = jnp.float32(0)
    if ref_logp is not None:
        d = ref_logp - new_logp
        kl = ((jnp.exp(d) - d - 1.0) * weights).sum() / n
        loss = loss + kl_coef * kl
    on = weights > 0
    stats = {
        "ratio_mean": (ratio * weights).sum() / n,
        "ratio_min": jnp.min(jnp.where(on, ratio, jnp.inf)),
        "ratio_max": jnp.max(jnp.where(on, ratio, -jnp.inf)),
        "ratio_max_dev": jnp.max(jnp.where(on, jnp.abs(ratio - 1.0), 0.0)),
        "kl": kl,
    }
    return loss, stats


def rollout(model, tokenizer, problems, s: GRPOSettings, seed: int, engine_kwargs=None):
    """G samples per (question, answer) through the engine: a list (per prompt) of lists of RequestResults.
    engine_kwargs: Engine arguments over `rollout_engine_kwargs`'s (sized to this rollout's longest prompt)."""
    prompts = [prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q, _ in problems]
    sized = rollout_engine_kwargs(s, model.config.max_seq_len, max(map(len, prompts)))
    engine = Engine(model, **{"batch_invariant": s.batch_invariant, **sized, **(engine_kwargs or {})})
    stop = end_of_turn_ids(tokenizer)
    groups = []
    for i, ids in enumerate(prompts):
        groups.append(
            engine.submit_samples(
                ids,
                num_samples=s.group_size,
                seed=seed * 1000 + i * s.group_size,
                max_tokens=s.max_new_tokens,
                temperature=s.temperature,
                top_k=s.top_k or None,
                top_p=s.top_p,
                stop=stop,
            )
        )
    while engine.has_work():
        engine.step()
    return [[engine.result(r) for r in g] for g in groups]


def rollout_batch(groups, advantages, length: int):
    """Padded arrays for the update: tokens/targets/segment_ids/weights [B, length] (weights 1 on completion
    targets), old_logp [B, length] (the sampler's sample_logprobs at those targets), advantages [B]."""
    results = [r for g in groups for r in g]
    B = len(results)
    tokens = np.zeros((B, length), np.int32)
    targets = np.zeros((B, length), np.int32)
    seg = np.zeros((B, length), np.int32)
    w = np.zeros((B, length), np.float32)
    old = np.zeros((B, length), np.float32)
    for b, r in enumerate(results):
        seq = r.prompt + r.tokens
        n = len(seq) - 1
        if n > length:
            raise ConfigError(f"a prompt plus its reply is {n + 1} tokens; the update holds {length + 1}")
        tokens[b, :n], targets[b, :n], seg[b, :n] = seq[:-1], seq[1:], 1
        p = len(r.prompt) - 1  # targets p.. are the completion
        w[b, p:n] = 1.0
        old[b, p:n] = r.sample_logprobs
    return dict(tokens=tokens, targets=targets, segment_ids=seg, weights=w, old_logp=old), np.asarray(
        advantages, np.float32
    ).reshape(-1)


class GRPOTrainer:
    """GRPO on an nnx model in memory: `step()` samples and scores once, then updates `inner_steps` times; returns
    the step's log record."""

    def __init__(self, model, tokenizer, settings: GRPOSettings, engine_kwargs=None, problem_fn=None):
        """engine_kwargs: Engine arguments over `rollout_engine_kwargs`'s (sized per step to its longest prompt);
        problem_fn(rng) -> (question, answer): the task (default `arithmetic_problem`, operands below 50)."""
        self.s, self.tokenizer = settings, tokenizer
        self.reward = load_reward(settings.reward)
        self.graphdef, self.params, self.rest = nnx.split(model, nnx.Param, ...)
        self.ref_params = self.params if settings.kl_coef > 0 else None
        self.opt = optax.adam(settings.learning_rate)
        self.opt_state = self.opt.init(self.params)
        self.rng = np.random.default_rng([settings.seed, 11])
        self.engine_kwargs = dict(engine_kwargs or {})
        self.problem_fn = problem_fn or arithmetic_problem
        self.step_count = 0
        self.length = model.config.max_seq_len - 1
        self._update = jax.jit(self._update_fn)

    def model(self):
        return nnx.merge(self.graphdef, self.params, self.rest)

    def _update_fn(self, params, opt_state, ref_params, batch, adv):
        s = self.s

        def loss_fn(p):
            m = nnx.merge(self.graphdef, p, self.rest)
            args = (batch["tokens"], batch["targets"], batch["segment_ids"], s.temperature, s.top_k, s.top_p)
            args += (s.batch_invariant,)
            new = token_logprobs(m, *args)
            ref = None
            if ref_params is not None:
                ref = jax.lax.stop_gradient(token_logprobs(nnx.merge(self.graphdef, ref_params, self.rest), *args))
            return grpo_loss(new, batch["old_logp"], adv, batch["weights"], s.clip_eps, ref, s.kl_coef)

        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = self.opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, dict(stats, loss=loss)

    def step(self) -> dict:
        s = self.s
        problems = [self.problem_fn(self.rng) for _ in range(s.prompts_per_step)]
        groups = rollout(self.model(), self.tokenizer, problems, s, self.step_count, self.engine_kwargs)
        rewards = np.asarray(
            [
                [self.reward(self.tokenizer.decode(r.tokens), a) for r in g]
                for g, (_, a) in zip(groups, problems, strict=True)
            ],
            np.float32,
        )
        # The update's length: the longest prompt + reply rounded up to 64 tokens (a few compiled shapes), not
        # max_seq_len: the batch-invariant forward costs per token, and a query's bits do not depend on it.
        longest = max(len(r.prompt) + len(r.tokens) - 1 for g in groups for r in g)
        batch, adv = rollout_batch(groups, group_advantages(rewards), min(self.length, -(-longest // 64) * 64))
        inner = []  # each inner update's stats: the first's ratio is the sampler/trainer parity
        for _ in range(s.inner_steps):
            self.params, self.opt_state, stats = self._update(self.params, self.opt_state, self.ref_params, batch, adv)
            inner.append(stats)
        self.step_count += 1
        lengths = [len(r.tokens) for g in groups for r in g]
        record = {"step": self.step_count, "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std())}
        record.update({k: float(v) for k, v in jax.device_get(inner[0]).items()})
        if s.inner_steps > 1:
            last = jax.device_get(inner[-1])
            record.update(
                {f"last_{k}": float(last[k]) for k in ("ratio_mean", "ratio_min", "ratio_max", "ratio_max_dev")}
            )
        record.update(length_mean=float(np.mean(lengths)), length_max=int(np.max(lengths)))
        return record


def evaluate_reward(model, tokenizer, problems, s: GRPOSettings, reward=arithmetic_reward, seed: int = 100_000):
    """How well `model` does on fixed (question, answer) problems, through the same rollouts GRPO samples (so an
    evaluation between steps compiles nothing new): expected_reward, the mean reward over group_size samples per
    question at the settings' temperature/top-k/top-p (an estimate of the expected reward the policy earns), and
    greedy_accuracy, the share of questions whose greedy reply earns a reward of 1 (`reward` default: exact match
    of the last number). The draws depend on `seed` only, not on the training's seeds."""
    greedy = dataclasses.replace(s, temperature=0.0, top_k=0, top_p=1.0)
    sampled, right = [], []
    for c in range(0, len(problems), s.prompts_per_step):
        chunk = problems[c : c + s.prompts_per_step]
        for settings, out in ((s, sampled), (greedy, right)):
            groups = rollout(model, tokenizer, chunk, settings, seed + c)
            for g, (_, answer) in zip(groups, chunk, strict=True):
                scores = [reward(tokenizer.decode(r.tokens), answer) for r in g]
                out.extend(scores if out is sampled else scores[:1])
    return {"expected_reward": float(np.mean(sampled)), "greedy_accuracy": float(np.mean(right))}
