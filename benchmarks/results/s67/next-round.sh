#!/usr/bin/env bash
# Session 67: the next CPU round of the EAGLE-3.1 release (round 24), round 24's recipe on the corpus parts it never
# saw: the release + STEPS (400) steps at peak lr 1e-4 on PARTS (default 0039-0042, with ShareGPT part 0004 so code
# and maths stay in view) and the long corpus, 4,096 tokens a batch at up to 4,096 positions, 30 % of conversations
# chained, the release's vocabulary. ROUND defaults to 26 (25 is the GPU round's: benchmarks/results/gpu-next/).
#   bash benchmarks/results/s67/next-round.sh train [--threads 1|2 --dtype bfloat16 --resume]   resumable, saves every 25
#   THREADS=1 bash benchmarks/results/s67/next-round.sh replay    MT-bench 8 x 6 and long 1k-8k replay (tau only)
#   bash benchmarks/results/s67/next-round.sh gate                cpu_round.sh eval on a quiet machine
# Then, if it wins: TAU=<MT-bench 1-10 T=0 tau> VARIANT=eagle3.1 bash benchmarks/cpu_round.sh release ROUND.
set -euo pipefail
cd "$(dirname "$0")/../../.."
N=${ROUND:-26}
PARTS=${PARTS:-0004,0039-0042}
HERE=benchmarks/results/s67
case ${1:?usage: next-round.sh train|replay|gate [train options]} in
train)
  shift
  REVOCAB= VARIANT=eagle3.1 STEPS=${STEPS:-400} LR=1e-4 bash benchmarks/cpu_round.sh train "$N" \
    --data "corpus/smollm2-135m-instruct:$PARTS" corpus/smollm2-135m-instruct-long --max-len 4096 --batch-tokens 4096 \
    --join-to 4096 --join-share 0.3 --order-seed "$((N + 42))" --save-every 25 --no-progress "$@" ;;
replay|gate)
  ROUND=$N RESULTS=$HERE bash benchmarks/results/s66/round-eval.sh "$1" ;;
*) echo "next-round.sh: train, replay or gate" >&2; exit 2 ;;
esac
