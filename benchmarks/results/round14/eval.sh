#!/usr/bin/env bash
# Round-14 candidate (a second decoder layer grown from round 11) against round 11: the scaling curve's
# protocol (fp32, forced 4,4,16, MT-bench 1-10, T=0 and T=1); STAGE=speed adds generate's defaults on
# MT-bench first turns (bf16 = --dtype auto's choice here, measured shape, fallback) where a deeper drafter pays its cost.
set -euo pipefail
cd /work/main
export ANCHORSPEC_HOME=/root/.cache/anchorspec PYTHONUNBUFFERED=1
R14=${R14:-$ANCHORSPEC_HOME/runs/r36/r14-layers2-eagle3.1/final}
OUT=benchmarks/results/round14
if [ "${STAGE:-tau}" = tau ]; then
python benchmarks/bench_drafters.py --drafter r11=checkpoints/smollm2-135m-instruct-eagle3.1 --drafter r14-layers2=$R14 \
  --limit 10 --dtype float32 --shape 4,4,16 --temperature1 --pack off --threads 2 --out $OUT/mtbench10-fp32-tree4416.json
else
python benchmarks/bench_drafters.py --drafter r11=checkpoints/smollm2-135m-instruct-eagle3.1 --drafter r14-layers2=$R14 \
  --limit ${LIMIT:-80} --dtype bfloat16 --shape default --plain --threads 2 --out $OUT/mtbench${LIMIT:-80}-bf16-default.json
fi
