#!/usr/bin/env bash
# Session 65: EAGLE-3 round 20 (eagle3-long-lr1e-4-job.sh) against the EAGLE-3 release.
#   replay: the long-context axis of sessions 61-64 (replay_by_source: float32, tree 4,4,16, T=0, the target's
#           answers), with the EAGLE-3.1 release (round 22, the same training from its own release) in the same run:
#           EAGLE-3.1 / EAGLE-3 with the same training. Tau only, so it may share the machine.
#   gate:   cpu_round.sh eval 20 (MT-bench 1-10 and 16 others, float32, tree 4,4,16, T=0 and T=1, HF in the same
#           run). Timed: a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/../../.."
R=${ANCHORSPEC_HOME:-$HOME/.cache/anchorspec}/runs/smollm2-135m-instruct
THREADS=${THREADS:-2}
case ${1:?usage: eagle3-r20-eval.sh replay|gate} in
replay)
  [ -f "$R/eagle3-r20-bf16/model.safetensors" ] || anchorspec convert-drafter "$R/eagle3-r20/final" --out "$R/eagle3-r20-bf16" --dtype bfloat16
  python benchmarks/replay_by_source.py --drafter eagle3-release=checkpoints/smollm2-135m-instruct-eagle3 \
    --drafter eagle3-r20="$R/eagle3-r20-bf16" --drafter eagle3.1-release=checkpoints/smollm2-135m-instruct-eagle3.1 \
    --corpus corpus/smollm2-135m-instruct-long --per-source 6 --mtbench-categories --workloads long \
    --dtype float32 --threads "$THREADS" --out benchmarks/results/s65/replay-long-eagle3-r20.json ;;
gate)
  OUT=benchmarks/results/s65/eagle3-r20 SKIP_PEERS=1 VARIANT=eagle3 bash benchmarks/cpu_round.sh eval 20 ;;
*) echo "eagle3-r20-eval.sh: replay or gate" >&2; exit 2 ;;
esac
