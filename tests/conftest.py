"""Shared test setup: float32 at the highest matmul precision, on CPU, with compiled functions reused."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# Hugging Face libraries never reach for the hub (the machines have no network; every reference model is built
# here), and keep their progress bars and warnings out of the test output.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# Compile time dominates this suite (hundreds of tiny programs), and XLA's CPU backend optimisations and fusion
# emitters triple it while the tests check properties (equalities, exact zeros), not speed. XLA:CPU also splits each
# program's code generation into parallel parts, which costs CPU time (about 13% of a compile-bound grid, measured)
# and gains nothing when every core already runs a test worker. Both sides of every comparison, subprocesses
# included, compile with the same flags. CAUSAL_LM_TEST_OPTIMIZED=1 keeps the defaults.
if os.environ.get("CAUSAL_LM_TEST_OPTIMIZED") != "1":
    os.environ["XLA_FLAGS"] = " ".join(
        filter(
            None,
            [
                os.environ.get("XLA_FLAGS", ""),
                "--xla_backend_optimization_level=0",
                "--xla_cpu_use_fusion_emitters=false",
                "--xla_cpu_parallel_codegen_split_count=1",
            ],
        )
    )

# The CLI's persistent compilation cache (on by default, in the user's cache folder): the suite's `causal-lm` calls,
# in this process and in subprocesses, share one folder of its own that is deleted at the end.
if "CAUSAL_LM_COMPILATION_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _jax_cache = tempfile.mkdtemp(prefix="causal_lm_tests_jax_cache_")
    os.environ["CAUSAL_LM_COMPILATION_CACHE"] = _jax_cache
    atexit.register(shutil.rmtree, _jax_cache, ignore_errors=True)

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# The test processes use that cache too, from their first compile, as `causal-lm` would: a program compiled by one
# test module, by the other worker or by a `causal-lm` subprocess (a killed training child, say) is loaded, not
# compiled again, after the module's compiled programs are released (below). Without this the cache came on in a
# worker at its first in-process `causal-lm` call, so what a test compiled depended on which tests ran before it.
from causal_lm import compile_cache  # noqa: E402

compile_cache.enable()  # CAUSAL_LM_COMPILATION_CACHE=off turns it off here too

import gc  # noqa: E402

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Property tests draw the same examples on every run, here and in CI (hypothesis would otherwise draw new ones each
# run, and derandomize only where it detects CI): a bug they miss is missed every time, so the boundary cases are
# pinned with @example instead of left to luck, and a failure reproduces. No example database either (derandomize
# implies none): a failure saved by one run would make the next run differ. `--hypothesis-profile=default` draws
# at random again, for a hunt.
settings.register_profile(
    "causal_lm",
    derandomize=True,
    database=None,
    deadline=None,  # the first example compiles: seconds
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("causal_lm")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def repo_root():
    return ROOT


MAPS_LIMIT = 30_000  # well below the kernel's default vm.max_map_count of 65,530


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: no such limit to watch
        return 0


def _release():
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs_per_module():
    """Drop every compiled program when a test module is done (modules share none).

    XLA:CPU maps each compiled executable's code and data into the process; a whole suite in one process compiles
    thousands, and past the kernel's limit on memory mappings (vm.max_map_count, 65,530 by default) the next compile
    crashes the process with a segmentation fault. Clearing JAX's caches lets the executables be freed."""
    yield
    _release()


@pytest.fixture(autouse=True)
def _release_compiled_programs_when_many():
    """The same within a module that compiles very many programs (eager kernels, the variant grids): when the
    process holds more than MAPS_LIMIT mappings after a test."""
    yield
    if _memory_maps() > MAPS_LIMIT:
        _release()


# Files first in the run, slowest first: `./launch/test.sh` runs whole files on two or more workers (pytest-xdist,
# --dist loadfile, in this order), and the commands of the README and docs/ (one module per group of pages,
# tests/doc_commands.py), a third of the suite, would otherwise start last and run alone at the end.
# The most expensive files first (CPU seconds, CAUSAL_LM_TEST_CPU on a busy 2-core Zen 4), so that with
# `--dist loadfile` no long file starts last while the other worker idles; test_parallel also starts its background
# training processes at once.
SLOW_FILES_FIRST = (
    "test_parallel.py",  # 139
    "test_experiments.py",  # 217
    "test_cache.py",  # 209
    "test_optimizers.py",  # 147
    "test_docs_interop.py",  # ~75 since the docs groups run in one process
    "test_model.py",  # 108
    "test_docs_training.py",  # ~70
    "test_kernels.py",  # 100
    "test_docs_experiments.py",
    "test_post_training.py",
    "test_train.py",  # 81
    "test_kv_memory.py",  # 81
    "test_speculative.py",  # 72 since the grid is a covering array
    "test_reliability.py",  # 73
    "test_bench.py",  # 71
    "test_docs_performance.py",  # ~55
    "test_engine.py",
    "test_readme.py",  # ~50
    "test_server.py",  # 46
    "test_docs_kv_cache.py",  # ~75
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order


# CAUSAL_LM_TEST_CPU=FILE appends one line per test: CPU seconds (this process and the subprocesses it waited for,
# setup to teardown), wall seconds, node id. CPU time, unlike --durations' wall time, does not grow when the machine
# is busy, so it says where the suite's time goes even on a loaded machine (sort -rn FILE | head).
_CPU_LOG = os.environ.get("CAUSAL_LM_TEST_CPU")
if _CPU_LOG:
    import resource
    import time

    def _cpu_seconds() -> float:
        total = 0.0
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
            r = resource.getrusage(who)
            total += r.ru_utime + r.ru_stime
        return total

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        cpu, wall = _cpu_seconds(), time.perf_counter()
        yield
        with open(_CPU_LOG, "a") as f:
            f.write(f"{_cpu_seconds() - cpu:9.2f} {time.perf_counter() - wall:9.2f} {item.nodeid}\n")
