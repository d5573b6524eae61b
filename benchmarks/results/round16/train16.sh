#!/usr/bin/env bash
# Round 16 (prepared in session 38): is the plateau capacity? Round 15's run exactly (from round 11, the mapped
# --revocab, lr 3e-4, 1,000 steps, 2 threads, the same corpus parts 0000-0019 and batch order --order-seed 15)
# with a second decoder layer grown from round 11 (it starts as the identity), so that against round 15 only
# the layer count differs. Round 14 grew the same layer for 400 steps only. Evaluate against round 11 with
#   NAME=r16 DIR=$ANCHORSPEC_HOME/runs/r16-layers2-eagle3.1/final OUT=benchmarks/results/round16 \
#     STAGE=categories bash benchmarks/results/round15/eval.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
export ANCHORSPEC_HOME=${ANCHORSPEC_HOME:-$HOME/.cache/anchorspec} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
exec anchorspec train --target smollm2-135m-instruct --data corpus/smollm2-135m-instruct \
  --out $ANCHORSPEC_HOME/runs/r16-layers2-eagle3.1 --init-from checkpoints/smollm2-135m-instruct-eagle3.1 --revocab \
  --max-steps 1000 --ttt-steps 4 --max-len 1024 --batch-tokens 2048 --lr 3e-4 --warmup-ratio 0.03 \
  --dtype bfloat16 --seed 0 --order-seed 15 --draft-layers 2 --eval-every 500 --save-every 25 --eval-prompts 4 \
  --eval-new-tokens 64 --threads 2 "$@"
