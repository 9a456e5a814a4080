"""JAX's persistent compilation cache for the command line: a second `causal-lm generate` (or train, eval, bench)
with the same shapes loads its compiled programs from disk instead of compiling them again.

The folder is `$CAUSAL_LM_COMPILATION_CACHE` when set (`off`, `0` or an empty value turns the cache off), else
`$XDG_CACHE_HOME/causal_lm/jax` (default `~/.cache/causal_lm/jax`). Every program is cached, however quickly it
compiled: on a CPU even small programs take a noticeable fraction of a second. Entries are keyed by the program,
the JAX version, the device and the XLA flags, so a stale entry is never used; the folder may be deleted at any
time.
"""

from __future__ import annotations

import os
import sys

import jax

ENV = "CAUSAL_LM_COMPILATION_CACHE"
_OFF = ("", "0", "off", "none", "false", "no")


def cache_dir() -> str | None:
    """The folder the CLI caches compiled programs in, or None when turned off."""
    value = os.environ.get(ENV)
    if value is not None:
        return None if value.strip().lower() in _OFF else os.path.abspath(os.path.expanduser(value))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "causal_lm", "jax")


def enable(directory: str | None = None) -> str | None:
    """Turn the persistent compilation cache on (in `directory`, default `cache_dir()`); returns the folder used,
    or None when it is off or cannot be created (then everything still works, it just compiles)."""
    directory = directory or cache_dir()
    if directory is None:
        return None
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        print(f"note: compilation cache off: cannot create {directory} ({e.strerror})", file=sys.stderr)
        return None
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory
