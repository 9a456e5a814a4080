# Sourced by the launch scripts as `source launch/_venv.sh EXTRAS` (EXTRAS: "base" for none, or a comma-separated
# list of the optional extras in pyproject.toml, e.g. "test,interop"). Creates .venv if missing and installs the
# package (editable) with those extras. Re-installs only when pyproject.toml changed since the last install or an
# extra is asked for that is not installed yet, so reruns start at once. pip's own output goes to
# .venv/install.log and is shown only when the install fails; the script then stops with pip's exit status.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
# Always an explicit argument: a sourced script without arguments would see the caller's ("train.steps=5").
EXTRAS="${1:?usage: source launch/_venv.sh base|EXTRA[,EXTRA...]}"
[ "$EXTRAS" = "base" ] && EXTRAS=""
for extra in ${EXTRAS//,/ }; do
  case "$extra" in
    test|interop|serve|gpu|tpu) ;;
    *) echo "[setup] unknown extra '$extra' (known: test, interop, serve, gpu, tpu)" >&2; exit 2 ;;
  esac
done
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "causal_lm needs Python >= 3.10 (found: $("$PY" --version 2>&1)); set PYTHON=/path/to/python3.x" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $("$PY" --version)"
  "$PY" -m venv .venv
fi
# The stamp lists the extras installed with the current pyproject.toml (one per line; "base" always).
STAMP=.venv/.installed
missing=""
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  rm -f "$STAMP"
  missing="${EXTRAS:-base}"
else
  for extra in ${EXTRAS//,/ }; do
    grep -qx "$extra" "$STAMP" || missing="$missing${missing:+,}$extra"
  done
fi
if [ -n "$missing" ]; then
  # Install every extra asked for now plus those already installed (one resolve, nothing dropped).
  want="$(printf '%s\n' ${EXTRAS//,/ } $( [ -f "$STAMP" ] && cat "$STAMP") | grep -vx base | sort -u | paste -sd, -)"
  echo "[setup] installing causal-lm${want:+[$want]} into .venv (first run takes a few minutes)"
  log=.venv/install.log
  if ! { .venv/bin/python -m pip install --upgrade pip && .venv/bin/python -m pip install -e ".${want:+[$want]}"; } \
      >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "[setup] pip install failed (full log: $log)" >&2
    exit 1
  fi
  .venv/bin/python -c "import causal_lm" || { echo "[setup] installed, but 'import causal_lm' fails" >&2; exit 1; }
  printf '%s\n' base ${want//,/ } >"$STAMP"
fi
