#!/usr/bin/env bash
# Session 51: does training on answers the target *samples* (T=1) raise sampled speculation's acceptance?
# Offline, along 12 conversations no drafter saw, the release (round 18) overlaps the target by 0.72 a step
# when the text is greedy but 0.48 when the target samples it, and real T=1 decoding runs along sampled text.
# Two arms from round 18, the same steps, schedule and seed, one thread each, side by side:
#   greedy: parts 0027-0029 (1,500 writing- and 1,200 stem-steered Magpie prompts, greedy answers);
#   mix:    the same parts plus 1,600 of the same prompts answered again at T=1 (seed 51).
# Then both, and round 18, measured along greedy and sampled text of parts 0030-0031 (draft_temperature.py)
# and on MT-bench 1-10 at T=0 and T=1 (bench_drafters.py).
set -euo pipefail
cd "$(dirname "$0")/../../.."
H=${ANCHORSPEC_HOME:-$HOME/.cache/anchorspec}
S=$H/runs/smollm2-135m-instruct-steered
R=$H/runs/smollm2-135m-instruct-sampled
T1=${T1:-corpus/smollm2-135m-instruct-t1}
OUT=benchmarks/results/s51
case "${1:-all}" in
regen|all)
  anchorspec regenerate --target smollm2-135m-instruct --out $R/answers-T1-writing39-stem38.jsonl \
    --data $S/magpie-writing-seed39.jsonl $S/magpie-stem-seed38.jsonl --limit-per-source 800 --batch-size 32 \
    --max-new-tokens 256 --max-prompt-tokens 512 --temperature 1 --seed 51 --threads 2
  anchorspec pack-corpus $R/answers-T1-writing39-stem38.jsonl --target smollm2-135m-instruct --out "$T1" \
    --info temperature=1 --info top_p=1 --info seed=51 --info max_new_tokens=256 \
    --info "engine=anchorspec regenerate (continuous batching)"
  ;;&
train|all)
  G=$R/greedy-27-29; mkdir -p "$G"
  for p in 0027 0028 0029; do for e in npz json; do ln -sf "$PWD/corpus/smollm2-135m-instruct/part-$p.$e" "$G/"; done; done
  common=(--target smollm2-135m-instruct --variant eagle3.1 --init-from checkpoints/smollm2-135m-instruct-eagle3.1
          --max-steps 500 --ttt-steps 4 --max-len 1024 --batch-tokens 2048 --lr 3e-4 --warmup-ratio 0.03
          --dtype bfloat16 --seed 0 --order-seed 51 --threads 1 --eval-every 100000 --eval-heldout 64
          --eval-prompts 0 --eval-replay 0 --no-progress)
  anchorspec train "${common[@]}" --data "$G" --out $R/arm-greedy > $R/arm-greedy.log 2>&1 &
  anchorspec train "${common[@]}" --data "$G" "$T1" --out $R/arm-mix > $R/arm-mix.log 2>&1 &
  wait
  ;;&
eval|all)
  python benchmarks/draft_temperature.py --drafter r18=checkpoints/smollm2-135m-instruct-eagle3.1 \
    --drafter greedy=$R/arm-greedy/final --drafter mix=$R/arm-mix/final --parts 30,31 --limit 12 --factors 1.0 \
    --contexts greedy,sampled --threads 2 --out $OUT/contexts-arms-T1.json
  python benchmarks/bench_drafters.py --drafter r18=checkpoints/smollm2-135m-instruct-eagle3.1 \
    --drafter greedy=$R/arm-greedy/final --drafter mix=$R/arm-mix/final \
    --limit 10 --dtype float32 --shape 4,4,16 --temperature1 --threads 2 --out $OUT/mtbench10-fp32-tree4416-arms.json
  ;;
esac
