#!/usr/bin/env bash
# Session 62: session 61's long-sequence round again, but keeping each release's vocabulary (no --revocab), with both long-document parts (800 answers).
# Data: 4 greedy corpus parts (a spread) + both long-document parts; 30 % of the training conversations chained
# into multi-turn sequences of up to 4,096 tokens (--join-to). One thread each, side by side.
set -euo pipefail
cd /work/main
SUB=$HOME/.cache/anchorspec/runs/smollm2-135m-instruct/long-r2/subset
mkdir -p "$SUB"
for p in 0004 0012 0020 0028; do
  ln -sf /work/main/corpus/smollm2-135m-instruct/part-$p.npz "$SUB/part-$p.npz"
  ln -sf /work/main/corpus/smollm2-135m-instruct/part-$p.json "$SUB/part-$p.json"
done
run() {  # variant round
  anchorspec train --target smollm2-135m-instruct --data "$SUB" corpus/smollm2-135m-instruct-long --variant "$1" \
    --init-from checkpoints/smollm2-135m-instruct-$1 --order-seed 62 \
    --max-steps "${STEPS:-150}" --lr 3e-4 --warmup-ratio 0.03 --ttt-steps 4 --batch-tokens 4096 --max-len 4096 \
    --join-to 4096 --join-share 0.3 --dtype bfloat16 --threads 1 --heldout 0.02 --eval-every 100000 \
    --eval-heldout 48 --eval-replay 4 --eval-prompts 0 --save-every 25 --no-progress \
    --out "$HOME/.cache/anchorspec/runs/smollm2-135m-instruct/$1-r$2" "${@:3}"
}
run eagle3.1 21 "$@" > "$HOME/.cache/anchorspec/runs/smollm2-135m-instruct/long-r2/eagle3.1.log" 2>&1 &
run eagle3 19 "$@" > "$HOME/.cache/anchorspec/runs/smollm2-135m-instruct/long-r2/eagle3.log" 2>&1 &
wait
