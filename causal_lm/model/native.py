"""CPU kernels written in C++ against XLA's FFI, compiled on first use with the machine's own C++ compiler.

XLA:CPU has no fast form of two products that decoding is made of: a matrix-vector product that reads its weights at
the machine's bandwidth (float32, int8 or int4 weights), and attention over a paged cache read in place. The
kernels for them live in `csrc/*.cc`; `library(name)` compiles `csrc/<name>.cc` into a shared library once per
machine (cached under `$XDG_CACHE_HOME/causal_lm/native`, keyed by the source and the headers beside it, the flags,
the compiler, jaxlib and the CPU), loads it (RTLD_GLOBAL: the libraries share the pool helpers of `csrc/parallel.h`)
and registers its handlers with XLA as FFI targets for the CPU platform. Callers use
`jax.ffi.ffi_call(target, ...)` under `jax.jit` like any other operation, on CPU only; other platforms keep the XLA
form.

`CAUSAL_LM_NATIVE_FLAGS` adds compiler flags after the default ones (part of the cache key), e.g. `-mno-avx512f` builds
the AVX2 form of the kernels on a CPU with AVX-512, to compare the two or to test the AVX2 path there.

`available()` says whether the kernels can be used here: a compiler (`$CXX`, else `g++` or `c++`) was found, the
library built, and `CAUSAL_LM_NATIVE` is not `0`. When a kernel is unavailable the callers fall back to the XLA form
(the same values up to summation order), so nothing requires a compiler; the tests assert the kernels built on the
machines that have one.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax

ENV = "CAUSAL_LM_NATIVE"
FLAGS_ENV = "CAUSAL_LM_NATIVE_FLAGS"
SOURCES = Path(__file__).resolve().parent / "csrc"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-Wall")
_lock = threading.Lock()
_failures: dict = {}


class NativeError(RuntimeError):
    """A kernel library could not be built or loaded."""


def enabled() -> bool:
    """False when `CAUSAL_LM_NATIVE=0` (or off/false/no) turns the C++ kernels off."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def compiler() -> str | None:
    """The C++ compiler to build with: `$CXX`, else g++, else c++ (None: none found)."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def flags() -> tuple:
    """The compiler flags: the defaults, then `$CAUSAL_LM_NATIVE_FLAGS` (split as a shell would)."""
    return FLAGS + tuple(shlex.split(os.environ.get(FLAGS_ENV, "")))


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "causal_lm" / "native"


def _cpu_key() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(lines)))


def _build(name: str, cxx: str) -> Path:
    source = SOURCES / f"{name}.cc"
    if not source.is_file():
        raise NativeError(f"no kernel source {source}")
    include = jax.ffi.include_dir()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256()
    headers = b"".join(h.read_bytes() for h in sorted(SOURCES.glob("*.h")))  # what the sources include
    parts = (source.read_bytes(), headers, " ".join(flags()).encode(), str(version).encode(), jax.__version__.encode())
    for part in parts:
        key.update(part)
        key.update(b"\0")
    key.update(_cpu_key().encode())
    target = cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # concurrent builders each rename a whole file
        out = Path(tmp) / target.name
        cmd = [cxx, *flags(), f"-I{include}", str(source), "-o", str(out)]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            raise NativeError(f"building {source.name} failed ({' '.join(cmd)}):\n{run.stderr[-4000:]}")
        os.replace(out, target)
    return target


@functools.cache
def _load(name: str):
    cxx = compiler()
    if cxx is None:
        raise NativeError("no C++ compiler found ($CXX, g++ or c++)")
    # RTLD_GLOBAL: the libraries share one set of pool helpers (csrc/parallel.h)
    return ctypes.CDLL(str(_build(name, cxx)), mode=ctypes.RTLD_GLOBAL)


_registered: set = set()


def library(name: str, targets: tuple = ()):
    """Build (once) and load `csrc/<name>.cc`; register each handler symbol in `targets` as the CPU FFI target of
    the same name. Raises NativeError when it cannot."""
    with _lock:
        lib = _load(name)
        for symbol in targets:
            if symbol not in _registered:
                jax.ffi.register_ffi_target(symbol, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
                _registered.add(symbol)
        return lib


def available(name: str, targets: tuple = ()) -> bool:
    """Whether the kernels of `csrc/<name>.cc` can be used in this process (built, loaded, registered, enabled).
    A build failure is remembered (and its message kept in `failure(name)`), not retried."""
    if not enabled():
        return False
    if name in _failures:
        return False
    try:
        library(name, targets)
    except (NativeError, OSError, AttributeError) as e:
        _failures[name] = str(e)
        return False
    return True


def failure(name: str) -> str | None:
    """Why `csrc/<name>.cc` is unavailable, if it failed to build or load."""
    return _failures.get(name)


def on_cpu() -> bool:
    """Whether the default backend is the CPU (the kernels exist only there)."""
    return jax.default_backend() == "cpu"
