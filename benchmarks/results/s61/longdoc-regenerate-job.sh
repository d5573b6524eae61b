#!/usr/bin/env bash
# greedy answers to 800 long-document prompts (session 61); resumable: re-running skips answered ids
cd /work/main
exec anchorspec regenerate --target smollm2-135m-instruct --data ~/.cache/anchorspec/runs/longdoc/prompts-s0.jsonl \
  --out ~/.cache/anchorspec/runs/longdoc/answers-s0.jsonl --max-prompt-tokens 4096 --max-new-tokens 256 \
  --batch-size 16 --dtype bfloat16 --threads 2
