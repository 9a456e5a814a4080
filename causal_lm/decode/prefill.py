"""What the generation programs share: prefilling a cache (whole or in chunks), the mesh constraint on the cache,
and the count of traced programs."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from causal_lm import parallel

_traces = 0  # generation programs traced in this process; see compile_count()


def count_trace() -> None:
    """Called inside each generation program's trace, i.e. once per compiled program."""
    global _traces
    _traces += 1


def compile_count() -> int:
    """Number of generation programs compiled so far in this process (a new prompt bucket, batch size,
    max_new_tokens or model shape compiles a new one; a new prompt length within a bucket does not)."""
    return _traces


def shard_cache(cache, mesh):
    """Keep the cache in the partition rules' layout through prefill and the decode loop (no-op on one device)."""
    if mesh is None:
        return cache
    return jax.lax.with_sharding_constraint(cache, parallel.cache_shardings(cache, mesh))


def last_valid_logits(logits, idx):
    """logits [B, T, V], idx [B] -> [B, V] at idx (clipped)."""
    i = jnp.clip(idx, 0, logits.shape[1] - 1)
    return jnp.take_along_axis(logits, i[:, None, None], axis=1)[:, 0]


def prefill(model, tokens, lengths, chunk: int, cache, mesh=None):
    """Write right-padded prompts tokens [B, P] (row b's first lengths[b] are real) into `cache` in chunks of
    `chunk` tokens (P a multiple of it). Returns (cache, logits [B, V] at each row's last prompt token)."""
    B, P = tokens.shape

    def one_chunk(carry, i):
        cache, last = carry
        piece = jax.lax.dynamic_slice_in_dim(tokens, i * chunk, chunk, axis=1)  # [B, C]
        n_valid = jnp.clip(lengths - i * chunk, 0, chunk)
        seg = (jnp.arange(chunk)[None, :] < n_valid[:, None]).astype(jnp.int32)
        logits, cache = model(piece, segment_ids=seg, cache=cache)
        cache = shard_cache(cache, mesh)
        idx = lengths - 1 - i * chunk
        in_chunk = (idx >= 0) & (idx < chunk)
        last = jnp.where(in_chunk[:, None], last_valid_logits(logits, idx), last)
        return (cache, last), None

    last0 = jnp.zeros((B, model.config.vocab_size), jnp.float32)
    (cache, last), _ = jax.lax.scan(one_chunk, (cache, last0), jnp.arange(P // chunk))
    return cache, last
