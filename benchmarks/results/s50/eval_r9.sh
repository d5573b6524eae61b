#!/usr/bin/env bash
# Session 50: the EAGLE-3 variant's round 9 (trained on this CPU) against round 8, the release.
# 1. the release table's measurement (MT-bench 1-10, float32, tree 4,4,16 forced, T=0 and T=1), both rounds in one process;
# 2. llama.cpp with round 9's GGUF (`peers.py`, the same 10 prompts, chain 3) beside anchorspec's float32 rows.
set -euo pipefail
cd "$(dirname "$0")/../../.."
R9=${R9:-/tmp/r9-eagle3}
OUT=benchmarks/results/s50
python benchmarks/bench_drafters.py --drafter eagle3-r8=checkpoints/smollm2-135m-instruct-eagle3 --drafter eagle3-r9="$R9" \
  --limit 10 --dtype float32 --shape 4,4,16 --temperature1 --threads 2 --out $OUT/mtbench10-fp32-tree4416-eagle3-r8-r9.json
python benchmarks/peers.py --limit 10 --threads 2 --skip hf,fast,vllm --drafter "$R9" --out $OUT/peers-eagle3-r9
