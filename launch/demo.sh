#!/usr/bin/env bash
# Set up .venv (if needed), train the small config on the built-in corpus (a few minutes on a laptop CPU, with a
# progress bar), then generate a sample from it with the KV cache and without, printing both speeds.
# Rerunning resumes training where it stopped (or skips it when done). Arguments are training config overrides,
# e.g. `./launch/demo.sh train.steps=100`; WORKDIR=DIR picks another run directory (default runs/demo).
source "$(dirname "$0")/_venv.sh" base
source "$(dirname "$0")/_malloc.sh"
WORKDIR="${WORKDIR:-runs/demo}"
.venv/bin/causal-lm train --config configs/small.py --workdir "$WORKDIR" "$@"
# The same seed samples the same tokens on both paths: the text should match, only the speed differs.
GEN=(--workdir "$WORKDIR" --prompt "The " --max-new-tokens 200 --temperature 0.7 --seed 0)
echo
echo "== generate with the KV cache (K/V computed once per token) =="
.venv/bin/causal-lm generate "${GEN[@]}"
echo
echo "== generate without a cache (the whole sequence recomputed every step) =="
.venv/bin/causal-lm generate "${GEN[@]}" --no-cache
echo
echo "metrics: $WORKDIR/metrics.jsonl; loss curves: .venv/bin/causal-lm plot --workdir $WORKDIR;" \
     "TensorBoard events: $WORKDIR/tb (pip install tensorboard; tensorboard --logdir $WORKDIR/tb)"
