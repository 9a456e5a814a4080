"""Finite, sane weights: a model whose parameters hold NaN or infinity is reported before compute.

A NaN weight makes every logit downstream NaN, and argmax over NaN logits picks token 0: generation would print
garbage with no error. `check_weights` computes max |w| of every array (one reduction each, in one jitted program;
NaN propagates through the max, so one number answers both questions) and raises `WeightError` naming the first
bad parameter. Results are remembered per array object (by identity, through weak references): a model checked
once is not reduced again until one of its arrays is replaced, so the eager `model(...)` and every `generate` call
pay a tree flatten and a dictionary lookup per array, not a pass over the weights. Under jit the parameters are
tracers and nothing is checked (the caller checks the concrete weights before tracing).
"""

from __future__ import annotations

import functools
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# Converted weights larger than this are taken for corrupt bytes (trained weights sit far below: |w| < 1e3).
SANE_MAGNITUDE = 1e4


class WeightError(ValueError):
    """Parameters that hold NaN or infinity (or, where a bound is asked for, values beyond a sane magnitude)."""


# id(array) -> [weak reference to it, its max |w|, whether a warning named it]: what was already reduced
_SEEN: dict[int, list] = {}


def leaf_name(path) -> str:
    """'blocks.attn.wq' or 'opt_state.1.0.mu.embed': one dotted name per array of a pytree (checkpoint checksums are
    recorded under these names)."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts)


def param_name(path) -> str:
    """'blocks.mlp.w_up': leaf_name without the trailing '.value' of an nnx.State's Variable."""
    name = leaf_name(path)
    return name[: -len(".value")] if name.endswith(".value") else name


@functools.lru_cache(maxsize=1)
def _reduce():
    def amax(x):
        return jnp.max(jnp.abs(x)).astype(jnp.float32) if x.size else jnp.float32(0)

    return jax.jit(lambda xs: [amax(x) for x in xs])


def _on_host(x) -> bool:
    """numpy arrays, and jax arrays held in host memory (the CPU backend): read in place, nothing to compile."""
    if isinstance(x, np.ndarray):
        return True
    try:
        return all(d.platform == "cpu" for d in x.devices()) and x.is_fully_addressable
    except AttributeError:
        return False


def _reduce_all(xs) -> list:
    """max |x| of each array: numpy where it lives on the host, else one jitted program on the devices."""
    out: list = [None] * len(xs)
    device = [i for i, x in enumerate(xs) if not _on_host(x)]
    for i, x in enumerate(xs):
        if i not in device:
            a = np.asarray(x)
            out[i] = float(np.max(np.abs(a)).astype(np.float32)) if a.size else 0.0
    if device:
        for i, v in zip(device, jax.device_get(_reduce()([xs[i] for i in device])), strict=True):
            out[i] = float(v)
    return out


def _params(model_or_tree):
    if isinstance(model_or_tree, nnx.Module):
        return nnx.state(model_or_tree, nnx.Param)
    return model_or_tree


def _forget(key, ref):
    """A remembered array was freed: forget it (unless its id already names a newer array)."""
    if _SEEN.get(key, (None,))[0] is ref:
        del _SEEN[key]


def magnitudes(model_or_tree) -> dict[str, float] | None:
    """{parameter name: max |w|} (NaN when it holds a NaN, inf when an infinity) of a model, an nnx.State or a
    pytree of arrays; None when the arrays are tracers (inside jit). Arrays seen before are not reduced again."""
    return _magnitudes(model_or_tree)[0]


def _magnitudes(model_or_tree):
    """(magnitudes, name -> its _SEEN entry or None, names of the arrays reduced by this call)."""
    flat = jax.tree_util.tree_flatten_with_path(_params(model_or_tree))[0]
    flat = [(p, x) for p, x in flat if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)]
    if any(isinstance(x, jax.core.Tracer) for _, x in flat):
        return None, {}, set()
    out, entries, todo = {}, {}, []
    for path, x in flat:
        seen = _SEEN.get(id(x))
        if seen is not None and seen[0]() is x:
            out[param_name(path)] = seen[1]
            entries[param_name(path)] = seen
        else:
            todo.append((path, x))
    if todo:
        values = _reduce_all([x for _, x in todo])
        for (path, x), v in zip(todo, values, strict=True):
            v = float(v)
            out[param_name(path)] = v
            entries[param_name(path)] = None
            try:
                _SEEN[id(x)] = entries[param_name(path)] = [weakref.ref(x, functools.partial(_forget, id(x))), v, False]
            except TypeError:  # an array type without weak references: not remembered
                pass
    return out, entries, {param_name(p) for p, _ in todo}


def check_weights(
    model_or_tree, *, max_abs: float | None = None, what: str = "the model", warn: bool = False, names=None
) -> None:
    """Raise WeightError naming the first parameter that holds NaN or infinity (or |w| > max_abs when given).

    warn=True: a `UserWarning` instead, once per array object, and the caller goes on. names: {our name: name to
    show}, e.g. the tensor names of the file the weights came from. Nothing is checked inside jit."""
    mags, entries, _ = _magnitudes(model_or_tree)
    if not mags:
        return
    bad = [(n, v) for n, v in mags.items() if not np.isfinite(v) or (max_abs is not None and v > max_abs)]
    if not bad:
        return
    shown = [(names or {}).get(n, n) for n, _ in bad]
    name, v = shown[0], bad[0][1]
    if np.isnan(v):
        why = "holds NaN"
    elif np.isinf(v):
        why = "holds an infinity"
    else:
        why = f"holds |w| = {v:.3g}, beyond {max_abs:g}: corrupt bytes, or not weights at all"
    more = (
        f" (and {len(bad) - 1} more: {', '.join(shown[1:4])}{', ...' if len(bad) > 4 else ''})" if len(bad) > 1 else ""
    )
    message = f"{what}'s parameter {name} {why}{more}"
    if not warn:
        raise WeightError(message + ": refusing to compute with it (logits would be NaN or meaningless)")
    unwarned = [entries[n] for n, _ in bad if entries[n] is None or not entries[n][2]]
    for entry in unwarned:
        if entry is not None:
            entry[2] = True
    if unwarned:  # once per array object: not again for weights already reported
        warnings.warn(message + "; going on as asked (check_finite=False)", stacklevel=3)


def check_tensor(w, name: str, source: str, max_abs: float = SANE_MAGNITUDE) -> None:
    """A tensor read from a file (Hugging Face safetensors, GGUF): WeightError naming it and the file when it holds
    NaN or infinity or |w| > max_abs. Those formats carry no checksum, so corrupt bytes are caught here or not at
    all; trained weights sit far below 1e4."""
    a = np.asarray(w)
    if not a.size or a.dtype.kind in "biu":  # integer tensors (none in these formats' weights) are not checked
        return
    v = float(np.max(np.abs(a.astype(np.float32))))
    if np.isfinite(v) and v <= max_abs:
        return
    why = (
        "holds NaN"
        if np.isnan(v)
        else "holds an infinity"
        if np.isinf(v)
        else f"holds |w| = {v:.3g}, beyond {max_abs:g}"
    )
    raise WeightError(f"{source}: tensor {name!r} {why}: corrupt bytes, or not these weights; refusing to convert it")
