"""Next-token sampling: greedy, temperature, top-k and top-p, all from an explicit PRNG key.

The same functions serve the cached, the recompute and the speculative loops, so they differ only in what they
compute, never in how a token is chosen. `filtered_logits` is the distribution every sampler draws from (the
speculative acceptance test compares exactly these distributions for the target and the draft). `SamplingParams`
holds per-row settings as one frozen pytree (the serving engine's rows each carry their own).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


def filtered_logits(logits, temperature, top_k, top_p):
    """logits [..., V] -> the logits sampling draws from: divided by the temperature, -inf outside top-k and top-p.

    top_k <= 0 disables top-k; top_p >= 1 disables top-p. Top-k keeps ties with the k-th largest value; top-p keeps
    the smallest set of most likely tokens whose probability reaches top_p, including the token that crosses the
    threshold. All three are traced scalars, so changing them does not recompile; with both filters off the sort
    they need is skipped at run time (`lax.cond`), not computed and discarded.
    """
    scaled = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
    return jax.lax.cond((top_k > 0) | (top_p < 1.0), _top_k_top_p, lambda x, k, p: x, scaled, top_k, top_p)


def _top_k_top_p(scaled, top_k, top_p):
    """-inf outside the top-k and the top-p set of scaled logits [..., V] (a sort over the vocabulary)."""
    V = scaled.shape[-1]
    desc = -jnp.sort(-scaled, axis=-1)  # [..., V], largest first
    k = jnp.clip(top_k, 1, V)
    kth = jnp.take_along_axis(desc, jnp.broadcast_to(k - 1, desc.shape[:-1])[..., None], axis=-1)
    scaled = jnp.where((top_k > 0) & (scaled < kth), -jnp.inf, scaled)
    desc = jnp.where((top_k > 0) & (desc < kth), -jnp.inf, desc)
    # top-p: keep a sorted token if the mass strictly before it is below top_p (so the crossing token stays).
    probs = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep = (before < top_p) | (jnp.arange(V) == 0)
    cutoff = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where((top_p < 1.0) & (scaled < cutoff), -jnp.inf, scaled)


def argmax_tokens(logits):
    """logits [..., V] -> int32 [...]: the first index of each row's largest logit, what `jnp.argmax` returns (a
    NaN counts as the largest; a row of -inf gives 0). Written as two plain reductions, the max and then the least
    index holding it, because XLA:CPU runs argmax's paired (value, index) reduction unvectorized: over 49,152
    logits 178 against 59 us a row (Intel VM), a step of the 135M model's greedy decode."""
    largest = jnp.max(logits, axis=-1, keepdims=True)  # NaN when a row holds one
    hit = (logits == largest) | jnp.isnan(logits)  # with no NaN in the row, isnan adds nothing
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.min(jnp.where(hit, index, logits.shape[-1]), axis=-1)


def probabilities(logits, temperature, top_k, top_p):
    """The distribution `sample` draws from, as probabilities [..., V]: one-hot on the argmax when greedy."""

    def greedy(logits):
        return jax.nn.one_hot(argmax_tokens(logits), logits.shape[-1], dtype=jnp.float32)

    def filtered(logits):
        return jax.nn.softmax(filtered_logits(logits, temperature, top_k, top_p), -1)

    return jax.lax.cond(temperature > 0, filtered, greedy, logits)


def sampled_logprobs(logits, tokens, temperature, top_k, top_p, invariant=False):
    """logits [..., V], tokens [...] -> float32 [...]: each token's log-probability under the distribution `sample`
    draws from: log_softmax of `filtered_logits` (temperature-scaled, -inf outside top-k/top-p) when temperature > 0.
    Greedy decoding (temperature 0) draws from no distribution; its entry is the model's own (log_softmax of the
    float32 logits), the policy a greedy reply is scored under. The serving engine reports this as a token's
    `sample_logprob` and a trainer recomputes it from its own logits with this same function (GRPO's ratio).
    invariant: one row at a time (`lax.map`), so a row's result does not depend on how many rows the call has
    (XLA:CPU rounds a softmax over [1, V] and over [R, V] rows differently): the batch-invariant scoring mode."""
    logits = logits.astype(jnp.float32)
    shape = logits.shape[:-1]
    temperature = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), shape).reshape(-1)
    top_k = jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), shape).reshape(-1)
    top_p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), shape).reshape(-1)
    flat = logits.reshape(-1, logits.shape[-1])

    def one(x, t, k, p):
        filtered = jax.lax.cond(t > 0, lambda x: filtered_logits(x, t, k, p), lambda x: x, x)
        return jax.nn.log_softmax(filtered, axis=-1)

    if invariant:
        ids = jnp.asarray(tokens, jnp.int32).reshape(-1)

        def row(args):
            x, t, k, p, i = jax.lax.optimization_barrier(args)
            return jax.lax.optimization_barrier(one(x, t, k, p)[i])

        return jax.lax.map(row, (flat, temperature, top_k, top_p, ids)).reshape(shape)
    logp = jax.vmap(one)(flat, temperature, top_k, top_p).reshape(logits.shape)
    return jnp.take_along_axis(logp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]


