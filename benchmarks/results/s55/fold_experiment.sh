#!/usr/bin/env bash
# Session 55: does the EAGLE-3.1 release (117.8M token-steps), its fc_norm folded into fc, start EAGLE-3
# training better than the EAGLE-3 line (round 13)? Fold, then a short round from the fold with
# cpu_round.sh's recipe, held-out and replay evaluated at its start and end.
set -euo pipefail
cd "$(dirname "$0")/../../.."
HOME_DIR=${ANCHORSPEC_HOME:-$HOME/.cache/anchorspec}
FOLD=$HOME_DIR/runs/smollm2-135m-instruct/eagle3-fold31
python benchmarks/fold_eagle31_to_eagle3.py --drafter checkpoints/smollm2-135m-instruct-eagle3.1 \
  --data corpus/smollm2-135m-instruct --fit 96 --check 32 --threads 2 --out "$FOLD"
cp "$FOLD/fold.json" benchmarks/results/s55/fold.json
INIT=$FOLD RUN=$HOME_DIR/runs/smollm2-135m-instruct/eagle3-fold31-train STEPS=${STEPS:-300} \
  bash benchmarks/cpu_round.sh train 55 --eval-prompts 0 "$@"
