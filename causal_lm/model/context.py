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

    ropes:          the distinct RoPE tables of this call, each (cos, sin) [B, T, rope_dim] float32 at the query
                    positions, or None for NoPE layers; empty without RoPE.
    rope_of_layer:  which of `ropes` each layer uses (layers differ in theta or scaling, or skip RoPE).
    masks:          the distinct masks of this call: one per sliding window without a cache, one per cache group
                    (slot layout) with one.
    mask_of_layer:  which of `masks` each layer uses.
    plan:           where the new tokens go in the cache (None without a cache).
    return_weights: whether layers return their attention weights (the reference kernel then runs).
    invariant:      the batch-invariant scoring mode: attention by `kernels.invariant_attention`, whose result for
                    a query does not depend on the call's shapes (see `Decoder.forward(batch_invariant=...)`).
    """

    masks: tuple
    mask_of_layer: tuple
    plan: CacheWrite | None = None
    return_weights: bool = False
    invariant: bool = False
    ropes: tuple = ()
    rope_of_layer: tuple = ()

    def rope_for(self, layer):
        """(cos, sin) of a layer, or (None, None) for a layer without RoPE; `layer` may be traced (the decoder's
        scan). A traced index selects among stacked tables, where a NoPE layer's are the identity rotation
        (cos 1, sin 0: rotating by them returns q and k exactly); a static one skips the rotation."""
        if not self.ropes:
            return None, None
        if len(self.ropes) == 1 or not isinstance(layer, jax.core.Tracer):
            t = self.ropes[0 if len(self.ropes) == 1 else self.rope_of_layer[layer]]
            return (None, None) if t is None else t
        like = next(t for t in self.ropes if t is not None)[0]
        tables = [(jnp.ones_like(like), jnp.zeros_like(like)) if t is None else t for t in self.ropes]
        which = jnp.asarray(self.rope_of_layer, jnp.int32)[layer]
        return jnp.stack([t[0] for t in tables])[which], jnp.stack([t[1] for t in tables])[which]

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
        structured = all(len(m.windows) == 1 for m in self.masks)
        return AttentionMask(
            visible,
            zero_after,
            index_causal=all(m.index_causal for m in self.masks),
            windows=tuple(m.windows[0] for m in self.masks) if structured else (),
            segment_ids=self.masks[0].segment_ids if structured else None,
            window_index=which if structured else None,
        )
