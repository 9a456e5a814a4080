#!/usr/bin/env bash
# One short run that tells where this codebase stands on this machine's accelerator (under 5 minutes on a GPU):
# detects the platform (nvidia-smi: a GPU; /dev/accel* or /dev/vfio, or TPU_* variables: a TPU), installs the
# matching extra into .venv (gpu: jax[cuda12]; tpu: jax[tpu]; plus the test extra), then runs
# `python -m causal_lm.device_check`: the accelerator tests (pytest -m accelerator), `causal-lm bench train` at
# the GPT-2-small shape with MFU against the device's datasheet bf16 peak, `causal-lm bench decode` at batch
# 1/8/64 against the HBM-bandwidth floor, and one JSON summary (default runs/device_check/summary.json).
# Without an accelerator it says so and runs the same parts at a tiny shape on the CPU (exit status 0 if they
# work). Arguments go to causal_lm.device_check (--out FILE, --skip tests, KEY=VALUE overrides, --help).
#
# DEVICE_CHECK_PLATFORM=gpu|tpu|cpu overrides the detection. CAUSAL_LM_PYTHON=/path/to/python uses that
# interpreter as it is, without creating or installing .venv (a machine whose Python already has JAX for its
# accelerator, e.g. one with no network).
set -euo pipefail
cd "$(dirname "$0")/.."

detect() {
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    echo gpu
  elif compgen -G "/dev/accel*" >/dev/null || compgen -G "/dev/vfio/[0-9]*" >/dev/null \
      || [ -n "${TPU_ACCELERATOR_TYPE:-}${TPU_NAME:-}" ]; then
    echo tpu
  else
    echo cpu
  fi
}
PLATFORM="${DEVICE_CHECK_PLATFORM:-$(detect)}"
case "$PLATFORM" in
  gpu|tpu|cpu) ;;
  *) echo "device_check: error: DEVICE_CHECK_PLATFORM must be gpu, tpu or cpu, got '$PLATFORM'" >&2; exit 2 ;;
esac
echo "[device_check] platform: $PLATFORM"

if [ -n "${CAUSAL_LM_PYTHON:-}" ]; then
  PY="$CAUSAL_LM_PYTHON"
else
  if [ "$PLATFORM" = cpu ]; then
    source launch/_venv.sh test
  else
    source launch/_venv.sh "test,$PLATFORM"
  fi
  PY=.venv/bin/python
fi
exec "$PY" -m causal_lm.device_check --platform "$PLATFORM" "$@"
