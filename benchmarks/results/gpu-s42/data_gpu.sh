#!/usr/bin/env bash
# Session 42: new corpus data on the lent GPU, beside round 18's training there. The target writes queries
# (Magpie: `synth-prompts`, one file per steer in scripts/magpie_steers.sh, unsteered first) and answers
# them greedily (`regenerate`); the next steer's queries are written while this one's are answered. Every
# step stops at DEADLINE (SIGINT: the files keep what was written, and re-running continues them).
# Evaluation prompts are not filtered here (the evaluation sets stay on the CPU host): `pack-corpus
# --eval-data` drops them there. Env: GEN (output folder), DEADLINE (epoch seconds), DEVICE (cuda; cpu for
# a dry run), N (queries per steer), SEED, ORDER (steers), SYNTH_BATCH, BATCH (rows per forward), THREADS.
set -uo pipefail
cd "$(dirname "$0")/../../.."
: "${GEN:?output folder}" "${DEADLINE:?epoch seconds}"
DEVICE=${DEVICE:-cuda} N=${N:-3000} SEED=${SEED:-42} SYNTH_BATCH=${SYNTH_BATCH:-512} BATCH=${BATCH:-256}
THREADS=${THREADS:-4} ORDER=${ORDER:-plain writing stem coding reasoning humanities roleplay extraction}
T=smollm2-135m-instruct
export PYTHONUNBUFFERED=1
source scripts/magpie_steers.sh
mkdir -p "$GEN"
left() { echo $(( DEADLINE - $(date +%s) )); }
synth() {  # name
  local sys=(); [ -n "${STEER[$1]}" ] && sys=(--system "${STEER[$1]}")
  [ "$(left)" -gt 15 ] || return 0
  timeout -s INT "$(left)" python3 -m anchorspec synth-prompts --target $T --n "$N" --out "$GEN/magpie-$1.jsonl" \
    "${sys[@]}" --eval-data '' --seed "$SEED" --batch-size "$SYNTH_BATCH" --device "$DEVICE" --threads "$THREADS" \
    > "$GEN/synth-$1.log" 2>&1
  echo "synth $1: rc $?, $(wc -l < "$GEN/magpie-$1.jsonl" 2>/dev/null || echo 0) queries, $(( $(date +%s) - T0 )) s"
}
regen() {  # name
  [ "$(left)" -gt 15 ] && [ -s "$GEN/magpie-$1.jsonl" ] || return 0
  timeout -s INT "$(left)" python3 -m anchorspec regenerate --target $T --data "$GEN/magpie-$1.jsonl" \
    --out "$GEN/answers-$1.jsonl" --batch-size "$BATCH" --max-new-tokens 256 --max-prompt-tokens 512 --seed 0 \
    --device "$DEVICE" --threads "$THREADS" > "$GEN/regen-$1.log" 2>&1
  echo "regen $1: rc $?, $(wc -l < "$GEN/answers-$1.jsonl" 2>/dev/null || echo 0) answers, $(( $(date +%s) - T0 )) s"
}
T0=$(date +%s)
set -- $ORDER
synth "$1"
while [ $# -gt 0 ]; do
  [ $# -gt 1 ] && { synth "$2" & }
  regen "$1"
  wait
  shift
done
echo "data job done: $(( $(date +%s) - T0 )) s"
