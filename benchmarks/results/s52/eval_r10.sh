#!/usr/bin/env bash
# Session 52: the EAGLE-3 variant's round 10 (trained on this CPU, round 9 continued) against round 9, the release.
# 1. the release table's measurement (MT-bench 1-10, float32, tree 4,4,16 forced, T=0 and T=1), both rounds in one process;
# 2. llama.cpp with round 10's GGUF (`peers.py`, the same 10 prompts, chain 3) beside anchorspec's float32 rows.
set -euo pipefail
cd "$(dirname "$0")/../../.."
R10=${R10:-$HOME/.cache/anchorspec/runs/smollm2-135m-instruct/round-s52/eagle3/final}
OUT=benchmarks/results/s52
python benchmarks/bench_drafters.py --drafter eagle3-r9=checkpoints/smollm2-135m-instruct-eagle3 --drafter eagle3-r10="$R10" \
  --limit 10 --dtype float32 --shape 4,4,16 --temperature1 --threads 2 --out $OUT/mtbench10-fp32-tree4416-eagle3-r9-r10.json
[ -n "${SKIP_PEERS:-}" ] || python benchmarks/peers.py --limit 10 --threads 2 --skip hf,fast,vllm --drafter "$R10" --out $OUT/peers-eagle3-r10
