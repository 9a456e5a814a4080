"""Paged KV storage: the cache's slots in pages of `page_size`, reached through a page table per row.

A page is a run of `page_size` slots that carry their tokens' positions, exactly as the slots of `KVCache` do
(kv_cache.py), so attention still builds its mask with the one mask function from the query positions and the
positions of the slots it reads; nothing outside this module does page arithmetic.

    PagePool         the device storage shared by every sequence: one group of pages per layer group (layers that
                     share a mask: a sliding window or none), each group with its own pages, paged independently:
                         arrays     name -> [Lg, Pg, page_size, ...] (K/V at the KV-head count, or MLA's latent and
                                    rope key), plus "<name>_scale" [Lg, Pg, page_size, (K)] for int8 / float8 storage
                         positions  [Pg, page_size] int32: the position of the token each slot holds, -1 for empty
                     A page of a group holds only that group's layers: a local group's row gives back its pages
                     wholly before the window while a global group's row keeps all of its pages.
    PagedKVCache     one call's view: the pool, page tables [G, B, NP] (group g's row b's j-th page holds its
                     positions j*page_size .. (j+1)*page_size - 1; an entry >= Pg means "no page") and the lengths.
                     It has the interface of `KVCache` the decoder uses (plan_write, key_positions, update, commit),
                     so the model code runs on it unchanged.

Each layer's call writes the new tokens through the page table (page = table[b, p // page_size], offset
p % page_size) and reads the row's pages back as the [B, NP * page_size] slot view the attention kernels
consume: slot s of that view holds position s, or -1 where the row has no page or the page's slot is empty.
A decode call (a few queries) on the CPU skips that copy: `write` stores the new tokens and `attend` runs the paged
form of the C++ decode kernel (csrc/decode_attention.cc), which copies each 128-slot chunk's visible keys and values
out of the pool through the page table (dequantizing int8) into a per-thread buffer and sums them there exactly as
the contiguous form sums a `KVCache`'s, under the same [B, T, NP * page_size] mask (computed in JAX from
`key_positions`): a row's output has the bits `generate`'s decode step gives the same row, and is the XLA form's
function (tests/test_paged_attention.py). The XLA form stays wherever the kernel does not apply
(`attends_in_place`).
Local (sliding-window) layers are paged like global ones and their mask hides what lies outside the window; the
engine returns a local group's pages wholly outside it (their table entries become "no page").

Which pages a row owns, shares (a prompt prefix) or gives back is decided on the host by the engine
(causal_lm/serve), in page counts (`pages_for`), one book per group. A page handed to a new owner is named in its
group's `fresh` when the view is made: its slots' positions are reset to -1 first, so nothing its previous owner
wrote is visible. Out-of-range page indices are never clamped here: writes to page >= Pg are dropped and reads of it
return empty slots.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from causal_lm.config import ModelConfig
from causal_lm.model import native
from causal_lm.model.kernels import FEW_QUERIES
from causal_lm.model.kv_cache import (
    CACHE_DTYPES,
    CacheError,
    entry_labels,
    entry_shapes,
    quantize,
    refuse_mismatch,
    require_causal,
)

PAGED_ATTENTION = "decode_attention"  # csrc/decode_attention.cc: decode attention reading the pages in place
PAGED_ATTENTION_TARGET = "causal_lm_decode_attention_paged"


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` tokens: ceil(tokens / page_size)."""
    return -(-int(tokens) // int(page_size))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PageGroup:
    """The pages of the layers that share one mask (one sliding window, or none)."""

    arrays: dict  # name -> [Lg, Pg, page_size, ...]
    positions: jax.Array  # [Pg, page_size] int32, -1 = empty
    window: int = dataclasses.field(metadata=dict(static=True))  # 0 = global
    layers: tuple = dataclasses.field(metadata=dict(static=True))  # the model layers stored here, in order

    @property
    def num_pages(self) -> int:
        return self.positions.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagePool:
    """Every layer's pages and the slots' positions (see the module docstring)."""

    groups: tuple  # of PageGroup
    names: tuple = dataclasses.field(metadata=dict(static=True))  # ("k", "v") or ("latent", "rope_key")
    storage: str = dataclasses.field(metadata=dict(static=True))  # one of CACHE_DTYPES

    @property
    def num_pages(self) -> tuple:
        """Pages of each group."""
        return tuple(g.num_pages for g in self.groups)

    @property
    def page_size(self) -> int:
        return self.groups[0].positions.shape[1]

    def view(self, table, lengths, fresh) -> PagedKVCache:
        """The cache of one call: page tables [G, B, NP], lengths [B]; `fresh` [G, F] pages of each group (>= Pg:
        none) newly handed out, whose slots are emptied before anything is written or read."""
        groups = tuple(
            dataclasses.replace(g, positions=g.positions.at[fresh[i]].set(-1, mode="drop"))
            for i, g in enumerate(self.groups)
        )
        return PagedKVCache(
            pool=dataclasses.replace(self, groups=groups),
            table=jnp.asarray(table, jnp.int32),
            lengths=jnp.asarray(lengths, jnp.int32),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedWrite:
    """Where one call's tokens go (`PagedKVCache.plan_write`), computed once for all layers."""

    query_positions: jax.Array  # [B, T] int32: each row's length + 0..T-1
    valid: jax.Array  # [B, T] bool: real tokens (right padding is neither written nor counted)
    page: tuple  # per group [B, T] int32: the page each token goes to (>= Pg: dropped)
    offset: jax.Array  # [B, T] int32: its slot within the page
    positions: tuple  # per group [Pg, page_size] int32: the group's slot positions after the write
    key_positions: tuple  # per group [B, NP * page_size] int32: what each row's slot view holds after the write
    new_lengths: jax.Array  # [B] int32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """One call's view of the pool through a page table, with the interface of `KVCache` the decoder uses."""

    pool: PagePool
    table: jax.Array  # [G, B, NP] int32: each group's row b's pages in position order; >= Pg = no page
    lengths: jax.Array  # [B] int32: tokens already cached in each row

    @property
    def groups(self) -> tuple:
        return self.pool.groups

    @property
    def names(self) -> tuple:
        return self.pool.names

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.pool.groups)

    @property
    def max_len(self) -> int:
        """Tokens a row's page table reaches."""
        return self.table.shape[2] * self.pool.page_size

    bounded = True
    copies_keys = True  # `update` returns a gathered copy of each row's pages (the kernels may lay it out freely)
    # `attends_in_place(q)` / `write` + `attend`: the decode path that reads the pages in place (module docstring)

    def check_matches(self, config: ModelConfig) -> None:
        """CacheError naming the first field in which the pool differs from what init_pool builds for `config`
        (layer groups and windows, what a slot holds, the storage type, each array's entry shape). Static shapes
        only (jax.eval_shape builds nothing): free inside jit, where the decoder calls it while tracing."""
        pool = self.pool

        def refuse(field, got, want):
            refuse_mismatch(field, got, want, build="Engine(model, ...) or init_pool(model.config, ...)")

        got_layout = [(g.window, tuple(g.layers)) for g in pool.groups]
        want_layout = [(w, tuple(layers)) for w, layers in layer_groups(config)]
        if got_layout != want_layout:
            refuse("the layer groups (window, layers)", got_layout, want_layout)
        want = jax.eval_shape(lambda: init_pool(config, pool.num_pages, pool.page_size, pool.storage))
        if tuple(pool.names) != tuple(want.names):
            refuse("what each slot holds", "/".join(pool.names), "/".join(want.names))
        labels = entry_labels(config)
        for g, w in zip(pool.groups, want.groups, strict=True):
            if set(g.arrays) != set(w.arrays):
                refuse(f"the arrays of storage {pool.storage!r}", sorted(g.arrays), sorted(w.arrays))
            for name, a in w.arrays.items():
                got = tuple(g.arrays[name].shape)
                if got != tuple(a.shape):
                    dims = [i for i, (x, y) in enumerate(zip(got, a.shape, strict=False)) if x != y]
                    i = dims[0] if dims and len(got) == len(a.shape) else None
                    if name in labels and i is not None and i >= 3:
                        refuse(labels[name][i - 3], got[i], a.shape[i])
                    refuse(f"{name!r}'s shape of layers {list(w.layers)}", list(got), list(a.shape))

    def locate(self, layer):
        """(group index, index within the group) of a model layer (traced only with a single group)."""
        groups = self.pool.groups
        if len(groups) == 1:
            return 0, layer
        if isinstance(layer, jax.core.Tracer):
            raise ValueError("a paged cache with several layouts needs static layer indices")
        for g, group in enumerate(groups):
            if layer in group.layers:
                return g, group.layers.index(layer)
        raise ValueError(f"layer {layer} is not in this cache ({self.num_layers} layers)")

    def plan_write(self, valid) -> PagedWrite:
        """Where the new tokens [B, T] (valid: real, right-padded) go: position p of row b to group g's page
        table[g, b, p // page_size], slot p % page_size."""
        B, T = valid.shape
        valid = valid.astype(bool)
        ps, NP = self.pool.page_size, self.table.shape[2]
        pos = self.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
        column = pos // ps
        offset = pos % ps
        pages, positions, key_positions = [], [], []
        for g, group in enumerate(self.pool.groups):
            page = jnp.take_along_axis(self.table[g], jnp.clip(column, 0, NP - 1), axis=1)
            page = jnp.where(valid & (column < NP), page, group.num_pages)  # padding: written nowhere
            written = group.positions.at[page, offset].set(pos, mode="drop")
            pages.append(page)
            positions.append(written)
            key_positions.append(self._gather(g, written, fill=-1))
        return PagedWrite(
            query_positions=pos,
            valid=valid,
            page=tuple(pages),
            offset=offset,
            positions=tuple(positions),
            key_positions=tuple(key_positions),
            new_lengths=self.lengths + jnp.sum(valid, axis=1, dtype=jnp.int32),
        )

    def key_positions(self, group: int, plan: PagedWrite):
        """Positions [B, NP * page_size] of the keys a layer attends over (-1: no page, or an empty slot)."""
        return plan.key_positions[group]

    def update(self, layer, new: dict, plan: PagedWrite):
        """Write layer `layer`'s new entries (name -> [B, T, ...]) into their pages and return (new cache, the
        row's slot view name -> [B, NP * page_size, ...] in the new entries' dtype)."""
        cache = self.write(layer, new, plan)
        g, i = self.locate(layer)
        arrays = cache.pool.groups[g].arrays
        keys = {}
        for n in self.pool.names:
            stored = self._gather(g, arrays[n][i], fill=0)
            if CACHE_DTYPES[self.pool.storage] is not None:
                stored = stored.astype(jnp.float32) * self._gather(g, arrays[n + "_scale"][i], fill=0)[..., None]
            keys[n] = stored.astype(new[n].dtype)
        return cache, keys

    def write(self, layer, new: dict, plan: PagedWrite) -> PagedKVCache:
        """The cache with layer `layer`'s new entries (name -> [B, T, ...]) written into their pages (quantized if
        the storage is), in place in the pool: a scatter into the stacked [Lg, Pg, ...] arrays."""
        g, i = self.locate(layer)
        group = self.pool.groups[g]
        arrays = dict(group.arrays)
        limit = CACHE_DTYPES[self.pool.storage]
        for n in self.pool.names:
            x = new[n]
            if limit is not None:
                x, scale = quantize(x, limit, arrays[n].dtype)
                arrays[n + "_scale"] = arrays[n + "_scale"].at[i, plan.page[g], plan.offset].set(scale, mode="drop")
            arrays[n] = arrays[n].at[i, plan.page[g], plan.offset].set(x.astype(arrays[n].dtype), mode="drop")
        groups = list(self.pool.groups)
        groups[g] = dataclasses.replace(group, arrays=arrays)
        return dataclasses.replace(self, pool=dataclasses.replace(self.pool, groups=tuple(groups)))

    def attends_in_place(self, q, plan=None) -> bool:
        """Whether `attend` can compute attention for queries q [B, T, N, H] here (static facts only): a few
        queries (decode), K/V storage (float32 or int8) read by the C++ kernel (`csrc/decode_attention.cc`'s paged
        form), on the CPU with the kernel built. Elsewhere (MLA's latent, bfloat16 / float8 storage, GPU/TPU,
        `CAUSAL_LM_NATIVE=0`) the caller gathers the pages with `update` and uses the XLA kernels."""
        return (
            tuple(self.pool.names) == ("k", "v")
            and self.pool.storage in ("float32", "int8")
            and q.dtype == jnp.float32
            and q.shape[1] <= FEW_QUERIES
            and native.on_cpu()
            and native.available(PAGED_ATTENTION, (PAGED_ATTENTION_TARGET,))
        )

    def attend(self, layer, q, visible, *, scale: float, sink=None, softcap=None):
        """Attention of q [B, T, N, H] over layer `layer`'s pages, read in place through the page table (after
        `write`): out [B, T, N, Hv] float32, the function of kernels.reference_attention over `update`'s slot view
        under the mask `visible` [B, T, NP * page_size] (the one mask function's output), with optional sink
        logits [N] and softcap. Only where `attends_in_place(q)`."""
        g, i = self.locate(layer)
        arrays = self.pool.groups[g].arrays
        k, v = arrays["k"], arrays["v"]
        B, T, N, _ = q.shape
        if CACHE_DTYPES[self.pool.storage] is not None:
            k_scale, v_scale = arrays["k_scale"], arrays["v_scale"]
        else:
            k_scale = v_scale = jnp.zeros((1,), jnp.float32)
        call = jax.ffi.ffi_call(PAGED_ATTENTION_TARGET, jax.ShapeDtypeStruct((B, T, N, v.shape[-1]), jnp.float32))
        return call(
            q,
            k,
            v,
            k_scale,
            v_scale,
            jnp.asarray(i, jnp.int32),
            self.table[g],
            visible,
            jnp.zeros((N,), jnp.float32) if sink is None else sink.astype(jnp.float32),
            scale=np.float32(scale),
            softcap=np.float32(softcap or 0.0),
            has_sink=np.int32(sink is not None),
        )

    def commit(self, plan: PagedWrite) -> PagedKVCache:
        """The cache after the call: the pool's new slot positions and the rows' new lengths."""
        groups = tuple(
            dataclasses.replace(g, positions=p) for g, p in zip(self.pool.groups, plan.positions, strict=True)
        )
        return dataclasses.replace(self, pool=dataclasses.replace(self.pool, groups=groups), lengths=plan.new_lengths)

    def _gather(self, group: int, pages, fill):
        """Group `group`'s pages [Pg, page_size, ...] -> each row's slot view [B, NP * page_size, ...] (no page:
        `fill`)."""
        _, B, NP = self.table.shape
        rows = pages.at[self.table[group]].get(mode="fill", fill_value=fill)  # [B, NP, page_size, ...]
        return rows.reshape((B, NP * pages.shape[1]) + pages.shape[2:])


def page_bytes(config: ModelConfig, page_size: int, dtype: str | None = None, layers: int | None = None) -> int:
    """Bytes one page takes in a pool: `layers` layers' entries (and scales) for page_size tokens, plus the slots'
    positions. layers=None: every layer of the model (a single-group pool's page, or bytes per token of the
    layout); a group's page holds only its own layers."""
    storage = _storage(config, dtype)
    element, scaled = jnp.dtype(storage).itemsize, CACHE_DTYPES[storage] is not None
    per_token = 0
    for shape in entry_shapes(config).values():
        per_token += int(np.prod(shape)) * element + (int(np.prod(shape[:-1])) * 4 if scaled else 0)
    return page_size * (per_token * (config.num_layers if layers is None else layers) + 4)


def _storage(config: ModelConfig, dtype) -> str:
    storage = str(jnp.dtype(dtype or config.dtype)) if dtype != "float8_e4m3fn" else dtype
    if storage not in CACHE_DTYPES:
        raise CacheError(f"cache dtype must be one of {tuple(CACHE_DTYPES)}, got {dtype!r}")
    return storage


def layer_groups(config: ModelConfig) -> list:
    """[(window, layers)] of `config`: one group per distinct window (0: global), in order of first layer."""
    by_window = {}
    for layer, w in enumerate(config.layer_windows):
        by_window.setdefault(w, []).append(layer)
    return [(w, tuple(layers)) for w, layers in by_window.items()]


def init_pool(config: ModelConfig, num_pages, page_size: int, dtype: str | None = None) -> PagePool:
    """An empty pool of pages of `page_size` slots for every layer of `config`: `num_pages` pages in each layer
    group, or a sequence with one count per group (`layer_groups` order)."""
    require_causal(config)
    groups_of = layer_groups(config)
    counts = tuple(num_pages) if isinstance(num_pages, list | tuple) else (num_pages,) * len(groups_of)
    if len(counts) != len(groups_of):
        raise CacheError(f"num_pages needs one count per layer group ({len(groups_of)}), got {num_pages!r}")
    for name, v in [("num_pages", n) for n in counts] + [("page_size", page_size)]:
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
            raise CacheError(f"{name} must be a positive integer, got {v!r}")
    storage = _storage(config, dtype)
    store = jnp.dtype(storage)
    scaled = CACHE_DTYPES[storage] is not None
    groups = []
    for (window, layers), n in zip(groups_of, counts, strict=True):
        arrays = {}
        for name, entry in entry_shapes(config).items():
            arrays[name] = jnp.zeros((len(layers), int(n), page_size) + entry, store)
            if scaled:
                arrays[name + "_scale"] = jnp.ones((len(layers), int(n), page_size) + entry[:-1], jnp.float32)
        positions = jnp.full((int(n), page_size), -1, jnp.int32)
        groups.append(PageGroup(arrays=arrays, positions=positions, window=window, layers=layers))
    return PagePool(
        groups=tuple(groups),
        names=tuple(entry_shapes(config)),
        storage=storage,
    )
