#!/usr/bin/env bash
# The next round on one GPU (EAGLE-3.1 round N31, EAGLE-3 round N3), both variants from their releases (in
# $R/init-<variant>), side by side, on the same data (DATA: corpus folders, space-separated), batch order, seed and
# step count. A 10-step probe of one run sizes the steps to the time left before DEADLINE (epoch seconds), with room
# for two runs and the data job sharing the GPU. Run from the repository root. Env: DATA, RUNS, DEADLINE; DEVICE (cuda; cpu for a dry run), BATCH (tokens a step), LR,
# PROBE (steps), HELDOUT (held-out conversations scored), SHARE (fraction of the probe's speed each run is assumed to keep), INITS (folder of init-*),
# N31, N3 (the round numbers; go.sh sets them), MAXLEN (positions), JOIN (chain conversations into sequences of up to
# JOIN tokens, a JOIN_SHARE of them: what taught round 22 long context; empty: none).
set -euo pipefail
: "${DATA:?corpus folders}" "${RUNS:?output root}" "${DEADLINE:?epoch seconds}" "${N31:?round number}" "${N3:?round number}"
DEVICE=${DEVICE:-cuda} BATCH=${BATCH:-32768} LR=${LR:-4e-4} PROBE=${PROBE:-10} SHARE=${SHARE:-0.55}
INITS=${INITS:-/root/data} MAXLEN=${MAXLEN:-1024} HELDOUT=${HELDOUT:-256} JOIN=${JOIN:-} JOIN_SHARE=${JOIN_SHARE:-0.3}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
train() {  # variant name steps eval-every log-every
  # shellcheck disable=SC2086  # DATA is a list of folders
  python3 -m anchorspec train --target smollm2-135m-instruct --data $DATA --out "$RUNS/$2" --variant "$1" \
    --init-from "$INITS/init-$1" --revocab --max-steps "$3" --ttt-steps 4 --max-len "$MAXLEN" \
    --batch-tokens "$BATCH" --lr "$LR" --warmup-ratio 0.03 --dtype bfloat16 --seed 0 --order-seed 19 \
    --eval-every "$4" --save-every 100 --log-every "$5" --eval-prompts 0 --eval-replay 0 --eval-heldout "$HELDOUT" \
    --compile-loss off --device "$DEVICE" --no-progress ${JOIN:+--join-to "$JOIN" --join-share "$JOIN_SHARE"}
}
mkdir -p "$RUNS"
t0=$(date +%s)
train eagle3.1 probe "$PROBE" 1000 1 > "$RUNS/probe.log" 2>&1 || { tail -20 "$RUNS/probe.log"; exit 1; }
per=$(python3 - "$RUNS/probe/metrics.jsonl" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
s = [r["seconds"] for r in recs if "eval" not in r and "seconds" in r]
s = s[2:] or s  # the first steps compile and warm up
print(sum(s) / len(s))
PY
)
left=$(( DEADLINE - $(date +%s) - 40 ))  # 40 s: loading, the step-0 and last held-out evaluations
steps=$(python3 -c "print(max(20, int($left / $per * $SHARE)))")
echo "probe: $(( $(date +%s) - t0 )) s; seconds/step alone: $per; $left s left -> $steps steps of $BATCH tokens, both variants"
train eagle3.1 r$N31-eagle3.1 "$steps" $(( steps / 2 > 0 ? steps / 2 : 1 )) 10 > "$RUNS/r$N31-eagle3.1.log" 2>&1 & a=$!
train eagle3 r$N3-eagle3 "$steps" $(( steps / 2 > 0 ? steps / 2 : 1 )) 10 > "$RUNS/r$N3-eagle3.log" 2>&1 & b=$!
wait $a || tail -20 "$RUNS/r$N31-eagle3.1.log"; wait $b || tail -20 "$RUNS/r$N3-eagle3.log"
echo "training done: $(( $(date +%s) - t0 )) s since the probe began"
