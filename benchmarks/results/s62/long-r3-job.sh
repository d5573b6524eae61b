#!/usr/bin/env bash
# Session 62: is the short-prompt loss of the long-sequence round its peak learning rate? EAGLE-3.1 round 21's data,
# steps and seed (order-seed 62), at lr 1e-4 instead of 3e-4: run eagle3.1-r22. One process, 2 threads, on a quiet machine.
set -euo pipefail
cd /work/main
R=$HOME/.cache/anchorspec/runs/smollm2-135m-instruct
mkdir -p "$R/long-r2/subset"   # round 21's 4 greedy parts, as long-r2-job.sh links them
for p in 0004 0012 0020 0028; do
  for ext in npz json; do ln -sf /work/main/corpus/smollm2-135m-instruct/part-$p.$ext "$R/long-r2/subset/part-$p.$ext"; done
done
anchorspec train --target smollm2-135m-instruct --data "$R/long-r2/subset" corpus/smollm2-135m-instruct-long --variant eagle3.1 \
  --init-from checkpoints/smollm2-135m-instruct-eagle3.1 --order-seed 62 \
  --max-steps 150 --lr 1e-4 --warmup-ratio 0.03 --ttt-steps 4 --batch-tokens 4096 --max-len 4096 \
  --join-to 4096 --join-share 0.3 --dtype bfloat16 --threads 2 --heldout 0.02 --eval-every 100000 \
  --eval-heldout 48 --eval-replay 4 --eval-prompts 0 --save-every 25 --no-progress --out "$R/eagle3.1-r22" "$@"
