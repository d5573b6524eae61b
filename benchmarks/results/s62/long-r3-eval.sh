#!/usr/bin/env bash
# Session 62: EAGLE-3.1 at lr 1e-4 (r22) replayed as long-r2-eval.sh's second step: the same
# (deterministic, greedy, float32) answers, so its rows compare with the release's and r21's in replay-long-rounds.json.
set -euo pipefail
cd /work/main
R=$HOME/.cache/anchorspec/runs/smollm2-135m-instruct
[ -f "$R/eagle3.1-r22-bf16/model.safetensors" ] || anchorspec convert-drafter "$R/eagle3.1-r22/final" --out "$R/eagle3.1-r22-bf16" --dtype bfloat16
python benchmarks/replay_by_source.py --drafter eagle3.1-r22="$R/eagle3.1-r22-bf16" \
  --corpus corpus/smollm2-135m-instruct-long --per-source 6 \
  --mtbench-categories --workloads long --dtype float32 --threads 2 --out benchmarks/results/s62/replay-long-lr.json
