#!/usr/bin/env bash
# Session 42's GPU round (one GPU, a time box, the data job beside it): the release (round 17) continued on
# parts 0000-0020 as round 18, one decoder layer (session 40: a second one gained nothing). A 10-step probe,
# run while the data job runs, sizes the steps to the time left. Evaluate on a CPU as session 40 did.
# Env: DATA (corpus folder), INIT (drafter to continue), RUNS (output root), DEADLINE (epoch seconds by which
# training must end), DEVICE (cuda; cpu for a dry run), BATCH (tokens per step), LR, PROBE (probe steps).
set -euo pipefail
cd "$(dirname "$0")/../../.."
: "${DATA:?corpus folder}" "${INIT:?drafter to continue}" "${RUNS:?output root}" "${DEADLINE:?epoch seconds}"
DEVICE=${DEVICE:-cuda} BATCH=${BATCH:-32768} LR=${LR:-4e-4} PROBE=${PROBE:-10} MAXLEN=${MAXLEN:-1024}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
train() {  # name steps eval-every log-every
  python3 -m anchorspec train --target smollm2-135m-instruct --data "$DATA" --out "$RUNS/$1" --init-from "$INIT" \
    --revocab --max-steps "$2" --ttt-steps 4 --max-len "$MAXLEN" --batch-tokens "$BATCH" --lr "$LR" \
    --warmup-ratio 0.03 --dtype bfloat16 --seed 0 --order-seed 42 --eval-every "$3" --save-every 100 \
    --log-every "$4" --eval-prompts 0 --eval-replay 0 --compile-loss off --device "$DEVICE" --no-progress
}
mkdir -p "$RUNS"
t0=$(date +%s)
train probe "$PROBE" 1000 1 > "$RUNS/probe.log" 2>&1 || { tail -20 "$RUNS/probe.log"; exit 1; }
per=$(python3 - "$RUNS/probe/metrics.jsonl" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
s = [r["seconds"] for r in recs if "eval" not in r and r["step"] >= 4]
print(sum(s) / len(s))
PY
)
left=$(( DEADLINE - $(date +%s) - 25 ))  # 25 s: the load and the step-0 evaluation
steps=$(python3 -c "print(max(20, int($left / $per * 0.9)))")
echo "probe: $(( $(date +%s) - t0 )) s; seconds/step: $per; $left s left -> $steps steps of $BATCH tokens each"
train r18 "$steps" $(( steps / 4 > 0 ? steps / 4 : 1 )) 10 > "$RUNS/r18.log" 2>&1 || tail -20 "$RUNS/r18.log"
echo "training done: $(( $(date +%s) - t0 )) s since the probe began"
