#!/usr/bin/env bash
# The mutation check (see launch/mutation.py): one realistic bug at a time in a copy of the repository, each run
# against the tests that should catch it. Slow (about a minute per mutant on 2 cores), so not part of CI.
# Usage: ./launch/mutation.sh [MUTANT ...] [--list]
# MUTATION_PYTHON=/path/to/python runs with an existing environment instead of the repository's own .venv (e.g. a
# git worktree sharing the main checkout's environment).
if [ -n "${MUTATION_PYTHON:-}" ]; then
  cd "$(dirname "$0")/.."
  exec "$MUTATION_PYTHON" launch/mutation.py "$@"
fi
source "$(dirname "$0")/_venv.sh" test,interop,serve  # interop: safetensors (Hugging Face mutants); serve: the server
exec .venv/bin/python launch/mutation.py "$@"
