"""Shared test setup: float32 at the highest matmul precision, on CPU, with compiled functions reused."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# Compile time dominates this suite (hundreds of tiny programs), and XLA's CPU backend optimisations and fusion
# emitters triple it while the tests check properties (equalities, exact zeros), not speed. Both sides of every
# comparison, subprocesses included, compile with the same flags. CAUSAL_LM_TEST_OPTIMIZED=1 keeps the defaults.
if os.environ.get("CAUSAL_LM_TEST_OPTIMIZED") != "1":
    os.environ["XLA_FLAGS"] = " ".join(
        filter(
            None,
            [
                os.environ.get("XLA_FLAGS", ""),
                "--xla_backend_optimization_level=0",
                "--xla_cpu_use_fusion_emitters=false",
            ],
        )
    )

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def repo_root():
    return ROOT
