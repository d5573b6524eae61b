#!/usr/bin/env bash
# generate's defaults with the release (round 18) on 40 MT-bench first turns (odd ones: the order session 42's
# first run began on chains), the plain loop and HF generate beside it, bf16, 2 threads. The JSON keeps, per
# prompt, each candidate shape's expected speedup when the shape was chosen and the shapes explored instead.
set -euo pipefail
cd "$(dirname "$0")/../../.."
TAG=${TAG:-baseline}
python benchmarks/bench_drafters.py --drafter r18=checkpoints/smollm2-135m-instruct-eagle3.1 \
  --every 2 --offset "${OFFSET:-0}" --limit "${LIMIT:-40}" --dtype bfloat16 --shape default --plain --threads 2 \
  --out benchmarks/results/s43/shape-trace-$TAG.json
