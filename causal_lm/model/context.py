"""What every attention layer of one forward call receives: RoPE tables, masks and the cache write plan."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from causal_lm.model.kv_cache import CacheWrite
from causal_lm.model.mask import AttentionMask


@dataclasses.dataclass(frozen=True)
class AttentionContext:
    """The per-call inputs shared by the layers (built once by the decoder, read by each block).

    cos, sin:       [B, T, rope_dim] float32 RoPE tables at the query positions, or None without RoPE.
    masks:          the distinct masks of this call: one per sliding window without a cache, one per cache group
                    (slot layout) with one.
    mask_of_layer:  which of `masks` each layer uses.
    plan:           where the new tokens go in the cache (None without a cache).
    return_weights: whether layers return their attention weights (the reference kernel then runs).
    """

    cos: jax.Array | None
    sin: jax.Array | None
    masks: tuple
    mask_of_layer: tuple
    plan: CacheWrite | None = None
    return_weights: bool = False

    def mask_for(self, layer) -> AttentionMask:
        """The mask of a layer; `layer` may be a traced index (the decoder's scan over stacked layers)."""
        if len(self.masks) == 1:
            return self.masks[0]
        if not isinstance(layer, jax.core.Tracer):
            return self.masks[self.mask_of_layer[layer]]
        which = jnp.asarray(self.mask_of_layer, jnp.int32)[layer]
        visible = jnp.stack([m.visible for m in self.masks])[which]
        zero_after = None
        if self.masks[0].zero_after is not None:
            zero_after = jnp.stack([m.zero_after for m in self.masks])[which]
        return AttentionMask(visible, zero_after, index_causal=all(m.index_causal for m in self.masks))
