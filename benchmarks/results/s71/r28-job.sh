#!/usr/bin/env bash
# Session 71: EAGLE-3.1 round 28, the first round on the target's sampled (T=1) answers at scale. Issue 12's T=1 goal
# (tau 2.3; the release 1.63-1.69) is the one no CPU round has aimed at: the T=1 folder holds 5.17M tokens and no
# release has trained on more than session 51's 0.38M sampled token-steps (+3 % expected T=1 tau then).
# Round 24's recipe (the release + 400 steps at peak lr 1e-4, 4,096-token batches at up to 4,096 positions, 30 % of
# conversations chained, the long corpus kept, the release's vocabulary) on other data: T=1 parts 0000-0006 and the
# greedy parts 0040-0044 (their prompts' greedy answers; round 24 never saw them). Held out of training for the
# evaluation: T=1 part 0007 (sampled answers, seed 70, to the prompts of greedy parts 0035-0039) and greedy part 0039.
# Extra args go to `anchorspec train` (--resume after an interruption).
set -euo pipefail
cd "$(dirname "$0")/../../.."
REVOCAB= VARIANT=eagle3.1 STEPS=400 LR=1e-4 bash benchmarks/cpu_round.sh train 28 \
  --data corpus/smollm2-135m-instruct-t1:0000-0006 corpus/smollm2-135m-instruct:0040-0044 corpus/smollm2-135m-instruct-long \
  --max-len 4096 --batch-tokens 4096 --join-to 4096 --join-share 0.3 --order-seed 28 --save-every 25 --no-progress "$@"
