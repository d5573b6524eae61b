#!/usr/bin/env bash
# The main job on the default model: install, then speculative vs plain greedy decoding of a few
# prompts on SmolLM2-135M-Instruct, and a summary that says what came out: CPU, dtype and threads;
# plain and speculative tokens/s and their ratio; tau; whether every output was identical to plain.
#   bash scripts/demo.sh                 # the 5 prompts the project ships (anchorspec/data/demo_prompts.jsonl)
#   DATA=../shared/data/mt_bench/question.jsonl N=10 bash scripts/demo.sh    # your prompts: JSONL,
#                                        # 'prompt' or MT-bench 'turns' (first turn); N = how many
#   bash scripts/demo.sh --json          # JSON lines on stdout: one per prompt, then {"summary": ...}
#   bash scripts/demo.sh --compile off   # eager steps (default: the step graphs and their narrow-step twins,
#                                        # compiled once per machine, a few minutes the first time on 2 cores)
# Uses the released EAGLE-3.1 drafter (checkpoints/); without it, a randomly initialised one: output is
# still identical to the target's, but nearly nothing is accepted (tau ~ 1).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
N=${N:-5}
DRAFTER=${DRAFTER:-checkpoints/smollm2-135m-instruct-eagle3.1}
if [ ! -f "$DRAFTER/model.safetensors" ]; then
  DRAFTER=out/random-eagle3.1
  anchorspec init-drafter --target smollm2-135m-instruct --out "$DRAFTER" --variant eagle3.1 >&2
fi
args=(--drafter "$DRAFTER" --limit "$N")
if [ -n "${DATA:-}" ]; then
  args+=(--prompts "$DATA")
fi
python3 scripts/demo.py "${args[@]}" "$@"
