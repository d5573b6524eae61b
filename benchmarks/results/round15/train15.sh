#!/usr/bin/env bash
# Round 15 (prepared in session 37, to run once scripts/steered_magpie.sh has packed its parts): round 13's recipe
# (from round 11, mapped --revocab, lr 3e-4, 1,000 steps, 2 threads, online) on the corpus grown by the steered
# writing and stem Magpie parts, so that against round 13 only the data differs.
set -euo pipefail
cd "$(dirname "$0")/../../.."
export ANCHORSPEC_HOME=${ANCHORSPEC_HOME:-$HOME/.cache/anchorspec} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
exec anchorspec train --target smollm2-135m-instruct --data corpus/smollm2-135m-instruct \
  --out $ANCHORSPEC_HOME/runs/r15-steered-eagle3.1 --init-from checkpoints/smollm2-135m-instruct-eagle3.1 --revocab \
  --max-steps 1000 --ttt-steps 4 --max-len 1024 --batch-tokens 2048 --lr 3e-4 --warmup-ratio 0.03 \
  --dtype bfloat16 --seed 0 --order-seed 15 --eval-every 500 --save-every 25 --eval-prompts 4 --eval-new-tokens 64 \
  --threads 2 "$@"
