#!/usr/bin/env bash
# Round 14 candidate (session 36): a second decoder layer grown from round 11 (starts as the identity), same data as round 13, a 400-step schedule (what fit the end of session 36).
set -euo pipefail
cd /work/main
export ANCHORSPEC_HOME=/root/.cache/anchorspec PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
exec anchorspec train --target smollm2-135m-instruct --data corpus/smollm2-135m-instruct \
  --out $ANCHORSPEC_HOME/runs/r36/r14-layers2-eagle3.1 --init-from checkpoints/smollm2-135m-instruct-eagle3.1 --revocab \
  --max-steps 400 --ttt-steps 4 --max-len 1024 --batch-tokens 2048 --lr 3e-4 --warmup-ratio 0.03 \
  --dtype bfloat16 --seed 0 --order-seed 14 --draft-layers 2 --eval-every 200 --save-every 25 --eval-prompts 4 --eval-new-tokens 64 \
  --threads 2 "$@"
