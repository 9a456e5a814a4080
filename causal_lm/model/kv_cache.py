"""The KV cache as explicit data whose slots carry their positions.

Why a cache is exact: under the causal mask, token j's K and V depend only on tokens 0..j, so tokens that arrive
later never change them. Each call computes K/V for its new tokens only and reads the old ones.

Layout. The layers that share a slot layout form a `CacheGroup`:

    arrays     name -> [Lg, B, C, ...] per layer of the group: "k", "v" [.., K, H] for MHA / GQA / MQA (at the
               KV-head count), "latent" [.., R] and "rope_key" [.., Hr] for MLA; a scaled storage type (int8,
               float8) adds "<name>_scale" [Lg, B, C, (K)] float32, one scale per token and KV head.
    positions  [B, C] int32: the position of the token each slot holds, -1 for an empty slot.
    window     0 for global layers: C = max_len slots, a token at position p sits in slot p. W > 0 for local
               (sliding-window) layers: a ring of C = min(W + lookahead, max_len) slots written at p mod C.

plus `lengths` [B], the tokens cached per row (the next position). Attention builds its mask from the query
positions and the slots' positions through the one mask function (mask.py), so nothing outside this module does
slot arithmetic: a ring buffer, a rollback or another layout changes this file and nothing in attention.

A call goes through three steps, the first and last once per call, the middle once per layer:

    plan = cache.plan_write(valid)          where each new token goes, the positions after the write
    cache, keys = cache.update(layer, new, plan)   write the layer's new K/V (quantized if the storage is), and
                                            return what the layer attends over, with plan.key_positions(group)
    cache = cache.commit(plan)              store the new positions and lengths

Ring buffers: a local layer keeps its window plus `lookahead` slots, the most tokens one call may write and later
undo (speculative decoding's drafts): a ring of exactly W slots cannot be rolled back, because the drafts
overwrote entries still inside the window. A call that writes more tokens than `lookahead + 1` (a long prefill
chunk) would overwrite keys its own first queries still need: it attends over the slots as they were plus the
chunk itself, then writes what the ring keeps (its last C tokens).

`jax.lax` clamps an out-of-range write index silently, so capacity is checked on the host (`check_capacity`)
before anything runs; dropped entries (padding, a long chunk's early tokens in a ring) are written at indices
past the end, which the scatter drops (FILL_OR_DROP).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from causal_lm.config import ModelConfig
from causal_lm.model import decode_attention, kernels


class CacheError(ValueError):
    """The cache cannot take what was asked of it (capacity, non-causal model, ...)."""


# Storage types and the largest magnitude a scaled one represents (None: stored as is, no scale).
CACHE_DTYPES = {"float32": None, "bfloat16": None, "float16": None, "int8": 127.0, "float8_e4m3fn": 448.0}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheGroup:
    """The cached arrays of the layers that share one slot layout (see the module docstring)."""

    arrays: dict  # name -> [Lg, B, C, ...]
    positions: jax.Array  # [B, C] int32, -1 = empty
    window: int = dataclasses.field(metadata=dict(static=True))  # 0 = global
    layers: tuple = dataclasses.field(metadata=dict(static=True))  # the model layers stored here, in order

    @property
    def capacity(self) -> int:
        return self.positions.shape[1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheWrite:
    """Where one call's tokens go, computed once for all layers (`KVCache.plan_write`)."""

    query_positions: jax.Array  # [B, T] int32: the new tokens' positions (each row's length + 0..T-1)
    valid: jax.Array  # [B, T] bool: real tokens (right padding is neither written nor counted)
    slots: tuple  # per group [B, T] int32: the slot each token is written to (>= capacity: dropped)
    new_positions: tuple  # per group [B, C] int32: the slots' positions after the write
    new_lengths: jax.Array  # [B] int32
    read_old: tuple = dataclasses.field(metadata=dict(static=True))  # per group: attend over old slots + chunk


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """K/V (or MLA's latent + rope key) of every layer, grouped by slot layout, with the slots' positions."""

    groups: tuple  # of CacheGroup
    lengths: jax.Array  # [B] int32: tokens already cached in each row
    max_len: int = dataclasses.field(metadata=dict(static=True))  # the most tokens a row may hold (global layers)
    names: tuple = dataclasses.field(metadata=dict(static=True))  # ("k", "v") or ("latent", "rope_key")
    storage: str = dataclasses.field(metadata=dict(static=True))  # one of CACHE_DTYPES

    # ---- sizes -------------------------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def bounded(self) -> bool:
        """Whether rows are limited to max_len tokens: true when a group has max_len slots (global layers, or a
        ring as long as max_len). A cache whose groups are all shorter rings wraps for as long as the model's
        positions go."""
        return any(g.capacity >= self.max_len for g in self.groups)

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    @property
    def total_bytes(self) -> int:
        """Bytes of every array the cache holds: buffers, scales, slot positions and lengths."""
        return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(self)))

    @property
    def bytes_per_token(self) -> int:
        """Bytes one cached token of one row occupies in a full-length slot, all layers (scales included)."""
        total = 0
        for g in self.groups:
            for a in g.arrays.values():
                total += a.shape[0] * int(np.prod(a.shape[3:])) * a.dtype.itemsize
        return total

    # ---- layers ------------------------------------------------------------------------------------------------
    def locate(self, layer):
        """(group index, index within the group) of a model layer. `layer` may be traced only when every layer
        is in one group (the decoder's scan over a single-layout cache)."""
        if len(self.groups) == 1:
            return 0, layer
        if isinstance(layer, jax.core.Tracer):
            raise ValueError("a cache with several layouts needs static layer indices (the decoder unrolls them)")
        for g, group in enumerate(self.groups):
            if layer in group.layers:
                return g, group.layers.index(layer)
        raise ValueError(f"layer {layer} is not in this cache ({self.num_layers} layers)")

    # ---- one call ----------------------------------------------------------------------------------------------
    def plan_write(self, valid) -> CacheWrite:
        """Where the new tokens [B, T] (valid: real, right-padded) go in every group."""
        B, T = valid.shape
        valid = valid.astype(bool)
        t = jnp.arange(T, dtype=jnp.int32)
        pos = self.lengths[:, None] + t[None, :]  # [B, T]
        n_valid = jnp.sum(valid, axis=1, dtype=jnp.int32)
        last = self.lengths + n_valid - 1  # [B]: the last written position
        slots, new_positions, read_old = [], [], []
        for g in self.groups:
            C = g.capacity
            if g.window:
                # A ring keeps the last C tokens written; earlier tokens of a long chunk are not written at all.
                keep = valid & (pos > last[:, None] - C)
                slot = jnp.where(keep, pos % C, C + t[None, :])
                # A call writing more than C - W + 1 tokens would overwrite keys its first queries still need (a
                # ring of max_len slots never wraps: its rows are bounded at max_len).
                read_old.append(C < self.max_len and T > C - g.window + 1)
            else:
                keep = valid
                slot = jnp.where(keep, pos, C + t[None, :])
                read_old.append(False)
            slots.append(slot)
            new_positions.append(_scatter_rows(g.positions, slot, pos))
        return CacheWrite(
            query_positions=pos,
            valid=valid,
            slots=tuple(slots),
            new_positions=tuple(new_positions),
            new_lengths=self.lengths + n_valid,
            read_old=tuple(read_old),
        )

    def key_positions(self, group: int, plan: CacheWrite):
        """Positions [B, S] of the keys a layer of `group` attends over (-1: an empty slot or padding)."""
        if plan.read_old[group]:
            chunk = jnp.where(plan.valid, plan.query_positions, -1)
            return jnp.concatenate([self.groups[group].positions, chunk], axis=1)
        return plan.new_positions[group]

    def update(self, layer, new: dict, plan: CacheWrite):
        """Write layer `layer`'s new entries (name -> [B, T, ...]) and return (new cache, what the layer attends
        over: name -> [B, S, ...] in the new entries' dtype, matching `key_positions`)."""
        g, i = self.locate(layer)
        group = self.groups[g]
        if plan.read_old[g]:
            old = {n: self._read(group, n, i) for n in self.names}
            keys = {n: jnp.concatenate([old[n].astype(new[n].dtype), new[n]], axis=1) for n in self.names}
            return self._write(g, i, new, plan), keys
        cache = self._write(g, i, new, plan)
        group = cache.groups[g]
        return cache, {n: self._read(group, n, i).astype(new[n].dtype) for n in self.names}

    def commit(self, plan: CacheWrite) -> KVCache:
        """The cache after the call: the slots' new positions and the rows' new lengths."""
        groups = tuple(
            dataclasses.replace(g, positions=p) for g, p in zip(self.groups, plan.new_positions, strict=True)
        )
        return dataclasses.replace(self, groups=groups, lengths=plan.new_lengths)

    def rollback(self, lengths) -> KVCache:
        """Each row cut back to `lengths` [B] tokens (at most its current length): the slots holding positions at
        or after the new length become empty, as if those tokens had never been written.

        A ring (local layer) can undo at most `lookahead` tokens (its slots beyond the window): further back, the
        undone tokens overwrote keys still inside the window. Checked on the host when the lengths are concrete,
        with lengths that are negative or beyond a row's current one (inside jit: clamped to the current ones)."""
        if not isinstance(lengths, jax.core.Tracer) and not isinstance(self.lengths, jax.core.Tracer):
            asked = np.asarray(lengths)
            current = np.asarray(self.lengths)
            if not np.issubdtype(asked.dtype, np.integer) or asked.shape not in ((), current.shape):
                raise CacheError(
                    f"rollback takes integer lengths, one per row ({current.shape[0]} rows), got "
                    f"{asked.dtype} of shape {asked.shape}"
                )
            asked = np.broadcast_to(asked, current.shape)
            bad = np.flatnonzero((asked < 0) | (asked > current))
            if bad.size:
                row = int(bad[0])
                raise CacheError(
                    f"cannot roll row {row} back to length {int(asked[row])}: a rollback keeps between 0 and the "
                    f"row's current {int(current[row])} tokens"
                )
        lengths = jnp.minimum(jnp.asarray(lengths, jnp.int32), self.lengths)
        if not isinstance(lengths, jax.core.Tracer) and not isinstance(self.lengths, jax.core.Tracer):
            undone = int(np.max(np.asarray(self.lengths) - np.asarray(lengths), initial=0))
            for g in self.groups:
                room = g.capacity - g.window
                if g.window and undone > room and g.capacity < self.max_len:
                    raise CacheError(
                        f"cannot roll back {undone} tokens: a local layer's ring (window {g.window}) holds "
                        f"{g.capacity} slots, room to undo {room}; build the cache with init_cache(..., "
                        f"lookahead={undone}) or more"
                    )
        groups = tuple(
            dataclasses.replace(g, positions=jnp.where(g.positions >= lengths[:, None], -1, g.positions))
            for g in self.groups
        )
        return dataclasses.replace(self, groups=groups, lengths=lengths)

    def repeat_rows(self, n: int) -> KVCache:
        """Each row repeated n times in place (row b becomes rows b*n .. b*n + n-1): n continuations sharing one
        prefilled prompt without computing it again."""
        groups = tuple(
            dataclasses.replace(
                g,
                arrays={k: jnp.repeat(a, n, axis=1) for k, a in g.arrays.items()},
                positions=jnp.repeat(g.positions, n, axis=0),
            )
            for g in self.groups
        )
        return dataclasses.replace(self, groups=groups, lengths=jnp.repeat(self.lengths, n, axis=0))

    # ---- storage -----------------------------------------------------------------------------------------------
    # ---- a decode step read in place (csrc/decode_attention.cc) ------------------------------------------------
    def attends_in_place(self, q, plan: CacheWrite | None = None) -> bool:
        """Whether `attend` can compute this call's attention for queries q [B, T, N, H] (static facts only): a
        decode step's few float32 queries over float32 K/V storage, attending over the slots only (not a ring's
        old slots plus the chunk), on the CPU with the kernel built, in a decode trace (`matvec.native_products`,
        outside the batch-invariant scoring mode). Elsewhere the caller reads with `update` and the XLA kernels."""
        return (
            tuple(self.names) == ("k", "v")
            and self.storage == "float32"
            and q.shape[1] <= kernels.FEW_QUERIES
            and plan is not None
            and not any(plan.read_old)
            and decode_attention.native_here(q.dtype)
        )

    def write(self, layer, new: dict, plan: CacheWrite) -> KVCache:
        """The cache with layer `layer`'s new entries (name -> [B, T, ...]) written, in place in the stacked
        buffers (the first half of `update`, for `attend`)."""
        g, i = self.locate(layer)
        return self._write(g, i, new, plan)

    def attend(self, layer, q, visible, *, scale: float, sink=None, softcap=None):
        """Attention of q [B, T, N, H] over layer `layer`'s slots (after `write`) under the mask visible [B, T, C]:
        out [B, T, N, Hv] float32, what `update` + `kernels.attention` compute, with the layer read where it lies in
        the stacked buffer by one C++ call (`kernels.layer_attention_in_place`). Only where `attends_in_place`."""
        g, i = self.locate(layer)
        arrays = self.groups[g].arrays
        return kernels.layer_attention_in_place(
            q, arrays["k"], arrays["v"], i, visible, scale=scale, sink=sink, softcap=softcap
        )

    def _write(self, g: int, i, new: dict, plan: CacheWrite) -> KVCache:
        group = self.groups[g]
        arrays = dict(group.arrays)
        sorted_ = group.window == 0  # a ring's slots wrap around
        limit = CACHE_DTYPES[self.storage]
        for n in self.names:
            x = new[n]
            if limit is not None:
                x, scale = quantize(x, limit, arrays[n].dtype)
                arrays[n + "_scale"] = write_layer_slots(arrays[n + "_scale"], i, scale, plan.slots[g], sorted_)
            arrays[n] = write_layer_slots(arrays[n], i, x, plan.slots[g], sorted_)
        groups = list(self.groups)
        groups[g] = dataclasses.replace(group, arrays=arrays)
        return dataclasses.replace(self, groups=tuple(groups))

    def _read(self, group: CacheGroup, name: str, i):
        """Layer i's stored entries [B, C, ...], dequantized to float32 when the storage is scaled."""
        x = group.arrays[name][i]
        if CACHE_DTYPES[self.storage] is not None:
            return x.astype(jnp.float32) * group.arrays[name + "_scale"][i][..., None]
        return x


