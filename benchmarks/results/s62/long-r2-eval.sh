#!/usr/bin/env bash
# Session 62: the long-sequence rounds that kept the release vocabulary (EAGLE-3 r19, EAGLE-3.1 r21) against the releases.
# 1) the release gate: cpu_round.sh eval (MT-bench 1-10 and 16 other prompts, float32, tree 4,4,16, T=0 and T=1);
# 2) the long-context axis: replay_by_source (float32, 2 threads, tree 4,4,16, T=0), as session 61.
set -euo pipefail
cd /work/main
R=$HOME/.cache/anchorspec/runs/smollm2-135m-instruct
OUT=benchmarks/results/s62/eagle3.1-r21 SKIP_PEERS=1 VARIANT=eagle3.1 bash benchmarks/cpu_round.sh eval 21
OUT=benchmarks/results/s62/eagle3-r19 SKIP_PEERS=1 VARIANT=eagle3 bash benchmarks/cpu_round.sh eval 19
python benchmarks/replay_by_source.py --drafter eagle3-release=checkpoints/smollm2-135m-instruct-eagle3 \
  --drafter eagle3-r19="$R/eagle3-r19-bf16" --drafter eagle3.1-release=checkpoints/smollm2-135m-instruct-eagle3.1 \
  --drafter eagle3.1-r21="$R/eagle3.1-r21-bf16" --corpus corpus/smollm2-135m-instruct-long --per-source 6 \
  --mtbench-categories --workloads long --dtype float32 --threads 2 --out benchmarks/results/s62/replay-long-rounds.json
