#!/usr/bin/env bash
# Round 13 (session 36, fresh AMD EPYC host: no feature cache, so online; 1,000 steps fit the session at 2 threads): from round 11, mapped --revocab, parts 0000-0018.
set -euo pipefail
cd /work/main
export ANCHORSPEC_HOME=/root/.cache/anchorspec PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
exec anchorspec train --target smollm2-135m-instruct --data corpus/smollm2-135m-instruct \
  --out $ANCHORSPEC_HOME/runs/r36/r13-eagle3.1 --init-from checkpoints/smollm2-135m-instruct-eagle3.1 --revocab \
  --max-steps 1000 --ttt-steps 4 --max-len 1024 --batch-tokens 2048 --lr 3e-4 --warmup-ratio 0.03 \
  --dtype bfloat16 --seed 0 --order-seed 13 --eval-every 500 --save-every 25 --eval-prompts 4 --eval-new-tokens 64 \
  --threads 2 "$@"
