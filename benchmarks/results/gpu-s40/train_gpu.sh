#!/usr/bin/env bash
# Session 40's GPU rounds (one H100, a time box): round 11 continued on the regenerated corpus for as many steps as
# fit, two drafters at once on the one GPU (a small model leaves it mostly idle): A keeps one decoder layer (a
# drop-in successor of the release), B grows a second (round 16's question, asked with ~20x its compute).
# Steps are sized by a 10-step probe of both runs together. Evaluate the results on a CPU with
#   NAME=gpu-a DIR=.../a/final OUT=benchmarks/results/gpu-s40 STAGE=categories bash benchmarks/results/round15/eval.sh
# Env: DATA (corpus folder), INIT (drafter to continue), RUNS (output root), DEADLINE (epoch seconds by which
# training must end), DEVICE (cuda; cpu for a dry run), BATCH (tokens per step), LR, PROBE (probe steps).
set -euo pipefail
cd "$(dirname "$0")/../../.."
: "${DATA:?corpus folder}" "${INIT:?drafter to continue}" "${RUNS:?output root}" "${DEADLINE:?epoch seconds}"
DEVICE=${DEVICE:-cuda} BATCH=${BATCH:-32768} LR=${LR:-6e-4} PROBE=${PROBE:-10}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
train() {  # name layers steps eval-every log-every [extra]
  python3 -m anchorspec train --target smollm2-135m-instruct --data "$DATA" --out "$RUNS/$1" --init-from "$INIT" \
    --revocab --draft-layers "$2" --max-steps "$3" --ttt-steps 4 --max-len 1024 --batch-tokens "$BATCH" --lr "$LR" \
    --warmup-ratio 0.03 --dtype bfloat16 --seed 0 --order-seed 40 --eval-every "$4" --save-every 100 \
    --log-every "$5" --eval-prompts 0 --eval-replay 0 --compile-loss off --device "$DEVICE" --no-progress
}
mkdir -p "$RUNS"
python3 -c "from anchorspec.models.hub import resolve_target; print(resolve_target('smollm2-135m-instruct'))"
t0=$(date +%s)
train probe-a 1 "$PROBE" 1000 1 > "$RUNS/probe-a.log" 2>&1 & pa=$!
train probe-b 2 "$PROBE" 1000 1 > "$RUNS/probe-b.log" 2>&1 & pb=$!
wait $pa || { tail -20 "$RUNS/probe-a.log"; exit 1; }
wait $pb || { tail -20 "$RUNS/probe-b.log"; exit 1; }
echo "probe: $(( $(date +%s) - t0 )) s for both (loads included)"
# seconds per step with both running: the slower run's mean over steps 4.., as the metrics recorded them
per=$(python3 - "$RUNS" <<'PY'
import json, sys
def per(run):
    recs = [json.loads(l) for l in open(f"{sys.argv[1]}/{run}/metrics.jsonl")]
    s = [r["seconds"] for r in recs if "eval" not in r and r["step"] >= 4]
    return sum(s) / len(s)
print(max(per("probe-a"), per("probe-b")))
PY
)
left=$(( DEADLINE - $(date +%s) - 25 ))  # 25 s: two loads and the step-0 evaluation
steps=$(python3 -c "print(max(20, int($left / $per * 0.9)))")
echo "seconds/step (both running): $per; $left s left -> $steps steps of $BATCH tokens each"
every=$(( steps / 4 > 0 ? steps / 4 : 1 ))
train a 1 "$steps" "$every" 10 > "$RUNS/a.log" 2>&1 & ra=$!
train b 2 "$steps" "$every" 10 > "$RUNS/b.log" 2>&1 & rb=$!
wait $ra || tail -20 "$RUNS/a.log"
wait $rb || tail -20 "$RUNS/b.log"
echo "training done: $(( $(date +%s) - t0 )) s since the probe began"
