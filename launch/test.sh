#!/usr/bin/env bash
# Set up .venv (if needed) with the test extra and run the test suite. Extra arguments go to pytest.
source "$(dirname "$0")/_venv.sh" test
exec .venv/bin/python -m pytest "$@"
