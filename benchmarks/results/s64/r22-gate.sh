#!/usr/bin/env bash
# Session 64 (AVX2-only Zen3, no native bf16): EAGLE-3.1 round 22 retrained here with session 62's job
# (`benchmarks/results/s62/long-r3-job.sh --dtype float32`: bf16 is emulated on this CPU, fp32 runs at 154 tokens/s),
# then the release gate (cpu_round.sh eval: MT-bench 1-10 and 16 others, float32, tree 4,4,16, T=0 and T=1) and the
# long-context replay of session 62 (long-r3-eval.sh's, on this round's weights). 2 threads, a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/../../.."
R=${ANCHORSPEC_HOME:-$HOME/.cache/anchorspec}/runs/smollm2-135m-instruct
OUT=benchmarks/results/s64/eagle3.1-r22 VARIANT=eagle3.1 bash benchmarks/cpu_round.sh eval 22
# the release in the same run: the target's float32 answers here may differ from session 62's AVX-512 host's
python benchmarks/replay_by_source.py --drafter eagle3.1-release=checkpoints/smollm2-135m-instruct-eagle3.1 \
  --drafter eagle3.1-r22="$R/eagle3.1-r22-bf16" \
  --corpus corpus/smollm2-135m-instruct-long --per-source 6 \
  --mtbench-categories --workloads long --dtype float32 --threads 2 --out benchmarks/results/s64/replay-long-r22.json