def quantize(x, limit: float, dtype):
    """x [..., E] -> (stored [..., E] in `dtype`, scale [...] float32): absmax / limit per vector. An all-zero
    vector gets scale 1 (not 0, which would divide by zero on the way in)."""
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1)
    scale = jnp.where(amax > 0, amax / limit, 1.0)
    q = x32 / scale[..., None]
    if jnp.issubdtype(jnp.dtype(dtype), jnp.integer):
        q = jnp.round(q)
    return jnp.clip(q, -limit, limit).astype(dtype), scale


def _scatter_rows(buf, slots, values):
    """buf [B, C] with values [B, T] written at slots [B, T] (slots >= C dropped)."""
    return jax.vmap(lambda b, s, v: b.at[s].set(v, mode="drop"))(buf, slots, values)


def write_layer_slots(buf, layer, new, slots, indices_are_sorted: bool = False):
    """Write new [B, T, ...] into layer `layer` of buf [L, B, C, ...] at per-row slots [B, T] (>= C: dropped).

    One scatter into the whole buffer, batched over its B axis where it lies (a vmapped update would move that
    axis to the front and transpose the whole cache), which XLA does in place when the buffer is donated or a loop
    carry. Slicing the layer out, writing into the slice and writing the slice back would copy the layer's K/V
    twice per call.
    """
    new = new.astype(buf.dtype)
    B, T = slots.shape
    index = jnp.stack([jnp.broadcast_to(jnp.asarray(layer, jnp.int32), (B, T)), slots.astype(jnp.int32)], axis=-1)
    rest = tuple(range(2, new.ndim))  # the per-slot entry's own axes, e.g. (K, H)
    dims = jax.lax.ScatterDimensionNumbers(
        update_window_dims=rest,
        inserted_window_dims=(0, 2),
        scatter_dims_to_operand_dims=(0, 2),
        operand_batching_dims=(1,),
        scatter_indices_batching_dims=(0,),
    )
    return jax.lax.scatter(
        buf,
        index,
        new,
        dims,
        indices_are_sorted=indices_are_sorted,
        unique_indices=True,
        mode=jax.lax.GatherScatterMode.FILL_OR_DROP,
    )


