#!/usr/bin/env bash
# Issue 15: the decoding options at T=0 and T=1 against generate's default path (not a forced tree).
cd /work/main
export ANCHORSPEC_HOME=/root/.cache/anchorspec PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
python benchmarks/bench_drafters.py --drafter r11=checkpoints/smollm2-135m-instruct-eagle3.1 \
  --every 5 --dtype bfloat16 --threads 1 --shape default --plain --temperature1 \
  --option staged1:staged=1 --option drift:prune=drift --option pid:depth_control=pid \
  --out benchmarks/results/options-s36/mtbench16-bf16-default-r11-t1.json
