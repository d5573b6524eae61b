#!/usr/bin/env bash
# The main job on the default model: install, then speculative vs plain greedy decoding of MT-bench
# first turns on SmolLM2-135M-Instruct, with per-prompt stats as JSON lines.
# Uses the released EAGLE-3.1 drafter (checkpoints/); without it, a randomly initialised one: output is
# still identical to the target's, but nearly nothing is accepted (tau ~ 1).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
DATA=${DATA:-../shared/data/mt_bench/question.jsonl}
N=${N:-3}
DRAFTER=${DRAFTER:-checkpoints/smollm2-135m-instruct-eagle3.1}
if [ ! -f "$DRAFTER/model.safetensors" ]; then
  DRAFTER=out/random-eagle3.1
  anchorspec init-drafter --target smollm2-135m-instruct --out "$DRAFTER" --variant eagle3.1
fi
mkdir -p out
head -n "$N" "$DATA" > out/demo_prompts.jsonl
echo "== speculative ($DRAFTER)"
anchorspec generate --target smollm2-135m-instruct --drafter "$DRAFTER" --prompts out/demo_prompts.jsonl --chat --max-new-tokens 64
echo "== plain greedy"
anchorspec generate --target smollm2-135m-instruct --no-spec --prompts out/demo_prompts.jsonl --chat --max-new-tokens 64
