#!/usr/bin/env bash
# Session 71: round 28 (r28-job.sh) against the release (round 24).
#   overlap: draft_temperature.py, teacher-forced, no timing: along T=1 part 0007 (the target's sampled answers,
#            held out of round 28) and greedy part 0039 (held out too), 32 conversations each, T=1, chains of 4;
#            along the sampled text also nodes drafting 1-4 candidates (top-k against 8 draws without replacement).
#   gate:    cpu_round.sh eval 28 via session 66's round-eval.sh (MT-bench 1-10 and 16 others, float32, tree 4,4,16
#            forced, T=0 and T=1, HF in the same run). Timed: a quiet machine.
#   replay:  session 66's replay (MT-bench 8 x 6 and long 1k-8k, float32, tree 4,4,16, T=0).
set -euo pipefail
cd "$(dirname "$0")/../../.."
R=${ANCHORSPEC_HOME:-$HOME/.cache/anchorspec}/runs/smollm2-135m-instruct
OUT=benchmarks/results/s71
case ${1:?usage: r28-eval.sh overlap|gate|replay} in
overlap)
  [ -f "$R/eagle3.1-r28-bf16/model.safetensors" ] || anchorspec convert-drafter "$R/eagle3.1-r28/final" --out "$R/eagle3.1-r28-bf16" --dtype bfloat16
  for text in t1:corpus/smollm2-135m-instruct-t1:7:4 greedy:corpus/smollm2-135m-instruct:39:1; do
    IFS=: read -r name data part candidates <<< "$text"
    python benchmarks/draft_temperature.py --drafter release=checkpoints/smollm2-135m-instruct-eagle3.1 \
      --drafter r28="$R/eagle3.1-r28-bf16" --data "$data" --parts "$part" --limit 32 --max-len 1024 \
      --temperature 1 --factors 1.0,0.9 --candidates "$candidates" --samples 8 --threads 2 \
      --out "$OUT/overlap-$name.json" | tee "$OUT/overlap-$name.txt"
  done ;;
gate) ROUND=28 RESULTS=$OUT bash benchmarks/results/s66/round-eval.sh gate ;;
replay) ROUND=28 RESULTS=$OUT bash benchmarks/results/s66/round-eval.sh replay ;;
*) echo "r28-eval.sh: overlap, gate or replay" >&2; exit 2 ;;
esac
