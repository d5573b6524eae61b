#!/usr/bin/env bash
# Session 66: EAGLE-3.1 round 24, round 23's question with round 22's long sequences kept in the mix. Round 23 (600
# steps at 1,024 positions on the new steered parts) gained +0.02 on MT-bench and lost round 22's long-context gain
# (-0.10). Here: the release (round 22) + 400 steps at peak lr 1e-4 on steered parts 0032-0038, ShareGPT part 0004 and
# the long corpus, batches of 4,096 tokens at up to 4,096 positions, 30 % of conversations chained (round 22's
# settings), the release's vocabulary, order seed 67. 1.64M token-steps: more than a session on one thread, so it
# saves every 25 steps and a later session continues it with --resume (the same machine keeps $ANCHORSPEC_HOME).
# Extra args go to `anchorspec train` (this host: --threads 1|2 --dtype bfloat16 [--resume]).
set -euo pipefail
cd "$(dirname "$0")/../../.."
R=${ANCHORSPEC_HOME:-$HOME/.cache/anchorspec}/runs/smollm2-135m-instruct
mkdir -p "$R/r24-subset"
for p in 0004 0032 0033 0034 0035 0036 0037 0038; do
  for ext in npz json; do ln -sf "$PWD/corpus/smollm2-135m-instruct/part-$p.$ext" "$R/r24-subset/part-$p.$ext"; done
done
REVOCAB= VARIANT=eagle3.1 STEPS=400 LR=1e-4 bash benchmarks/cpu_round.sh train 24 \
  --data "$R/r24-subset" corpus/smollm2-135m-instruct-long --max-len 4096 --batch-tokens 4096 \
  --join-to 4096 --join-share 0.3 --order-seed 67 --save-every 25 --no-progress "$@"
