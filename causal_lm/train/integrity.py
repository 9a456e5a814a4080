"""Checksums of checkpointed arrays and JSON, computed on the device so they do not depend on the mesh.

Every array of a checkpoint gets a 64-bit checksum when it is saved, and the restored array is checked against
it. The checksum is computed where the array lives, by one jitted program over the whole tree:

    each element's bits (as uint32) are mixed with its flat index by an invertible hash (an odd multiply, then
    xor-shift / odd-multiply rounds), and the mixed values are summed modulo 2**32; two independent seeds give
    64 bits.

Integer addition modulo 2**32 is exact and order-free, so the sum is the same on one CPU and on a mesh of
devices across several processes, which is what lets a checkpoint saved on a pod verify on a laptop (a
host-side hash of the bytes could not be computed by one host when the array is split across processes).
Because each element's mixed value is an invertible function of its bits at a fixed index, changing any single
element always changes the sum; several changed elements go unnoticed with probability about 2**-64.
Dtype and shape are recorded beside the checksum and compared exactly.

JSON parts of a checkpoint (config, tokenizer, data position) are checked with SHA-256 of their canonical
serialisation (sorted keys, no whitespace).
"""

from __future__ import annotations

import functools
import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np

from causal_lm.model.weights import leaf_name

# Odd 32-bit constants (from murmur3 / splitmix); two seeds give two independent 32-bit sums.
_SEEDS = ((0x9E3779B1, 0x85EBCA77), (0xC2B2AE3D, 0x27D4EB2F))
_MIX1, _MIX2 = 0x7FEB352D, 0x846CA68B


def _as_uint32(x):
    """The bits of `x` as uint32 values (16- and 8-bit types widened, 64-bit types split in two)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = jnp.dtype(x.dtype).itemsize
    if size == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if size in (1, 2):
        return jax.lax.bitcast_convert_type(x, jnp.uint8 if size == 1 else jnp.uint16).astype(jnp.uint32)
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)  # [..., 2]
    raise TypeError(f"no checksum for dtype {x.dtype}")


def _leaf_sums(x):
    u = _as_uint32(jnp.asarray(x)).reshape(-1)
    idx = jax.lax.iota(jnp.uint32, u.shape[0])
    out = []
    for a, b in _SEEDS:
        h = u * jnp.uint32(a) + idx * jnp.uint32(b) + jnp.uint32(b ^ a)
        h = h ^ (h >> 16)
        h = h * jnp.uint32(_MIX1)
        h = h ^ (h >> 15)
        h = h * jnp.uint32(_MIX2)
        h = h ^ (h >> 16)
        out.append(jnp.sum(h, dtype=jnp.uint32))
    finite = jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)
    return jnp.stack(out), finite


@functools.lru_cache(maxsize=1)
def _jitted():
    return jax.jit(lambda tree: jax.tree.map(_leaf_sums, tree))


def array_records(tree) -> dict[str, dict]:
    """{name: {"dtype", "shape", "checksum", "finite"}} for every array of `tree` (jax or numpy arrays)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    if not flat:
        return {}
    names = [leaf_name(p) for p, _ in flat]
    leaves = [x for _, x in flat]
    sums = jax.device_get(_jitted()(leaves))
    out = {}
    for name, x, (s, finite) in zip(names, leaves, sums, strict=True):
        s = np.asarray(s, np.uint32)
        out[name] = {
            "dtype": np.dtype(x.dtype).name,
            "shape": [int(d) for d in x.shape],
            "checksum": f"{int(s[0]):08x}{int(s[1]):08x}",
            "finite": bool(finite),
        }
    return out


def compare(saved: dict[str, dict], restored: dict[str, dict]) -> list[str]:
    """Lines naming every array whose dtype, shape or checksum differs from what was saved, or that one side
    lacks."""
    lines = []
    for name in sorted(set(saved) | set(restored)):
        s, r = saved.get(name), restored.get(name)
        if r is None:
            lines.append(f"{name}: saved but not restored")
        elif s is None:
            lines.append(f"{name}: restored but has no recorded checksum")
        elif s["dtype"] != r["dtype"] or list(s["shape"]) != list(r["shape"]):
            lines.append(f"{name}: saved as {s['dtype']}{list(s['shape'])}, read as {r['dtype']}{list(r['shape'])}")
        elif s["checksum"] != r["checksum"]:
            lines.append(f"{name}: checksum {r['checksum']} does not match the saved {s['checksum']}")
    return lines


def json_digest(obj) -> str:
    """SHA-256 of a JSON-able object's canonical serialisation."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def non_finite(records: dict[str, dict]) -> list[str]:
    """Names of the arrays that hold a NaN or an infinity."""
    return [name for name, r in records.items() if not r.get("finite", True)]
