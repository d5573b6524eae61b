#!/usr/bin/env bash
# Session 40's way onto the lent GPU machine (the workplace's `device` tool: 64 MiB per call, tree included;
# a warm machine keeps /root between calls for 30 s). The target's GGUF (98 MB, 90 MB as .xz) needs two calls:
#   1. make the payload:  bash benchmarks/results/gpu-s40/make_payload.sh   (.dev1/ and .dev2/, git-ignored)
#   2. move checkpoints/ corpus/ and benchmarks/results/* (but gpu-s40) out of the tree (the tree then is ~2 MB)
#   3. call 1, carry [".dev1"]: unpack into /root (stage, data, site), copy the tree to /root/repo and start
#      device_tests.sh there with setsid (it runs on while call 2 transfers); see device_tests.sh's header
#   4. call 2 at once, carry [".dev2"]: BUDGET=450 bash .dev2/go.sh (GGUF joined and checked, the GPU rounds of
#      train_gpu.sh, the drafters packed in bf16 and split into 15 MB parts under $OUT)
#   5. move the folders back; cat drafters.tar.xz.* | tar -xJ
# The steps themselves are session 42's script's, with this folder's device scripts; the drafter continued
# is the current release unless INIT_CKPT names another (in session 40 the release was round 11).
cd "$(dirname "$0")/../../.."
SCRIPTS=benchmarks/results/gpu-s40 exec bash benchmarks/results/gpu-s42/make_payload.sh
