"""The KV cache as explicit data: K and V at the KV-head count (MLA: latent + rope key), plus one length per row.

Why a cache is exact: under the causal mask, token j's K and V depend only on tokens 0..j, so tokens that
arrive later never change them. Each step therefore computes K/V for the new tokens only and reads the old ones.

Layout: right padding. Row b holds its tokens in slots 0..lengths[b]-1, slot index == position. A call writes
its chunk at slot lengths[b] of each row (one `lax.dynamic_update_slice` per row, vmapped), and the mask makes
slots >= the new length invisible. `dynamic_update_slice` clamps an out-of-range start silently, so capacity is
checked on the host (`check_capacity`) before anything runs.

Two cache classes share that layout and API (`lengths`, `max_len`, `batch_size`, `bytes_per_token`, `total_bytes`,
and `buffers` / `with_buffers`, the per-layer arrays the decoder scans over):
    KVCache   k, v [L, B, S, K, H]           MHA / GQA / MQA
    MLACache  latent [L, B, S, kv_lora_rank], rope_key [L, B, S, qk_rope_head_dim]   MLA
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from causal_lm.config import ModelConfig


class CacheError(ValueError):
    """The cache cannot take what was asked of it (capacity, non-causal model, ...)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: jax.Array  # [L, B, S, K, H]
    v: jax.Array  # [L, B, S, K, H]
    lengths: jax.Array  # [B] int32: tokens already cached in each row

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token of one row occupies, K and V of all layers together."""
        L, _, _, K, H = self.k.shape
        return 2 * L * K * H * self.k.dtype.itemsize

    @property
    def total_bytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes + self.lengths.nbytes)

    @property
    def buffers(self) -> tuple:
        """The per-layer arrays, each [L, B, S, ...]."""
        return (self.k, self.v)

    def with_buffers(self, buffers, lengths) -> KVCache:
        return KVCache(k=buffers[0], v=buffers[1], lengths=lengths)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MLACache:
    """MLA's cache: per token and layer only the (normalised) KV latent and the one RoPE key all heads share."""

    latent: jax.Array  # [L, B, S, R]
    rope_key: jax.Array  # [L, B, S, Hr] (already rotated; Hr = 0 without RoPE)
    lengths: jax.Array  # [B] int32

    @property
    def max_len(self) -> int:
        return self.latent.shape[2]

    @property
    def batch_size(self) -> int:
        return self.latent.shape[1]

    @property
    def bytes_per_token(self) -> int:
        L, _, _, R = self.latent.shape
        return L * (R * self.latent.dtype.itemsize + self.rope_key.shape[-1] * self.rope_key.dtype.itemsize)

    @property
    def total_bytes(self) -> int:
        return int(self.latent.nbytes + self.rope_key.nbytes + self.lengths.nbytes)

    @property
    def buffers(self) -> tuple:
        return (self.latent, self.rope_key)

    def with_buffers(self, buffers, lengths) -> MLACache:
        return MLACache(latent=buffers[0], rope_key=buffers[1], lengths=lengths)


def require_causal(config: ModelConfig) -> None:
    if config.attention_mask != "causal":
        raise CacheError(
            f"a KV cache needs attention_mask='causal' (this model uses {config.attention_mask!r}): without the "
            "causal mask an old token's K/V would change when new tokens arrive, so cached values would be "
            "wrong. Use generate(..., use_cache=False) (or `causal-lm generate --no-cache`) for this model."
        )


def init_cache(config: ModelConfig, batch_size: int, max_len: int, dtype: str | None = None):
    """An empty cache for `batch_size` rows of up to `max_len` tokens, stored at the KV-head count
    (a KVCache), or for MLA the latent and rope key (an MLACache). Sliding-window layers keep full length."""
    require_causal(config)
    if batch_size <= 0 or max_len <= 0:
        raise CacheError(f"batch_size and max_len must be positive, got {batch_size} and {max_len}")
    dt = jnp.dtype(dtype or config.dtype)
    if config.attention_type == "mla":
        L = config.num_layers
        return MLACache(
            latent=jnp.zeros((L, batch_size, max_len, config.kv_lora_rank), dt),
            rope_key=jnp.zeros((L, batch_size, max_len, config.rope_dim), dt),
            lengths=jnp.zeros((batch_size,), jnp.int32),
        )
    shape = (config.num_layers, batch_size, max_len, config.kv_heads, config.head_size)
    return KVCache(k=jnp.zeros(shape, dt), v=jnp.zeros(shape, dt), lengths=jnp.zeros((batch_size,), jnp.int32))


def write_rows(buf, new, starts):
    """Write new [B, T, ...] into buf [B, S, ...] at per-row slot offsets starts [B]."""
    new = new.astype(buf.dtype)

    def one(b, n, s):
        return jax.lax.dynamic_update_slice_in_dim(b, n, s, axis=0)

    return jax.vmap(one)(buf, new, starts)


def write_layer_rows(buf, layer, new, starts):
    """Write new [B, T, ...] into layer `layer` of buf [L, B, S, ...] at per-row slot offsets starts [B].

    One scatter into the whole buffer, batched over its B axis where it lies (a vmapped update would move that
    axis to the front and transpose the whole cache), which XLA does in place when the buffer is donated or a
    loop carry. Slicing the layer out, writing into the slice and writing the slice back (`write_rows` on
    `buf[layer]`) copies the layer's whole K/V twice per call: a quarter of a batch-1 decode step.
    Out-of-range slots are dropped (callers check capacity on the host first, see `check_capacity`).
    """
    new = new.astype(buf.dtype)
    B, T = new.shape[:2]
    slots = starts[:, None].astype(jnp.int32) + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
    index = jnp.stack([jnp.broadcast_to(jnp.asarray(layer, jnp.int32), (B, T)), slots], axis=-1)  # [B, T, 2]
    rest = tuple(range(2, new.ndim))  # the per-slot entry's own axes, e.g. (K, H)
    dims = jax.lax.ScatterDimensionNumbers(
        update_window_dims=rest,
        inserted_window_dims=(0, 2),
        scatter_dims_to_operand_dims=(0, 2),
        operand_batching_dims=(1,),
        scatter_indices_batching_dims=(0,),
    )
    return jax.lax.scatter(
        buf, index, new, dims, indices_are_sorted=True, unique_indices=True, mode=jax.lax.GatherScatterMode.FILL_OR_DROP
    )


def check_capacity(cache, num_new: int) -> None:
    """Raise before compute if writing `num_new` slots at each row's length would run past the end."""
    lengths = np.asarray(jax.device_get(cache.lengths))
    worst = int(lengths.max()) + num_new if lengths.size else num_new
    if worst > cache.max_len:
        row = int(lengths.argmax())
        raise CacheError(
            f"KV cache overflow: row {row} holds {int(lengths[row])} tokens and {num_new} more do not fit in "
            f"max_len={cache.max_len} (JAX would clamp the write and silently overwrite the last slots)"
        )
