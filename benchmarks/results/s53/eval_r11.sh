#!/usr/bin/env bash
# Session 53: the EAGLE-3 variant's round 11 (trained on this CPU, round 10 continued) against round 10, the release.
# 1. the release table's measurement (MT-bench 1-10, float32, tree 4,4,16 forced, T=0 and T=1), both rounds in one process;
# 2. llama.cpp with round 11's GGUF (`peers.py`, the same 10 prompts, chain 3) beside anchorspec's float32 rows;
# 3. llama.cpp again with its own early stop of a draft (--p-min 0.75).
set -euo pipefail
cd "$(dirname "$0")/../../.."
# round 11 as released: `anchorspec convert-drafter .../eagle3/final --out .../eagle3-r11-bf16 --dtype bfloat16`
R11=${R11:-$HOME/.cache/anchorspec/runs/smollm2-135m-instruct/round-s53/eagle3-r11-bf16}
OUT=benchmarks/results/s53
python benchmarks/bench_drafters.py --drafter eagle3-r10=checkpoints/smollm2-135m-instruct-eagle3 --drafter eagle3-r11="$R11" \
  --limit 10 --dtype float32 --shape 4,4,16 --temperature1 --threads 2 --out $OUT/mtbench10-fp32-tree4416-eagle3-r10-r11.json
[ -n "${SKIP_PEERS:-}" ] || python benchmarks/peers.py --limit 10 --threads 2 --skip hf,fast,vllm --drafter "$R11" --out $OUT/peers-eagle3-r11
[ -n "${SKIP_PEERS:-}" ] || python benchmarks/peers.py --limit 10 --threads 2 --skip hf,fast,vllm,anchorspec --drafter "$R11" \
  --p-min 0.75 --out $OUT/peers-eagle3-r11-pmin075