# ---- building a cache ------------------------------------------------------------------------------------------


def require_causal(config: ModelConfig) -> None:
    if config.attention_mask != "causal":
        raise CacheError(
            f"a KV cache needs attention_mask='causal' (this model uses {config.attention_mask!r}): without the "
            "causal mask an old token's K/V would change when new tokens arrive, so cached values would be "
            "wrong. Use generate(..., use_cache=False) (or `causal-lm generate --no-cache`) for this model."
        )


def entry_shapes(config: ModelConfig) -> dict:
    """name -> shape of one token's entry in one layer: K and V [K, H], or MLA's latent [R] and rope key [Hr]."""
    if config.attention_type == "mla":
        return {"latent": (config.mla.kv_lora_rank,), "rope_key": (config.rope_dim,)}
    return {"k": (config.num_kv_heads, config.head_dim), "v": (config.num_kv_heads, config.head_dim)}


def storage_name(dtype) -> str:
    """The CACHE_DTYPES name of a storage type given by name or dtype; CacheError for anything else."""
    try:
        name = str(jnp.dtype(dtype)) if dtype != "float8_e4m3fn" else dtype
    except TypeError:  # not a dtype at all ("foo")
        name = None
    if name not in CACHE_DTYPES:
        raise CacheError(f"cache dtype must be one of {', '.join(CACHE_DTYPES)}, got {dtype!r}")
    return name


