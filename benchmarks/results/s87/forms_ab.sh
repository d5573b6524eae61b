#!/usr/bin/env bash
# Session 87: the drafter server at sixteen users with the step graphs' attention by query rows (this tree) against
# the code before it (a worktree of $BASE at /tmp/s87/old: one form for every row count), in alternating processes.
# Each process runs s86/round_ledger.py's workload: per block a plain and a drafter scheduler of that code (4 users'
# warm-up, then 32 MT-bench first turns at 16 in flight, T=0, 128 tokens, round 24 + lookup, 1 thread), and prints the
# drafter's tokens/s over its own plain scheduler's. Usage (from the repository root):
#   git worktree add -f /tmp/s87/old BASE && bash benchmarks/results/s87/forms_ab.sh PAIRS BLOCKS
set -u
PAIRS=${1:-3}
BLOCKS=${2:-2}
OUT=benchmarks/results/s87
for i in $(seq 1 "$PAIRS"); do
  if (( i % 2 )); then order="old new"; else order="new old"; fi
  for which in $order; do
    if [ "$which" = old ]; then path=/tmp/s87/old; else path=$PWD; fi
    echo "== pair $i: $which" >> "$OUT/forms-ab.log"
    PYTHONPATH=$path python benchmarks/results/s86/round_ledger.py --blocks "$BLOCKS" --variants new --threads 1 \
      2>/dev/null | grep -E "^block|median" >> "$OUT/forms-ab.log"
  done
done
