#!/usr/bin/env bash
# Round 16 (prepared in session 38): is the plateau capacity? Round 15's run exactly (train15.sh: from round 11,
# the mapped --revocab, lr 3e-4, 1,000 steps, 2 threads, corpus parts 0000-0019, batch order --order-seed 15)
# with a second decoder layer grown from round 11 (it starts as the identity), so that against round 15 only
# the layer count differs. Round 14 grew the same layer for 400 steps only. Evaluate against round 11 with
#   NAME=r16 DIR=$ANCHORSPEC_HOME/runs/r16-layers2-eagle3.1/final OUT=benchmarks/results/round16 \
#     STAGE=categories bash benchmarks/results/round15/eval.sh
set -euo pipefail
export ANCHORSPEC_HOME=${ANCHORSPEC_HOME:-$HOME/.cache/anchorspec}
# a later --out overrides train15.sh's own
exec bash "$(dirname "$0")/../round15/train15.sh" --out $ANCHORSPEC_HOME/runs/r16-layers2-eagle3.1 --draft-layers 2 "$@"
