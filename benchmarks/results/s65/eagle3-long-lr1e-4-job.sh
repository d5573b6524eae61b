#!/usr/bin/env bash
# Session 65: EAGLE-3's counterpart of EAGLE-3.1 round 22 (session 62's long-r3-job.sh with --variant eagle3,
# from the EAGLE-3 release): the same data (greedy parts 0004, 0012, 0020, 0028 + the long parts), 150 steps at
# lr 1e-4, order seed 62, 30 % of conversations chained to 4,096 tokens. Run eagle3-r20; with it, EAGLE-3.1 / EAGLE-3
# on long context compares drafters with the same training (issue 12's >= 1.10x).
# Extra args go to `anchorspec train` (e.g. --threads 1 --dtype bfloat16 on an AVX-512-bf16 host).
set -euo pipefail
cd "$(dirname "$0")/../../.."
R=${ANCHORSPEC_HOME:-$HOME/.cache/anchorspec}/runs/smollm2-135m-instruct
mkdir -p "$R/long-r2/subset"
for p in 0004 0012 0020 0028; do
  for ext in npz json; do ln -sf "$PWD/corpus/smollm2-135m-instruct/part-$p.$ext" "$R/long-r2/subset/part-$p.$ext"; done
done
anchorspec train --target smollm2-135m-instruct --data "$R/long-r2/subset" corpus/smollm2-135m-instruct-long --variant eagle3 \
  --init-from checkpoints/smollm2-135m-instruct-eagle3 --order-seed 62 \
  --max-steps 150 --lr 1e-4 --warmup-ratio 0.03 --ttt-steps 4 --batch-tokens 4096 --max-len 4096 \
  --join-to 4096 --join-share 0.3 --heldout 0.02 --eval-every 100000 \
  --eval-heldout 48 --eval-replay 4 --eval-prompts 0 --save-every 25 --no-progress --out "$R/eagle3-r20" "$@"
