#!/usr/bin/env bash
# Round 13 against round 11: the scaling curve's protocol (fp32, forced 4,4,16, MT-bench 1-10, T=0 and T=1),
# then generate's defaults on all 80 MT-bench first turns (bf16 = --dtype auto's choice here, measured shape, fallback).
set -euo pipefail
cd /work/main
export ANCHORSPEC_HOME=/root/.cache/anchorspec PYTHONUNBUFFERED=1
R13=${R13:-$ANCHORSPEC_HOME/runs/r36/r13-eagle3.1/final}
OUT=benchmarks/results/round13
python benchmarks/bench_drafters.py --drafter r11=checkpoints/smollm2-135m-instruct-eagle3.1 --drafter r13=$R13 \
  --limit 10 --dtype float32 --shape 4,4,16 --temperature1 --pack off --threads 2 --out $OUT/mtbench10-fp32-tree4416.json
python benchmarks/bench_drafters.py --drafter r11=checkpoints/smollm2-135m-instruct-eagle3.1 --drafter r13=$R13 \
  --limit 80 --dtype bfloat16 --shape default --plain --threads 2 --out $OUT/mtbench80-bf16-default.json
