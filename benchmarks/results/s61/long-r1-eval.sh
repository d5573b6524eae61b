#!/usr/bin/env bash
# Session 61: the long-sequence rounds against the releases, replayed (float32, 2 threads, tree 4,4,16, T=0):
# MT-bench per category, the bench's long-context workloads, held-out long-document answers.
set -euo pipefail
cd /work/main
R=$HOME/.cache/anchorspec/runs/smollm2-135m-instruct
for v in eagle3.1-r20 eagle3-r18; do
  [ -f "$R/$v-bf16/model.safetensors" ] || anchorspec convert-drafter "$R/$v/final" --out "$R/$v-bf16" --dtype bfloat16
done
python benchmarks/replay_by_source.py --drafter eagle3-release=checkpoints/smollm2-135m-instruct-eagle3 \
  --drafter eagle3-r18="$R/eagle3-r18-bf16" --drafter eagle3.1-release=checkpoints/smollm2-135m-instruct-eagle3.1 \
  --drafter eagle3.1-r20="$R/eagle3.1-r20-bf16" --corpus corpus/smollm2-135m-instruct-long --per-source 6 \
  --mtbench-categories --workloads long --dtype float32 --threads 2 --out benchmarks/results/s61/replay-long-rounds.json
