"""A mutation check: introduce one realistic bug at a time into a copy of the repository and run the tests that
should catch it. A surviving mutant is a bug the suite would let through.

    ./launch/mutation.sh                 every mutant in tests/mutants.py
    ./launch/mutation.sh rope-sign cache-slot-late    only these
    ./launch/mutation.sh --list          the mutants and the tests each one runs

A mutant of code that only some CPUs compile (the C++ kernels' AVX-512 paths) names the CPU feature it needs
(`cpu="avx512f"`); on a CPU without it the mutant is listed as not run here, and not counted.

Each mutant replaces one exact snippet of one file (it must occur exactly once, so a mutant that no longer applies
after the code changed is reported, not silently skipped), in a fresh copy of the tracked files; its tests run
with `pytest -x` against that copy. Prints caught / survived / does-not-apply per mutant and the score, and exits
non-zero unless every mutant is caught.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from mutants import MUTANTS  # noqa: E402


def copy_tracked(dest: str) -> None:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        src = os.path.join(ROOT, rel)
        if not os.path.isfile(src):
            continue
        os.makedirs(os.path.dirname(os.path.join(dest, rel)) or dest, exist_ok=True)
        shutil.copy2(src, os.path.join(dest, rel))


def apply(copy: str, mutant: dict) -> str | None:
    """Apply the mutant to the copy; returns why it does not apply, or None."""
    path = os.path.join(copy, mutant["file"])
    with open(path) as f:
        text = f.read()
    n = text.count(mutant["old"])
    if n != 1:
        return f"the snippet occurs {n} times in {mutant['file']} (expected once)"
    with open(path, "w") as f:
        f.write(text.replace(mutant["old"], mutant["new"]))
    return None


def cpu_flags() -> set:
    """The CPU's feature flags (/proc/cpuinfo), empty where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return set()
    return {flag for ln in lines if ln.startswith("flags") for flag in ln.split(":", 1)[1].split()}


def run_one(mutant: dict, python: str) -> tuple[str, float, str]:
    if mutant.get("cpu") and mutant["cpu"] not in cpu_flags():
        # code compiled only for CPUs with this feature (csrc/ builds with -march=native): not here
        return "needs " + mutant["cpu"], 0.0, "this CPU does not compile the mutated code; run it on one that does"
    with tempfile.TemporaryDirectory(prefix="mutant-") as tmp:
        copy_tracked(tmp)
        why = apply(tmp, mutant)
        if why:
            return "does not apply", 0.0, why
        env = dict(os.environ, PYTHONPATH=tmp, CAUSAL_LM_COMPILATION_CACHE="off")
        cmd = [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *mutant["tests"]]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
        dt = time.perf_counter() - t0
        last = (proc.stdout.strip().splitlines() or [""])[-1]
        # pytest: 1 = tests failed, 2 = interrupted (e.g. the mutant breaks an import); 4 and 5 (usage error, no
        # tests collected) mean the selection is wrong, not that the mutant was caught.
        if proc.returncode in (1, 2):
            return "caught", dt, last
        return ("survived" if proc.returncode == 0 else "error"), dt, last


def check_selections(mutants: list, python: str) -> list[str]:
    """The node ids that do not collect in the unmutated repository (a typo would otherwise count as caught)."""
    ids = sorted({t for m in mutants for t in m["tests"]})
    env = dict(os.environ, PYTHONPATH=ROOT)
    cmd = [python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *ids]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode == 0:
        return []
    return [t for t in ids if t not in proc.stdout] or [proc.stdout.strip().splitlines()[-1]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", help="run only these mutants")
    p.add_argument("--list", action="store_true", help="list the mutants and their tests")
    args = p.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.names or m["name"] in args.names]
    unknown = set(args.names) - {m["name"] for m in MUTANTS}
    if unknown:
        print(f"error: unknown mutants {sorted(unknown)}; --list shows them", file=sys.stderr)
        return 2
    if args.list:
        for m in chosen:
            print(f"{m['name']:32s} {m['file']}: {m['why']}\n{'':32s} tests: {' '.join(m['tests'])}")
        return 0
    python = sys.executable  # the launcher's: the repository's .venv, or MUTATION_PYTHON
    missing = check_selections(chosen, python)
    if missing:
        print("error: these test selections do not collect: " + ", ".join(missing), file=sys.stderr)
        return 2
    results, t_start = [], time.perf_counter()
    for m in chosen:
        outcome, dt, detail = run_one(m, python)
        results.append((m["name"], outcome))
        print(f"{outcome:>14s}  {m['name']:32s} {dt:6.0f} s  {detail}", flush=True)
    caught = sum(1 for _, o in results if o == "caught")
    elsewhere = [n for n, o in results if o.startswith("needs ")]
    total = time.perf_counter() - t_start
    print(f"\nmutation score: {caught}/{len(results) - len(elsewhere)} caught in {total / 60:.1f} min")
    if elsewhere:
        print(f"not run on this CPU ({len(elsewhere)}): " + ", ".join(elsewhere))
    bad = [n for n, o in results if o != "caught" and n not in elsewhere]
    if bad:
        print("not caught: " + ", ".join(bad))
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
