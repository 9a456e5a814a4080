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

Huge pages. Decoding streams every weight once per token, and with 4 KiB pages the processor's address
translation misses on nearly every page it streams; a 2 MiB transparent huge page covers 512 of them. Where the
kernel gives huge pages only to memory that asks for them (/sys/kernel/mm/transparent_hugepage/enabled reads
`madvise`, Debian's and Ubuntu's default), glibc (2.35 and newer) asks for them on its heap when started with the
tunable GLIBC_TUNABLES=glibc.malloc.hugetlb=1, which only a new process reads. `huge_pages_env()` says whether
that applies and gives the environment; `causal-lm` re-executes itself with it once at start-up (the same
process ID, before anything is imported or allocated: `causal_lm.cli.main`). Measured on the 135M batch-1
decode step: 5-8% faster (docs/performance.md). A program that imports causal_lm gets the same by starting
Python with the variable set.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

ENV = "CAUSAL_LM_MALLOC"
TUNABLE = "glibc.malloc.hugetlb"
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_MAX = -4
_TRIM_NEVER = -1

_state: str | None = None


def _choice(environ) -> str:
    """ "system", "preloaded" or "glibc": which allocator a process with this environment is left to (the rules
    above)."""
    preload = environ.get("LD_PRELOAD", "")
    choice = environ.get(ENV, "auto").strip()
    if choice.lower() == "system":
        return "system"
    if choice.lower() not in ("auto", "") or "tcmalloc" in preload or "jemalloc" in preload:
        return "preloaded"  # launch/_malloc.sh preloaded CAUSAL_LM_MALLOC=PATH, or tcmalloc / jemalloc
    return "glibc"


def _glibc_version() -> tuple[int, int] | None:
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # "glibc 2.36"; absent off glibc
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (AttributeError, OSError, ValueError):
        return None


def _thp_mode(path: str = THP_MODE) -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), or None where there is none."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def huge_pages_env(environ=None, *, glibc=None, thp_mode=None) -> dict | None:
    """The environment that gives this process's heap huge pages (`environ` plus glibc.malloc.hugetlb=1 in
    GLIBC_TUNABLES), or None where it would change nothing: not glibc 2.35+, the kernel's huge page mode is not
    `madvise` (`always` gives them anyway, `never` not at all), glibc is not the allocator (CAUSAL_LM_MALLOC=system
    or a preloaded one), or GLIBC_TUNABLES already names the tunable (set by the user, or by the re-exec itself:
    so it happens once). `glibc` and `thp_mode` override what is read from this machine (for tests)."""
    environ = dict(os.environ if environ is None else environ)
    glibc = _glibc_version() if glibc is None else glibc
    thp_mode = _thp_mode() if thp_mode is None else thp_mode
    tunables = environ.get("GLIBC_TUNABLES", "")
    if glibc is None or glibc < (2, 35) or thp_mode != "madvise" or TUNABLE in tunables:
        return None
    if _choice(environ) != "glibc":
        return None
    environ["GLIBC_TUNABLES"] = f"{tunables}:{TUNABLE}=1" if tunables else f"{TUNABLE}=1"
    return environ


def keep_freed_memory() -> str:
    """Set glibc's malloc to keep freed memory (see the module docstring), once per process.

    Returns what holds: "glibc" (set now or earlier), "preloaded" (LD_PRELOAD names another allocator),
    "system" (CAUSAL_LM_MALLOC=system: glibc's defaults kept) or "unavailable" (not glibc, or mallopt refused)."""
    global _state
    if _state is not None:
        return _state
    _state = _choice(os.environ)
    if _state == "glibc" and not _mallopt():
        _state = "unavailable"
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
