#!/usr/bin/env bash
# Round 18 against round 17 (the release), generate's defaults on all 80 MT-bench first turns as two runs of
# 40 (odd and even prompts), both drafters rotated per prompt in one process, HF generate and the plain loop
# as baselines (bf16, 2 threads): OFFSET=0 and OFFSET=1.
set -euo pipefail
cd "$(dirname "$0")/../../.."
R18=${R18:-${ANCHORSPEC_HOME:-$HOME/.cache/anchorspec}/runs/gpu-s42/r18/final}
OFFSET=${OFFSET:-0}
python benchmarks/bench_drafters.py --drafter r17=checkpoints/smollm2-135m-instruct-eagle3.1 --drafter r18=$R18 \
  --every 2 --offset "$OFFSET" --limit 40 --dtype bfloat16 --shape default --plain --threads 2 \
  --out benchmarks/results/gpu-s42/defaults-r17-r18-bf16-offset$OFFSET.json
