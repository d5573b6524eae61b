#!/usr/bin/env bash
# Session 66: EAGLE-3.1 round 23, the first round to see corpus parts 0032-0036 (session 65's 6,999 greedy answers to
# writing/stem/humanities/roleplay-steered Magpie queries, 1.79M tokens), mixed with ShareGPT part 0004 so code and
# maths stay in view. From the release (round 22), 600 steps at peak lr 1e-4 (the rate that moved round 22; 3e-4
# rounds on the old corpus ended level), the release's draft vocabulary (REVOCAB=), order seed 66, 1,024 positions.
# Question: does data the drafter never saw move MT-bench where more passes over the old corpus did not?
# Extra args go to `anchorspec train` (this host: --threads 1 --dtype bfloat16 beside a regeneration job).
set -euo pipefail
cd "$(dirname "$0")/../../.."
R=${ANCHORSPEC_HOME:-$HOME/.cache/anchorspec}/runs/smollm2-135m-instruct
mkdir -p "$R/r23-subset"
for p in 0004 0032 0033 0034 0035 0036; do
  for ext in npz json; do ln -sf "$PWD/corpus/smollm2-135m-instruct/part-$p.$ext" "$R/r23-subset/part-$p.$ext"; done
done
REVOCAB= VARIANT=eagle3.1 STEPS=600 LR=1e-4 bash benchmarks/cpu_round.sh train 23 --data "$R/r23-subset" \
  --order-seed 66 --save-every 50 --no-progress "$@"
