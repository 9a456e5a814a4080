"""JAX's persistent compilation cache for the command line: a second `causal-lm generate` (or train, eval, bench)
with the same shapes loads its compiled programs from disk instead of compiling them again.

The folder is `$CAUSAL_LM_COMPILATION_CACHE` when set (`off`, `0` or an empty value turns the cache off), else
`$XDG_CACHE_HOME/causal_lm/jax` (default `~/.cache/causal_lm/jax`). Every program is cached, however quickly it
compiled: on a CPU even small programs take a noticeable fraction of a second. Entries are keyed by the program,
the JAX version, the device and the XLA flags, so a stale entry is never used; the folder may be deleted at any
time.
"""

from __future__ import annotations

import contextlib
import os
import sys

import jax
from jax.experimental.compilation_cache import compilation_cache as _jax_cache

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
    if jax.config.jax_compilation_cache_dir != directory or not jax.config.jax_enable_compilation_cache:
        # JAX opens its cache once per process, at the first compile: point it at the new folder.
        _jax_cache.reset_cache()
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory


@contextlib.contextmanager
def bypassed():
    """Compile without the persistent cache inside the block (neither read nor written), e.g. to time a compile:
    a program found in the cache would time its loading instead. The cache is as before afterwards."""
    was_enabled = jax.config.jax_enable_compilation_cache
    _jax_cache.reset_cache()
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        _jax_cache.reset_cache()
        jax.config.update("jax_enable_compilation_cache", was_enabled)
