#!/usr/bin/env bash
# Session 88: generate's defaults end to end on all 80 MT-bench first turns (T=0, 128 new tokens, chat template),
# against HF generate and the plain loop in one process, methods rotated per prompt; the release and a random
# EAGLE-3.1 drafter (anchorspec init-drafter --out /tmp/random31). bf16 (--dtype auto here), compiled, 2 threads.
cd "$(dirname "$0")/../../.."
python3 benchmarks/bench_default_shape.py --drafter checkpoints/smollm2-135m-instruct-eagle3.1 \
  --random-drafter /tmp/random31 --every 1 --limit 80 --threads 2 --compile \
  --out benchmarks/results/s88/default-mtbench80.json
