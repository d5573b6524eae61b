#!/usr/bin/env bash
# Session 88: what the few-row graph (session 87) costs and buys a new user's demo. Each arm gets a fresh
# $ANCHORSPEC_HOME holding only the converted target (symlink) and this machine's dtype/attention verdicts
# (copied, so both arms compile the same forms), then runs the demo twice: cold (compiling) and warm.
# ARMS order alternates so host drift hits both.
set -uo pipefail
cd "$(dirname "$0")/../../.."
ARMS=${ARMS:-"off on"}
for run in cold warm; do
  for arm in $ARMS; do
    home=/tmp/s88-demo-$arm
    if [ "$run" = cold ]; then
      rm -rf "$home"; mkdir -p "$home"
      ln -s ~/.cache/anchorspec/models "$home/models"
      cp -r ~/.cache/anchorspec/dtype ~/.cache/anchorspec/attention ~/.cache/anchorspec/gemm "$home/"
    fi
    if [ "$arm" = off ]; then export ANCHORSPEC_FEW_ROWS_GRAPH=off; else unset ANCHORSPEC_FEW_ROWS_GRAPH; fi
    echo "=== $run $arm $(date +%T)"
    start=$(date +%s)
    ANCHORSPEC_HOME=$home python3 scripts/demo.py --drafter checkpoints/smollm2-135m-instruct-eagle3.1 --limit 5 \
      --float32-check off 2>&1 | grep -E "compiled|result|plain|speculative|tau|tok/s|x " | tail -12
    echo "=== $run $arm wall $(( $(date +%s) - start )) s"
  done
done
