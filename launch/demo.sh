#!/usr/bin/env bash
# Set up .venv (if needed) and run the main job on built-in defaults.
source "$(dirname "$0")/_venv.sh"
.venv/bin/causal-lm info --config configs/small.py "$@"
