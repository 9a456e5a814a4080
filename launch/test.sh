#!/usr/bin/env bash
# Set up .venv (if needed) with the test and serve extras (tests/test_server.py runs the server) and run the test suite. Extra arguments go to pytest.
source "$(dirname "$0")/_venv.sh" test,serve
# Whole test files run in parallel on one worker per core (pytest-xdist); `-n 0` runs everything in this process.
exec .venv/bin/python -m pytest -n auto --dist loadfile --no-loadscope-reorder "$@"
