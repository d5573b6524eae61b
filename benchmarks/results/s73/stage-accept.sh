#!/usr/bin/env bash
# Session 73, issue 15: the acceptance stage on the deepest drafter so far, aimed at T=1 (session 26 measured it on
# round 5, tau 1.66: level at T=1, -0.05 at T=0; "a stage at T=1 only is the next thing to try").
# Two arms from the round-24 release, same data, schedule, seed and batch order, run side by side (1 thread each,
# bf16): 120 steps of 2,048 tokens (0.25M token-steps, TTT depth 4, lr 1e-4, 3 % warm-up, cosine) on the target's
# sampled answers (T=1 parts 0000-0006), plain distillation ("control") against `--stage accept` (16 slots).
# Evaluated as session 71 evaluated round 28 (same held-out text: T=1 part 0007, greedy part 0039; teacher-forced
# overlap sum min(p, q) per depth of a chain of 4 at T=1, float32, 2 threads), so round 28 is comparable.
#   bash benchmarks/results/s73/stage-accept.sh train | eval
set -euo pipefail
cd "$(dirname "$0")/../../.."
R=${ANCHORSPEC_HOME:-$HOME/.cache/anchorspec}/runs/s73
OUT=benchmarks/results/s73
case ${1:?usage: stage-accept.sh train|eval} in
train)
  mkdir -p "$R"
  for arm in control accept; do
    extra=(); [ $arm = accept ] && extra=(--stage accept)
    anchorspec train --target smollm2-135m-instruct --data corpus/smollm2-135m-instruct-t1:0000-0006 \
      --init-from checkpoints/smollm2-135m-instruct-eagle3.1 --max-steps 120 --ttt-steps 4 --max-len 1024 \
      --batch-tokens 2048 --lr 1e-4 --warmup-ratio 0.03 --dtype bfloat16 --seed 0 --threads 1 --eval-every 1000 \
      --save-every 40 --eval-prompts 0 --eval-replay 0 --eval-heldout 64 --no-progress "${extra[@]}" \
      --out "$R/r24-t1-$arm" > "$R/r24-t1-$arm.log" 2>&1 &
  done
  wait ;;
eval)
  for arm in control accept; do
    [ -f "$R/r24-t1-$arm-bf16/model.safetensors" ] || \
      anchorspec convert-drafter "$R/r24-t1-$arm/final" --out "$R/r24-t1-$arm-bf16" --dtype bfloat16
  done
  for text in t1:corpus/smollm2-135m-instruct-t1:7 greedy:corpus/smollm2-135m-instruct:39; do
    IFS=: read -r name data part <<< "$text"
    python benchmarks/draft_temperature.py --drafter release=checkpoints/smollm2-135m-instruct-eagle3.1 \
      --drafter control="$R/r24-t1-control-bf16" --drafter accept="$R/r24-t1-accept-bf16" --data "$data" \
      --parts "$part" --limit 32 --max-len 1024 --temperature 1 --factors 1.0 --candidates 1 --samples 8 \
      --threads 2 --out "$OUT/stage-accept-$name.json" | tee "$OUT/stage-accept-$name.txt"
  done ;;
*) echo "stage-accept.sh: train or eval" >&2; exit 2 ;;
esac
