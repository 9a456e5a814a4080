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


# ---- glibc's heap on huge pages (causal_lm/malloc.py's huge_pages_env, applied by `causal-lm` re-executing) ----


def _plain_env() -> dict:
    """This environment without an allocator choice or glibc tunables, importing this checkout's package."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "CAUSAL_LM_MALLOC", "GLIBC_TUNABLES")}
    return env | {"PYTHONPATH": ROOT}


def test_huge_pages_env_applies_only_where_it_changes_something():
    from causal_lm.malloc import huge_pages_env

    base = {"PATH": "/usr/bin"}
    env = huge_pages_env(base, glibc=(2, 36), thp_mode="madvise")
    assert env == {"PATH": "/usr/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    # tunables already set are kept, the new one appended
    env = huge_pages_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, glibc=(2, 40), thp_mode="madvise")
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    # nothing to do: the kernel decides alone, has none, glibc is too old or absent, the user (or the re-exec
    # itself) already chose, or another allocator is in charge
    assert huge_pages_env(base, glibc=(2, 36), thp_mode="always") is None
    assert huge_pages_env(base, glibc=(2, 36), thp_mode="never") is None
    assert huge_pages_env(base, glibc=(2, 34), thp_mode="madvise") is None
    chosen_already = (
        "glibc.malloc.hugetlb=0",
        "glibc.malloc.hugetlb=1",
        "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=2",
    )
    for chosen in chosen_already:
        assert huge_pages_env({"GLIBC_TUNABLES": chosen}, glibc=(2, 36), thp_mode="madvise") is None
    other_allocators = (
        {"CAUSAL_LM_MALLOC": "system"},
        {"CAUSAL_LM_MALLOC": "/opt/lib.so"},
        {"LD_PRELOAD": "libjemalloc.so.2"},
    )
    for other in other_allocators:
        assert huge_pages_env(other, glibc=(2, 36), thp_mode="madvise") is None


# The command line as a user's `causal-lm --help` runs it (sys.argv[0] is the console script), printing its
# process ID and GLIBC_TUNABLES each time this code starts: once, or twice when `causal-lm` re-executes itself.
_REEXEC = """
import os, sys
print(os.getpid(), os.environ.get("GLIBC_TUNABLES"), flush=True)
sys.argv = ["causal-lm", "--help"]
from causal_lm.cli import main
sys.exit(main())
"""


@pytest.mark.parametrize("preset", [None, "glibc.malloc.hugetlb=0"])
def test_the_command_line_reexecutes_itself_once_with_huge_pages(preset):
    from causal_lm.malloc import huge_pages_env

    env = _plain_env()
    if preset:
        env["GLIBC_TUNABLES"] = preset
    proc = subprocess.run([sys.executable, "-c", _REEXEC], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    starts = [line.split() for line in proc.stdout.splitlines()[:2] if line.split()[:1] and line.split()[0].isdigit()]
    assert starts[0] == [starts[0][0], str(preset)]
    if huge_pages_env(env) is None:  # this machine or environment: nothing to gain, so no second start
        assert len(starts) == 1, proc.stdout
    else:  # the same process (a signal sent to it still reaches the command), now with the tunable, once
        assert [s[0] for s in starts] == [starts[0][0]] * 2 and starts[1][1] == "glibc.malloc.hugetlb=1", proc.stdout
    assert "usage: causal-lm" in proc.stdout


_HUGE = """
import ctypes
from causal_lm.malloc import keep_freed_memory
keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
p = libc.malloc(2**28)  # 256 MiB as XLA gets it (numpy would ask for huge pages itself), touched
ctypes.memset(p, 1, 2**28)
kib = [l.split()[1] for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages:")]
print(int(kib[0]) // 1024)
"""


def test_the_tunable_gives_the_heap_huge_pages():
    """What the re-exec is for, on this machine: a large block from malloc sits on 2 MiB pages."""
    from causal_lm.malloc import huge_pages_env

    env = _plain_env()
    tuned = huge_pages_env(env)
    if tuned is None or not os.path.exists("/proc/self/smaps_rollup"):
        pytest.skip("huge pages through glibc's tunable do not apply here (see causal_lm.malloc.huge_pages_env)")
    mib = [
        int(subprocess.run([sys.executable, "-c", _HUGE], env=e, capture_output=True, text=True, check=True).stdout)
        for e in (env, tuned)
    ]
    assert mib[1] >= 128 and mib[1] > mib[0] + 64, f"AnonHugePages without / with the tunable: {mib} MiB"
