"""launch/_malloc.sh: which allocator the launch scripts preload (CAUSAL_LM_MALLOC=auto|system|PATH)."""

import os
import subprocess

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
