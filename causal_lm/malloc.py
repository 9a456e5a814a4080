"""Freed memory kept for reuse: glibc's malloc told, from inside the process, not to hand large blocks back.

XLA:CPU allocates a program's temporaries afresh on every call (a 135M training step: 6 GB; a 135M `generate`
call: the decode loop's copy of the layers' weights, 425 MB, and the cache). glibc's malloc serves every block
over its mmap threshold (at most 32 MiB) with a fresh `mmap` and unmaps it on free, so the kernel zero-fills
those pages again on the next call: measurable time on a CPU (docs/performance.md). tcmalloc and jemalloc keep
freed memory, which is what `launch/_malloc.sh` preloads when one is installed; a process started without them
gets the same effect from glibc with two `mallopt` settings, made here at start-up:

    M_MMAP_MAX = 0            no block is served by mmap: large ones come from the heap too
    M_TRIM_THRESHOLD = -1     the heap's free top is never handed back to the kernel (mallopt(3): -1 turns
                              trimming off)

The cost is the usual one of such allocators: the process keeps its peak footprint until it exits.

`causal-lm` calls `keep_freed_memory()` before it runs a command. CAUSAL_LM_MALLOC=system leaves glibc's
defaults alone (the same switch as launch/_malloc.sh); a preloaded allocator (LD_PRELOAD naming tcmalloc or
jemalloc, or CAUSAL_LM_MALLOC=PATH, which launch/_malloc.sh preloads) is left to do the job.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

ENV = "CAUSAL_LM_MALLOC"
M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_MAX = -4
_TRIM_NEVER = -1

_state: str | None = None


def keep_freed_memory() -> str:
    """Set glibc's malloc to keep freed memory (see the module docstring), once per process.

    Returns what holds: "glibc" (set now or earlier), "preloaded" (LD_PRELOAD names another allocator),
    "system" (CAUSAL_LM_MALLOC=system: glibc's defaults kept) or "unavailable" (not glibc, or mallopt refused)."""
    global _state
    if _state is not None:
        return _state
    preload = os.environ.get("LD_PRELOAD", "")
    choice = os.environ.get(ENV, "auto").strip()
    if choice.lower() == "system":
        _state = "system"
    elif choice.lower() not in ("auto", "") or "tcmalloc" in preload or "jemalloc" in preload:
        _state = "preloaded"  # launch/_malloc.sh preloaded CAUSAL_LM_MALLOC=PATH, or tcmalloc / jemalloc
    else:
        _state = "glibc" if _mallopt() else "unavailable"
    return _state


def _mallopt() -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt; macOS has none)
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, _TRIM_NEVER))
