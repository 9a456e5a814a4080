"""DPO: preference tuning on {prompt, chosen, rejected} records against a frozen reference (the starting weights).

    loss = -mean(log sigmoid(beta * ((log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected)))))

where log pi(y) sums the response's token log-probabilities (the prompt is context, masked out exactly as SFT
masks non-assistant tokens: the pair is rendered as a user turn and an assistant reply with
`causal_lm.train.post.encode_conversation`). At the reference weights every margin is 0 and the loss is ln 2.
Reported: the implicit rewards beta * (log pi - log ref) of chosen and rejected, their margin, and the accuracy
(the share of pairs whose chosen reward is higher).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from causal_lm.config import ConfigError
from causal_lm.data.corpus import DataError
from causal_lm.train.post import encode_conversation, read_jsonl


def read_preferences(spec: str) -> list[dict]:
    """The {prompt, chosen, rejected} records of JSONL files (DataError naming file and line)."""
    recs = read_jsonl(spec, ("prompt", "chosen", "rejected"))
    for r in recs:
        for k in ("prompt", "chosen", "rejected"):
            if not isinstance(r[k], str):
                raise DataError(f"{r['_where']}: {k!r} must be text, got {type(r[k]).__name__}")
    return recs


def encode_pairs(tokenizer, records, length: int) -> dict:
    """Padded arrays [2N, length] (chosen rows first, then rejected): tokens, targets, segment_ids, weights (1 on
    the response's targets)."""
    rows = []
    for which in ("chosen", "rejected"):
        for r in records:
            msgs = [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r[which]}]
            rows.append(encode_conversation(tokenizer, msgs))
    n = len(rows)
    out = {k: np.zeros((n, length), np.int32) for k in ("tokens", "targets", "segment_ids")}
    out["weights"] = np.zeros((n, length), np.float32)
    for b, (ids, mask) in enumerate(rows):
        if len(ids) - 1 > length:
            raise ConfigError(f"a preference pair renders to {len(ids)} tokens; train.seq_len={length} holds fewer")
        m = len(ids) - 1
        out["tokens"][b, :m], out["targets"][b, :m], out["segment_ids"][b, :m] = ids[:-1], ids[1:], 1
        out["weights"][b, :m] = mask[1:]
    return out


def sequence_logps(model, batch):
    """[B] the sum of each row's weighted target log-probabilities (float32 logits)."""
    logits, _ = model(batch["tokens"], segment_ids=batch["segment_ids"])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    tok = jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    return (tok * batch["weights"]).sum(axis=-1)


def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta: float):
    """(loss, stats) from per-pair sequence log-probabilities [N] each."""
    chosen = beta * (policy_chosen - ref_chosen)
    rejected = beta * (policy_rejected - ref_rejected)
    margin = chosen - rejected
    loss = -jnp.mean(jax.nn.log_sigmoid(margin))
    stats = {
        "reward_chosen": jnp.mean(chosen),
        "reward_rejected": jnp.mean(rejected),
        "reward_margin": jnp.mean(margin),
        "reward_accuracy": jnp.mean((margin > 0).astype(jnp.float32)),
    }
    return loss, stats


class DPOTrainer:
    """DPO on an nnx model in memory; the reference is a frozen copy of the starting parameters."""

    def __init__(self, model, beta: float = 0.1, learning_rate: float = 1e-3):
        if not beta > 0:
            raise ConfigError(f"train.beta must be > 0, got {beta}")
        self.beta = beta
        self.graphdef, self.params, self.rest = nnx.split(model, nnx.Param, ...)
        self.ref_params = self.params
        self.opt = optax.adam(learning_rate)
        self.opt_state = self.opt.init(self.params)
        self._update = jax.jit(self._update_fn)

    def _update_fn(self, params, opt_state, batch):
        n = batch["tokens"].shape[0] // 2
        ref = sequence_logps(nnx.merge(self.graphdef, self.ref_params, self.rest), batch)

        def loss_fn(p):
            logps = sequence_logps(nnx.merge(self.graphdef, p, self.rest), batch)
            return dpo_loss(logps[:n], logps[n:], ref[:n], ref[n:], self.beta)

        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = self.opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, dict(stats, loss=loss)

    def step(self, batch) -> dict:
        self.params, self.opt_state, stats = self._update(self.params, self.opt_state, batch)
        return {k: float(v) for k, v in jax.device_get(stats).items()}