def refuse_mismatch(field, got, want, build="init_cache(model.config, ...)"):
    """The CacheError of a cache built for another model, naming the first field that differs."""
    raise CacheError(
        f"this cache was not built for this model: {field} is {got} in the cache, {want} in the model "
        f"(build the cache with {build})"
    )


def entry_labels(config: ModelConfig) -> dict:
    """name -> the config field behind each dim of entry_shapes(config)[name], for CacheError messages."""
    if config.attention_type == "mla":
        return {"latent": ("kv_lora_rank",), "rope_key": ("the rope key dim",)}
    return {"k": ("num_kv_heads", "head_dim"), "v": ("num_kv_heads", "head_dim")}


def check_cache_matches(config: ModelConfig, cache) -> None:
    """Raise CacheError naming the first field in which `cache` differs from what init_cache builds for `config`
    (layers and their groups, the cached entries, KV heads, head dim, MLA ranks, each group's window and capacity,
    the storage type, the rows). Static shapes and metadata only: free inside jit, where it runs while tracing."""
    if not isinstance(cache, KVCache):
        check = getattr(cache, "check_matches", None)  # another cache type (the engine's pages) checks itself
        if check is None:
            raise CacheError(f"cache must be a KVCache from init_cache, got {type(cache).__name__}")
        return check(config)
    refuse = refuse_mismatch

    if cache.num_layers != config.num_layers:
        refuse("the number of layers", cache.num_layers, config.num_layers)
    want_groups = layer_groups(config, cache.max_len)
    got_layout = [(g.window, tuple(g.layers)) for g in cache.groups]
    want_layout = [(w, layers) for w, _, layers in want_groups]
    if len(got_layout) != len(want_layout):
        refuse("the number of layer groups (one per window)", len(got_layout), len(want_layout))
    for (gw, gl), (ww, wl) in zip(got_layout, want_layout, strict=True):
        if gl != wl:
            refuse("a group's layers", list(gl), list(wl))
        if gw != ww:
            refuse(f"the window of layers {list(wl)}", gw, ww)
    entries = entry_shapes(config)
    if tuple(cache.names) != tuple(entries):
        refuse("what each slot holds", "/".join(cache.names), "/".join(entries))
    if cache.storage not in CACHE_DTYPES:
        refuse("the storage type", repr(cache.storage), f"one of {', '.join(CACHE_DTYPES)}")
    scaled = CACHE_DTYPES[cache.storage] is not None
    labels = entry_labels(config)
    B = cache.batch_size
    for g, (w, _, layers) in zip(cache.groups, want_groups, strict=True):
        C = g.capacity
        if tuple(g.positions.shape) != (B, C):
            refuse(f"the slot positions' shape of layers {list(layers)}", list(g.positions.shape), [B, C])
        if w == 0 and C != cache.max_len:
            refuse(f"the capacity of the global layers {list(layers)}", C, f"max_len={cache.max_len}")
        if w and not min(w, cache.max_len) <= C <= cache.max_len:
            refuse(
                f"the ring capacity of the local layers {list(layers)} (window {w})",
                C,
                f"between {min(w, cache.max_len)} and max_len={cache.max_len}",
            )
        want_names = set(entries) | ({n + "_scale" for n in entries} if scaled else set())
        if set(g.arrays) != want_names:
            refuse(f"the arrays of storage {cache.storage!r}", sorted(g.arrays), sorted(want_names))
        lead = (len(layers), B, C)
        for name, entry in entries.items():
            a = g.arrays[name]
            shape = tuple(a.shape)
            if shape[:3] != lead:
                refuse(f"{name!r}'s [layers, rows, slots] of layers {list(layers)}", list(shape[:3]), list(lead))
            if shape[3:] != entry:
                if len(shape[3:]) == len(entry):
                    i = next(i for i, (x, y) in enumerate(zip(shape[3:], entry, strict=True)) if x != y)
                    refuse(labels[name][i], shape[3 + i], entry[i])
                refuse(f"{name!r}'s entry shape", list(shape[3:]), list(entry))
            if str(a.dtype) != cache.storage:
                refuse(f"the storage type of {name!r}", str(a.dtype), cache.storage)
            if scaled and tuple(g.arrays[name + "_scale"].shape) != lead + entry[:-1]:
                refuse(f"{name}_scale's shape", list(g.arrays[name + "_scale"].shape), list(lead + entry[:-1]))