def sample(logits, key, temperature, top_k, top_p):
    """logits [B, V] float32 -> token ids [B] int32. temperature == 0 is greedy (argmax).

    One branch runs (`lax.cond` on the traced temperature): greedy decoding pays for an argmax only, not for the
    filters' sort over the vocabulary and the random draw (a sort of 49,152 logits took a quarter of a 135M model's
    decode step on a CPU when both branches ran)."""

    def greedy(logits, key):
        return argmax_tokens(logits)

    def sampled(logits, key):
        filtered = filtered_logits(logits, temperature, top_k, top_p)
        return jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)

    return jax.lax.cond(temperature > 0, sampled, greedy, logits, key)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-row sampling settings as data (a frozen pytree: traced, so new values never recompile).

    temperature [B] float32 (0: greedy), top_k [B] int32 (0: off), top_p [B] float32 (1: off), seed [B] uint32 and
    stop [B, S] int32 (stop token ids, padded with -1). Row b's n-th token is drawn with the key
    fold_in(key(seed[b]), n): what a row draws depends on its own seed and its own token count only, never on which
    rows share its batch or where it sits in it.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    stop: jax.Array

    @staticmethod
    def make(temperature, top_k, top_p, seed, stop, stop_width: int = 8) -> SamplingParams:
        """Host arrays from per-row lists (top_k None -> 0, top_p None -> 1, stop: a list of id lists)."""
        B = len(temperature)
        width = max([stop_width] + [len(s) for s in stop])
        stops = np.full((B, width), -1, np.int32)
        for b, s in enumerate(stop):
            stops[b, : len(s)] = list(s)
        return SamplingParams(
            temperature=np.asarray(temperature, np.float32),
            top_k=np.asarray([k or 0 for k in top_k], np.int32),
            top_p=np.asarray([1.0 if p is None else p for p in top_p], np.float32),
            seed=np.asarray(seed, np.uint32),
            stop=stops,
        )

    def sample(self, logits, index):
        """logits [B, V] float32, index [B] (each row's count of tokens drawn so far) -> token ids [B] int32."""

        def one(logits, seed, n, temperature, top_k, top_p):
            key = jax.random.fold_in(jax.random.key(seed), n)
            return sample(logits[None], key, temperature, top_k, top_p)[0]

        def drawn(logits):
            return jax.vmap(one)(logits, self.seed, index, self.temperature, self.top_k, self.top_p)

        # Under vmap each row's lax.cond runs both branches (a select): every greedy row would pay the filters' sort
        # over the vocabulary and the draw (measured: 16 greedy rows x 49,152 logits, 650 ms on a 2-core CPU). A
        # batch of greedy rows takes the argmax alone; a batch with a sampled row runs the per-row draw, whose
        # greedy rows give the same argmax.
        return jax.lax.cond(jnp.any(self.temperature > 0), drawn, argmax_tokens, logits)

    def logprob(self, logits, tokens, invariant=False):
        """logits [B, V], tokens [B] -> [B] float32: each row's token under the distribution it was drawn from
        (`sampled_logprobs` with the row's own settings; invariant: one row at a time, see there)."""
        if invariant:  # lax.map over rows: each row's cond runs one branch already
            return sampled_logprobs(logits, tokens, self.temperature, self.top_k, self.top_p, invariant)

        def model_own(logits):  # what sampled_logprobs gives a greedy row
            logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
            return jnp.take_along_axis(logp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]

        def filtered(logits):
            return sampled_logprobs(logits, tokens, self.temperature, self.top_k, self.top_p)

        return jax.lax.cond(jnp.any(self.temperature > 0), filtered, model_own, logits)  # see `sample`

    def stopped(self, tokens):
        """tokens [B] -> [B] bool: the token is one of its row's stop ids."""
        return jnp.any(tokens[:, None] == self.stop, axis=1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BatchSampling:
    """`generate`'s sampling settings as one frozen pytree (traced: new values never recompile): the batch's PRNG
    key, temperature (0: greedy), top_k (0: off), top_p (1: off) and stop ids [S] (padded with -2). Step n of the
    plain loop draws every row with fold_in(key, n) (the seed policy `generate` has always had); the speculative
    loop derives its own keys from `key` and passes them to `draw`."""

    key: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    stop: jax.Array

    @staticmethod
    def make(seed: int, temperature: float, top_k: int | None, top_p: float | None, stop_tokens) -> BatchSampling:
        """Host values (the key is made by the caller's placement: see `generate`); stop padded to 8 ids at least."""
        stop = np.full((max(8, len(stop_tokens)),), -2, np.int32)
        stop[: len(stop_tokens)] = list(stop_tokens)
        return BatchSampling(
            key=np.uint32(seed),
            temperature=np.float32(temperature),
            top_k=np.int32(top_k or 0),
            top_p=np.float32(1.0 if top_p is None else top_p),
            stop=stop,
        )

    def draw(self, logits, key):
        """logits [B, V] -> token ids [B] drawn with `key` (greedy when temperature is 0)."""
        return sample(logits, key, self.temperature, self.top_k, self.top_p)

    def at_step(self, logits, step):
        """The plain loop's draw for its `step`-th token: key fold_in(key, step)."""
        return self.draw(logits, jax.random.fold_in(self.key, step))

    def probabilities(self, logits):
        """The distribution `draw` samples from, [..., V] (speculative acceptance compares these)."""
        return probabilities(logits, self.temperature, self.top_k, self.top_p)

    def stopped(self, tokens):
        """tokens [...] -> bool [...]: the token is a stop id."""
        return jnp.isin(tokens, self.stop)
