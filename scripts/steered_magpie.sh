#!/usr/bin/env bash
# Magpie prompts steered toward the MT-bench categories where the released drafter accepts least for how
# sure the target is (writing and stem: docs/results.md, "Session 35"), answered by the target and packed
# as new corpus parts for the next training round. The target writes the queries under a system prompt
# (`synth-prompts --system`) and answers them under its default one, as users ask. Resumable: re-run
# after an interruption and every step continues where it stopped.
# Budget knob: N (prompts per steer). SEED picks the queries (default 37); a new seed draws new queries for
# a steer whose seed-37 queries are already packed (the queries file is named after a seed other than 37). STEERS picks the steers (default: all four; the two prose categories
# below them on MT-bench, humanities and roleplay, were added in session 38). Raising N or adding a steer
# continues the same files; parts already packed are not packed again.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${SHARED:-../shared/data}
RUN=${RUN:-${ANCHORSPEC_HOME:-$HOME/.cache/anchorspec}/runs/smollm2-135m-instruct-steered}
CORPUS=${CORPUS:-corpus/smollm2-135m-instruct}
N=${N:-1500}
SEED=${SEED:-37}
suffix=""; [ "$SEED" = 37 ] || suffix="-seed$SEED"
THREADS=${THREADS:-2}
T=smollm2-135m-instruct
export PYTHONUNBUFFERED=1
mkdir -p "$RUN"
source scripts/magpie_steers.sh  # STEER: name -> system prompt
STEERS=${STEERS:-writing stem humanities roleplay}
for name in $STEERS; do
  [ -n "${STEER[$name]+set}" ] && [ "$name" != plain ] || { echo "steered_magpie.sh: no steer named $name (have: ${!STEER[*]})" >&2; exit 2; }
done
for name in $STEERS; do
  anchorspec synth-prompts --target $T --n "$N" --out "$RUN/magpie-$name$suffix.jsonl" --system "${STEER[$name]}" \
    --eval-data "$SHARED" --seed "$SEED" --threads "$THREADS"
done
for name in $STEERS; do
  anchorspec regenerate --target $T --out "$RUN/answers-magpie-$name$suffix.jsonl" --data "$RUN/magpie-$name$suffix.jsonl" \
    --batch-size 32 --max-new-tokens 256 --max-prompt-tokens 512 --seed 0 --threads "$THREADS" --skip-packed "$CORPUS"
done
answers=(); for name in $STEERS; do answers+=("$RUN/answers-magpie-$name$suffix.jsonl"); done
anchorspec pack-corpus "${answers[@]}" --target $T --out "$CORPUS" --eval-data "$SHARED" \
  --info temperature=0 --info max_new_tokens=256 --info "engine=anchorspec regenerate (continuous batching)"
