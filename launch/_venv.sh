# Sourced by the launch scripts: create .venv if missing and install the package (editable) with the given
# extras. Re-installs only when pyproject.toml changed since the last install, so reruns start quickly.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "causal_lm needs Python >= 3.10 (found: $("$PY" --version 2>&1)); set PYTHON=/path/to/python3.x" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $("$PY" --version)"
  "$PY" -m venv .venv
fi
EXTRAS="${1:-}"
STAMP=".venv/.installed${EXTRAS:+-$EXTRAS}"
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  echo "[setup] installing causal-lm${EXTRAS:+[$EXTRAS]} into .venv (first run takes a few minutes)"
  .venv/bin/python -m pip install --quiet --upgrade pip 2>&1 | grep -v -i "warning" || true
  .venv/bin/python -m pip install --quiet -e ".${EXTRAS:+[$EXTRAS]}" 2>&1 | grep -v -i "warning" || true
  .venv/bin/python -c "import causal_lm" || { echo "[setup] install failed" >&2; exit 1; }
  touch "$STAMP"
fi
