"""launch/_malloc.sh: which allocator the launch scripts preload (CAUSAL_LM_MALLOC=auto|system|PATH)."""

import os
import platform
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CANDIDATES = [
    f"/usr/lib/{arch}-linux-gnu/{name}"
    for name in ("libtcmalloc_minimal.so.4", "libjemalloc.so.2")
    for arch in ("x86_64", "aarch64")
]


def _preload(**env):
    """(status, LD_PRELOAD after sourcing the script, stderr) under this environment."""
    full = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "CAUSAL_LM_MALLOC")}
    full.update(env)
    proc = subprocess.run(
        ["bash", "-c", 'source launch/_malloc.sh; echo "LD_PRELOAD=${LD_PRELOAD:-}"'],
        cwd=ROOT,
        env=full,
        capture_output=True,
        text=True,
    )
    out = proc.stdout.strip().splitlines()
    return proc.returncode, (out[-1].removeprefix("LD_PRELOAD=") if out else None), proc.stderr


def test_auto_preloads_the_first_installed_allocator_or_nothing():
    status, preload, err = _preload()
    installed = [c for c in CANDIDATES if os.access(c, os.R_OK)]
    # tcmalloc before jemalloc, whichever architecture directory holds it
    tc = [c for c in installed if "tcmalloc" in c]
    expected = (tc or installed or [""])[0]
    assert status == 0 and preload == expected
    assert ("[malloc]" in err) == bool(expected)


def test_system_an_explicit_library_and_an_existing_preload(tmp_path):
    assert _preload(CAUSAL_LM_MALLOC="system")[:2] == (0, "")
    lib = tmp_path / "libmine.so"
    lib.write_bytes(b"")
    status, preload, err = _preload(CAUSAL_LM_MALLOC=str(lib))
    assert (status, preload) == (0, str(lib)) and "[malloc] libmine.so" in err
    # A preload the user set is theirs: left as it is.
    assert _preload(LD_PRELOAD=str(lib), CAUSAL_LM_MALLOC="auto")[:2] == (0, str(lib))


@pytest.mark.parametrize("value", ["/no/such/lib.so", "tcmalloc"])
def test_a_missing_library_is_one_error_line_and_status_2(value):
    status, preload, err = _preload(CAUSAL_LM_MALLOC=value)
    assert status == 2 and preload is None
    assert err.strip().splitlines() == [
        f"error: CAUSAL_LM_MALLOC={value}: no such library (use auto, system or the path of a .so)"
    ]


# ---- glibc told to keep freed memory (causal_lm/malloc.py, called by `causal-lm` at start-up) -----------------

_KEPT = """
import os
import numpy as np
from causal_lm.malloc import keep_freed_memory
state = keep_freed_memory()
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
a = np.ones(2**25)  # 256 MiB, touched
held = rss()
del a
print(state, (held - rss()) // 2**20)
"""


def _returned_mib(**env):
    """(state, MiB the process handed back to the kernel when it freed a 256 MiB array) in a fresh process."""
    full = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "CAUSAL_LM_MALLOC")}
    full.update(env, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", _KEPT], env=full, capture_output=True, text=True, check=True)
    state, returned = proc.stdout.split()
    return state, int(returned)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or not os.path.exists("/proc/self/statm"), reason="glibc, Linux")
def test_glibc_keeps_freed_memory_for_the_next_allocation():
    """Freed memory stays in the process (the next step's temporaries reuse it, no page is zero-filled again);
    with glibc's defaults the same free hands it back to the kernel."""
    state, returned = _returned_mib()
    assert state == "glibc"
    assert returned < 16, f"{returned} MiB went back to the kernel"
    state, returned = _returned_mib(CAUSAL_LM_MALLOC="system")
    assert state == "system"
    assert returned > 200


def test_a_preloaded_allocator_is_left_to_do_the_job():
    # an installed one where there is one; else a name the loader cannot find (it says so on stderr and goes on)
    lib = next((c for c in CANDIDATES if os.access(c, os.R_OK)), "/nonexistent/libjemalloc.so.2")
    assert _returned_mib(LD_PRELOAD=lib)[0] == "preloaded"
    assert _returned_mib(CAUSAL_LM_MALLOC="/opt/lib/libmymalloc.so")[0] == "preloaded"  # what _malloc.sh preloaded
