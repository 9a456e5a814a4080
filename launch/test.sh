#!/usr/bin/env bash
# Set up .venv (if needed) with the test extra and run the test suite. Extra arguments go to pytest.
source "$(dirname "$0")/_venv.sh" test
# Whole test files run in parallel on one worker per core (pytest-xdist); `-n 0` runs everything in this process.
exec .venv/bin/python -m pytest -n auto --dist loadfile --no-loadscope-reorder "$@"