def layer_groups(config: ModelConfig, max_len: int, lookahead: int = 0) -> list:
    """[(window, capacity, layers)] for a cache of `max_len` tokens: one group per distinct window.

    A local layer's ring holds min(W + lookahead, max_len) slots: a ring as long as max_len never wraps (the row
    is then bounded at max_len, like a global layer's), a shorter one wraps for as long as the model's positions
    go."""
    out = {}
    for layer, w in enumerate(config.layer_windows):
        cap = max_len if not w else min(max_len, w + lookahead)
        out.setdefault(w, (w, cap, []))[2].append(layer)
    return [(w, cap, tuple(layers)) for w, cap, layers in out.values()]


def init_cache(
    config: ModelConfig, batch_size: int, max_len: int, dtype: str | None = None, *, lookahead: int = 0
) -> KVCache:
    """An empty cache for `batch_size` rows of up to `max_len` tokens.

    dtype: the storage type (default: the model's compute dtype): float32, bfloat16, float16, or int8 /
    float8_e4m3fn with a float32 scale per token and KV head. lookahead: extra ring slots for a local layer,
    the most tokens one call may write and later roll back (see the module docstring).
    """
    require_causal(config)
    for name, value, least in (("batch_size", batch_size, 1), ("max_len", max_len, 1), ("lookahead", lookahead, 0)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < least:
            kind = "a positive integer" if least else "an integer >= 0"
            raise CacheError(f"init_cache: {name} must be {kind}, got {value!r}")
    storage = storage_name(dtype or config.dtype)
    store = jnp.dtype(storage)
    scaled = CACHE_DTYPES[storage] is not None
    groups = []
    for window, cap, layers in layer_groups(config, int(max_len), lookahead):
        arrays = {}
        for name, entry in entry_shapes(config).items():
            arrays[name] = jnp.zeros((len(layers), batch_size, cap) + entry, store)
            if scaled:
                arrays[name + "_scale"] = jnp.ones((len(layers), batch_size, cap) + entry[:-1], jnp.float32)
        positions = jnp.full((batch_size, cap), -1, jnp.int32)
        groups.append(CacheGroup(arrays=arrays, positions=positions, window=window, layers=layers))
    return KVCache(
        groups=tuple(groups),
        lengths=jnp.zeros((batch_size,), jnp.int32),
        max_len=int(max_len),
        names=tuple(entry_shapes(config)),
        storage=storage,
    )


def check_capacity(cache: KVCache, num_new) -> None:
    """Raise before compute if a row would hold more than `cache.max_len` tokens after writing `num_new` (an int,
    or per row [B]) more. Only global layers fill up: a ring (local layer) never overflows."""
    if not cache.bounded:
        return
    lengths = np.asarray(jax.device_get(cache.lengths))
    need = lengths + np.asarray(num_new)
    if need.size and need.max() > cache.max_len:
        row = int(need.argmax())
        raise CacheError(
            f"KV cache overflow: row {row} holds {int(lengths[row])} tokens and {int(need[row] - lengths[row])} more "
            f"do not fit in max_len={cache.max_len} of its global layers (JAX would clamp the write and silently "
            "overwrite the last slots)"
        )


def cache_bytes(
    config: ModelConfig,
    context: int,
    *,
    dtype: str | None = None,
    bytes_per_element: int | None = None,
    lookahead: int = 0,
    batch_size: int = 1,
) -> dict:
    """What `init_cache(config, batch_size, context, dtype, lookahead=lookahead)` allocates, by shape arithmetic
    alone (nothing is built, so presets of any size answer at once).

    dtype: a storage type of CACHE_DTYPES (scaled ones add their scales); or bytes_per_element: a raw element
    size (published figures quote bf16 = 2) with no scales. Returns bytes_per_token (one token, every layer, K/V
    or latent + rope key plus their scales), kv_bytes (those arrays for the whole cache, local layers at their ring
    capacity), total_bytes (kv_bytes plus the slots' positions and the rows' lengths: every array init_cache makes)
    and the layout of each group."""
    if dtype is None and bytes_per_element is None:
        dtype = config.dtype
    if dtype is not None:
        dtype = storage_name(dtype)
        element, scaled = jnp.dtype(dtype).itemsize, CACHE_DTYPES[dtype] is not None
    else:
        element, scaled = int(bytes_per_element), False
    per_layer = 0  # one token in one layer
    for shape in entry_shapes(config).values():
        per_layer += int(np.prod(shape)) * element + (int(np.prod(shape[:-1])) * 4 if scaled else 0)
    groups, kv = [], 0
    for window, cap, layers in layer_groups(config, context, lookahead):
        kv += len(layers) * batch_size * cap * per_layer
        groups.append({"window": window, "capacity": cap, "layers": len(layers)})
    bookkeeping = sum(g["capacity"] for g in groups) * batch_size * 4 + batch_size * 4  # positions, lengths
    return {
        "cache_dtype": dtype,
        "bytes_per_element": element,
        "layer_bytes_per_token": per_layer,
        "bytes_per_token": per_layer * config.num_layers,
        "kv_bytes": kv,
        "total_bytes": kv + bookkeeping,
        "groups": groups,
    }
