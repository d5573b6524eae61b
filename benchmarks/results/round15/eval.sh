#!/usr/bin/env bash
# Round 15 (round 13's recipe on the corpus grown by the steered writing/stem Magpie part 0019) against
# round 11, the release. STAGE=tau: the scaling curve's protocol (fp32, forced 4,4,16, MT-bench 1-10 =
# the writing category, T=0 and T=1). STAGE=categories: the default tree replayed along the target's
# greedy answers to all 80 first turns, per category (the steered part aimed at writing and stem).
# STAGE=speed: generate's defaults on MT-bench first turns (bf16 = --dtype auto's choice here).
# Another candidate against round 11: NAME=r16 DIR=RUN/final OUT=benchmarks/results/round16 bash eval.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
export ANCHORSPEC_HOME=${ANCHORSPEC_HOME:-$HOME/.cache/anchorspec} PYTHONUNBUFFERED=1
NAME=${NAME:-r15}
DIR=${DIR:-$ANCHORSPEC_HOME/runs/r15-steered-eagle3.1/final}
OUT=${OUT:-benchmarks/results/round15}
R11=checkpoints/smollm2-135m-instruct-eagle3.1
case "${STAGE:-tau}" in
  tau) python benchmarks/bench_drafters.py --drafter r11=$R11 --drafter $NAME=$DIR \
         --limit 10 --dtype float32 --shape 4,4,16 --temperature1 --pack off --threads 2 --out $OUT/mtbench10-fp32-tree4416.json ;;
  categories) python benchmarks/acceptance_vs_confidence.py --drafter r11=$R11 --drafter $NAME=$DIR \
         --per-category 10 --threads 2 --out $OUT/acceptance-vs-confidence.json ;;
  speed) python benchmarks/bench_drafters.py --drafter r11=$R11 --drafter $NAME=$DIR \
         --limit ${LIMIT:-80} --dtype bfloat16 --shape default --plain --threads 2 --out $OUT/mtbench${LIMIT:-80}-bf16-default.json ;;
  *) echo "STAGE: tau, categories or speed" >&2; exit 2 ;;
esac
