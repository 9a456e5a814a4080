"""The one mask: what a query may see is a function of positions.

For query i and key j of the same row:

    visible[b, i, j] = key_valid[b, j] & (key_pos[b, j] <= query_pos[b, i]) & same_segment[b, i, j]
                       (& query_pos[b, i] - key_pos[b, j] < window, for a sliding-window layer)

Training (positions 0..T-1), one-shot and chunked prefill (a chunk at offset o sees keys 0..o+i: the
`tril(diagonal=o)` case falls out of the positions), one-token decode, ragged batches, packed documents and
ring-buffer caches (whose slots hold positions out of order) all use this one function; there is no separate mask
per mode. Positions, not array order, decide: repeated or decreasing positions are accepted and mean what the
formula says (`Decoder.validate(..., require_increasing_positions=True)` checks them for callers who want that).

`AttentionMask` carries the dense [B, T, S] mask plus the static facts a fast kernel may rely on, so a kernel
derives what it may skip from the mask rather than from a promise of its caller.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


def make_mask(query_pos, key_pos, key_valid, query_segment=None, key_segment=None, *, causal: bool = True, window=None):
    """Boolean visibility [B, T, S] from positions [B, T] / [B, S], key validity [B, S] and optional segments.

    window: a sliding window (int, or a traced int32 scalar when layers differ); a query at position p then sees
    keys at p - window + 1 .. p. None or 0 means no window (a global layer).
    """
    visible = key_valid[:, None, :]  # [B, 1, S]
    if causal:
        visible = visible & (key_pos[:, None, :] <= query_pos[:, :, None])  # [B, T, S]
    if window is not None and not (isinstance(window, int) and window == 0):
        within = (query_pos[:, :, None] - key_pos[:, None, :]) < window  # [B, T, S]
        visible = visible & (within | (window <= 0))
    if query_segment is not None and key_segment is not None:
        visible = visible & (key_segment[:, None, :] == query_segment[:, :, None])
    return jnp.broadcast_to(visible, (query_pos.shape[0], query_pos.shape[1], key_pos.shape[1]))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMask:
    """What each query may see, for the attention kernels.

    visible:     [B, T, S] bool, from `make_mask`: which keys each query's softmax normalises over.
    zero_after:  optional [B, T, S] multiplied into the weights after the softmax (the research variant
                 `attention_mask="causal_after_softmax"`: shows why zeroing after the softmax is not a mask).
    index_causal (static): the keys are the queries' own tokens in the same order and no key after a query's
                 index is visible to it. True only where the positions guarantee it (see `index_causal`); a
                 blocked kernel may then skip the keys above the diagonal.
    windows (static): set only by the decoder for its own self-attention mask over positions it made (0..T-1,
                 restarting at each contiguous segment): then `visible` is exactly "causal by index, within the
                 sliding window by index, same segment, not padding", the structure a fused kernel (backends.py)
                 takes instead of the dense array. The mask's sliding window (0 = none); several when the layers
                 of a scan differ, `window_index` (traced) then says which. Empty: no such structure.
    segment_ids: [B, T] the queries' (= keys') segment ids, 0 = padding, with `windows`; None: one segment.
    """

    visible: jax.Array
    zero_after: jax.Array | None = None
    index_causal: bool = dataclasses.field(default=False, metadata=dict(static=True))
    windows: tuple = dataclasses.field(default=(), metadata=dict(static=True))
    segment_ids: jax.Array | None = None
    window_index: jax.Array | None = None


def segment_positions(segment_ids):
    """Positions that restart at 0 at every segment boundary: [B, T]."""
    T = segment_ids.shape[1]
    idx = jnp.arange(T, dtype=jnp.int32)[None, :]
    boundary = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )
    seg_start = jax.lax.cummax(jnp.where(boundary, idx, 0), axis=1)
    return idx - seg_start


def increasing_within_segments(positions, segment_ids=None) -> bool:
    """Host check: in every row, the positions of each segment's tokens strictly increase with their index.

    Then under the causal mask a key after a query's index is never visible to it: a later key of the same segment
    has a larger position, a key of another segment is masked anyway."""
    p = np.asarray(positions)
    seg = np.zeros_like(p) if segment_ids is None else np.asarray(segment_ids)
    for row_p, row_s in zip(p, seg, strict=True):
        for s in np.unique(row_s):
            if np.any(np.diff(row_p[row_s == s]) <= 0):
                return False
    return True
