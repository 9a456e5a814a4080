#!/usr/bin/env bash
# Train on a Cloud TPU VM slice: create the slice (or reuse the one with that name), copy this working tree to
# every worker and install it there, then run the same `causal-lm train` on every worker. The workers find each
# other through `jax.distributed.initialize()` (`causal-lm train --distributed`); only worker 0 writes logs.
#
#   launch/tpu_vm.sh [options] [-- TRAIN ARGS]
#     --name NAME        slice name (default: $TPU_NAME or causal-lm)
#     --zone ZONE        (default: $ZONE or us-central2-b)
#     --type TYPE        accelerator type (default: $ACCELERATOR_TYPE or v4-32, i.e. 4 workers x 4 chips)
#     --version VERSION  TPU VM software version (default: $TPU_VERSION or tpu-ubuntu2204-base)
#     --project PROJECT  (default: $PROJECT or gcloud's configured project)
#     --spot             create a Spot slice
#     --bucket BUCKET    mount gs://BUCKET at ~/gcs on every worker (gcsfuse); the default workdir goes there.
#                        A slice with more than one worker needs a workdir all workers see: orbax writes each
#                        worker's shards of a checkpoint into the same directory.
#     --dry-run          print the commands instead of running them (also: DRY_RUN=1)
#   TRAIN ARGS go to `causal-lm train` (default: --config small --workdir ~/gcs/runs/NAME, or runs/NAME
#   without --bucket), e.g.  -- --config small --workdir ~/gcs/runs/small mesh.fsdp=4 train.steps=2000
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

NAME="${TPU_NAME:-causal-lm}"
ZONE="${ZONE:-us-central2-b}"
TYPE="${ACCELERATOR_TYPE:-v4-32}"
VERSION="${TPU_VERSION:-tpu-ubuntu2204-base}"
PROJECT="${PROJECT:-}"
BUCKET="${BUCKET:-}"
SPOT=""
DRY_RUN="${DRY_RUN:-0}"
TRAIN_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --name) NAME="$2"; shift 2 ;;
    --zone) ZONE="$2"; shift 2 ;;
    --type) TYPE="$2"; shift 2 ;;
    --version) VERSION="$2"; shift 2 ;;
    --project) PROJECT="$2"; shift 2 ;;
    --bucket) BUCKET="$2"; shift 2 ;;
    --spot) SPOT="--spot"; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    --) shift; TRAIN_ARGS=("$@"); break ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "tpu_vm.sh: unknown option $1 (train arguments go after --)" >&2; exit 2 ;;
  esac
done
if [ ${#TRAIN_ARGS[@]} -eq 0 ]; then
  if [ -n "$BUCKET" ]; then TRAIN_ARGS=(--config small --workdir "~/gcs/runs/$NAME")
  else TRAIN_ARGS=(--config small --workdir "runs/$NAME"); fi
fi

GCLOUD=(gcloud compute tpus tpu-vm)
WHERE=(--zone "$ZONE")
[ -n "$PROJECT" ] && WHERE+=(--project "$PROJECT")
REMOTE_DIR="causal_lm"
TARBALL="${TMPDIR:-/tmp}/causal_lm-$NAME.tar.gz"

quote() {  # an argument as the shell reads it back: bare when plain, else in single quotes
  case "$1" in
    ''|*[!A-Za-z0-9_./:=,@%+-]*) printf "'%s'" "${1//\'/\'\\\'\'}" ;;
    *) printf '%s' "$1" ;;
  esac
}
run() {
  if [ "$DRY_RUN" = "1" ]; then
    printf '+'; for a in "$@"; do printf ' '; quote "$a"; done; printf '\n'
  else
    "$@"
  fi
}

# 1. The slice: reuse it when it exists, create it otherwise.
if [ "$DRY_RUN" = "1" ]; then
  echo "# reuse the slice if this succeeds:"
  run "${GCLOUD[@]}" describe "$NAME" "${WHERE[@]}"
  echo "# otherwise create it:"
  run "${GCLOUD[@]}" create "$NAME" "${WHERE[@]}" --accelerator-type "$TYPE" --version "$VERSION" ${SPOT:+"$SPOT"}
elif "${GCLOUD[@]}" describe "$NAME" "${WHERE[@]}" >/dev/null 2>&1; then
  echo "[tpu_vm] reusing TPU VM $NAME in $ZONE"
else
  echo "[tpu_vm] creating TPU VM $NAME ($TYPE, $VERSION) in $ZONE"
  run "${GCLOUD[@]}" create "$NAME" "${WHERE[@]}" --accelerator-type "$TYPE" --version "$VERSION" ${SPOT:+"$SPOT"}
fi

# 2. This working tree (committed or not, without .venv, runs and .git) onto every worker, installed with the
#    tpu extra (jax[tpu]).
run tar -czf "$TARBALL" -C "$ROOT" --exclude=./.venv --exclude=./runs --exclude=./.git .
run "${GCLOUD[@]}" scp "$TARBALL" "$NAME:~/causal_lm.tar.gz" --worker=all "${WHERE[@]}"
INSTALL="rm -rf ~/$REMOTE_DIR && mkdir -p ~/$REMOTE_DIR && tar -xzf ~/causal_lm.tar.gz -C ~/$REMOTE_DIR"
INSTALL+=" && cd ~/$REMOTE_DIR && python3 -m venv .venv && .venv/bin/pip install -q --upgrade pip"
INSTALL+=" && .venv/bin/pip install -q -e \".[tpu]\""
if [ -n "$BUCKET" ]; then
  INSTALL+=" && (command -v gcsfuse >/dev/null || (curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg"
  INSTALL+=" | sudo tee /usr/share/keyrings/cloud.google.asc >/dev/null && echo \"deb [signed-by=/usr/share/keyrings/cloud.google.asc]"
  INSTALL+=" https://packages.cloud.google.com/apt gcsfuse-\$(lsb_release -cs) main\" | sudo tee /etc/apt/sources.list.d/gcsfuse.list"
  INSTALL+=" && sudo apt-get update -q && sudo apt-get install -y -q gcsfuse))"
  INSTALL+=" && mkdir -p ~/gcs && (mountpoint -q ~/gcs || gcsfuse --implicit-dirs $BUCKET ~/gcs)"
fi
run "${GCLOUD[@]}" ssh "$NAME" --worker=all "${WHERE[@]}" --command "$INSTALL"

# 3. The same training command on every worker, at the same time.
TRAIN="cd ~/$REMOTE_DIR && .venv/bin/causal-lm train --distributed"
for a in "${TRAIN_ARGS[@]}"; do TRAIN+=" $(printf '%q' "$a" | sed 's/^\\~/~/')"; done
run "${GCLOUD[@]}" ssh "$NAME" --worker=all "${WHERE[@]}" --command "$TRAIN"
if [ "$DRY_RUN" = "1" ]; then
  echo "# dry run: nothing was created, copied or started"
else
  echo "[tpu_vm] done; delete the slice with: ${GCLOUD[*]} delete $NAME ${WHERE[*]}"
fi
