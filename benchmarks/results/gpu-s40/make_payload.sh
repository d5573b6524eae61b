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
set -euo pipefail
cd "$(dirname "$0")/../../.."
G=$(python -c "from anchorspec.models.hub import alias_gguf; print(alias_gguf('smollm2-135m-instruct'))")
mkdir -p .dev1 .dev2 /tmp/payload
grep -qx '/.dev1/' .git/info/exclude || printf '/.dev1/\n/.dev2/\n' >> .git/info/exclude
[ -f /tmp/payload/target.gguf.xz ] || xz -9 -T2 -c "$G" > /tmp/payload/target.gguf.xz
tar -cf .dev1/corpus.tar corpus
INIT_CKPT=${INIT_CKPT:-smollm2-135m-instruct-eagle3.1}  # the drafter the GPU rounds continue (the release: round 17 since session 41)
tar -cJf .dev1/ckpt.tar.xz -C checkpoints --transform "s|^$INIT_CKPT|init|" "$INIT_CKPT"
pip download -q --no-deps gguf==0.19.0 -d .dev1
cp benchmarks/results/gpu-s40/device_tests.sh .dev1/tests.sh
cp benchmarks/results/gpu-s40/device_go.sh .dev2/go.sh && cp benchmarks/results/gpu-s40/device_pack.py .dev2/pack.py
# the first call holds the tree (~2 MB) and .dev1: fill it to ~62 MB with the head of the GGUF
room=$(( 62000000 - $(du -cb .dev1/* | tail -1 | cut -f1) - 2000000 ))
head -c $room /tmp/payload/target.gguf.xz > .dev1/gguf.xz.a
tail -c +$(( room + 1 )) /tmp/payload/target.gguf.xz > .dev2/gguf.xz.b
sha256sum "$G" | cut -c1-64 > .dev2/gguf.sha256
du -cb .dev1/* | tail -1; du -cb .dev2/* | tail -1
