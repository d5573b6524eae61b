#!/usr/bin/env bash
# Session 53: the EAGLE-3 variant's round 11 on this CPU: round 10 (the release) continued on the whole corpus,
# parts 0000-0031, in a batch order of its own (--order-seed 11); everything else as round 10. Resumable (--resume).
# Session 54 resumed round 12 with it (ORDER_SEED=12 RUN=.../round-s54/eagle3 ... --resume); later rounds: benchmarks/cpu_round.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
RUN=${RUN:-$HOME/.cache/anchorspec/runs/smollm2-135m-instruct/round-s53/eagle3}
anchorspec train --target smollm2-135m-instruct --data corpus/smollm2-135m-instruct --variant eagle3 \
  --init-from checkpoints/smollm2-135m-instruct-eagle3 --revocab --order-seed ${ORDER_SEED:-11} \
  --max-steps ${STEPS:-1800} --lr 3e-4 --warmup-ratio 0.03 --ttt-steps 4 --batch-tokens 2048 --max-len 1024 \
  --dtype bfloat16 --threads 2 --heldout 0.02 --eval-every 100000 --eval-heldout 256 --eval-replay 16 \
  --eval-prompts 4 --eval-new-tokens 64 --save-every 100 --out "$RUN" "$@"
