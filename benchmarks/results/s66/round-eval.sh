#!/usr/bin/env bash
# Session 66: an EAGLE-3.1 round of this session (ROUND: 23 by default, r23-job.sh; 24 for r24-job.sh) against the
# release (round 22).
#   replay: replay_by_source (float32, tree 4,4,16, T=0, the target's answers): MT-bench 8 categories x 6 and the
#           long-context rows of sessions 61-65. Tau only, so it may share the machine (then THREADS=1: two threads
#           on one free core ran ~18x slower).
#   gate:   cpu_round.sh eval ROUND (MT-bench 1-10 and 16 others, float32, tree 4,4,16, T=0 and T=1, HF in the same
#           run). Timed: a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/../../.."
R=${ANCHORSPEC_HOME:-$HOME/.cache/anchorspec}/runs/smollm2-135m-instruct
THREADS=${THREADS:-2}
N=${ROUND:-23}
RESULTS=${RESULTS:-benchmarks/results/s66}  # where the replay and the gate write (a later session's folder)
case ${1:?usage: round-eval.sh replay|gate} in
replay)
  [ -f "$R/eagle3.1-r$N-bf16/model.safetensors" ] || anchorspec convert-drafter "$R/eagle3.1-r$N/final" --out "$R/eagle3.1-r$N-bf16" --dtype bfloat16
  python benchmarks/replay_by_source.py --drafter eagle3.1-release=checkpoints/smollm2-135m-instruct-eagle3.1 \
    --drafter eagle3.1-r$N="$R/eagle3.1-r$N-bf16" \
    --corpus corpus/smollm2-135m-instruct-long --per-source 6 --mtbench-categories --workloads long \
    --dtype float32 --threads "$THREADS" --out "$RESULTS/replay-r$N.json" ;;
gate)
  OUT=$RESULTS/eagle3.1-r$N VARIANT=eagle3.1 bash benchmarks/cpu_round.sh eval "$N" ;;
*) echo "round-eval.sh: replay or gate" >&2; exit 2 ;;
esac
