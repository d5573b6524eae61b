#!/usr/bin/env bash
# Session 42's way onto the lent GPU machine (as session 40's, benchmarks/results/gpu-s40/make_payload.sh:
# 64 MiB per call, the target's GGUF over two calls; a warm machine keeps /root between calls for 30 s):
#   1. bash benchmarks/results/gpu-s42/make_payload.sh   (.dev1/ and .dev2/, git-ignored)
#   2. move checkpoints/ corpus/ and benchmarks/results/* (but gpu-s40, gpu-s42) out of the tree (~2 MB left)
#   3. call 1, carry [".dev1"]: unpack into /root (stage, data, site), copy the tree to /root/repo, start
#      device_tests.sh there with setsid (the command is in device_call1.txt)
#   4. call 2 at once, carry [".dev2"]: BUDGET=480 bash .dev2/go.sh (data job and round 18 side by side)
#   5. move the folders back; cat drafter.tar.xz.* | tar -xJ; tar -xJf gen.tar.xz
# SCRIPTS: the folder whose device_tests.sh and device_go.sh travel (session 40's: benchmarks/results/gpu-s40)
set -euo pipefail
cd "$(dirname "$0")/../../.."
G=$(python -c "from anchorspec.models.hub import alias_gguf; print(alias_gguf('smollm2-135m-instruct'))")
rm -rf .dev1 .dev2; mkdir -p .dev1 .dev2 /tmp/payload
grep -qx '/.dev1/' .git/info/exclude || printf '/.dev1/\n/.dev2/\n' >> .git/info/exclude
[ -f /tmp/payload/target.gguf.xz ] || xz -9 -T2 -c "$G" > /tmp/payload/target.gguf.xz
tar -cf .dev1/corpus.tar corpus
INIT_CKPT=${INIT_CKPT:-smollm2-135m-instruct-eagle3.1}  # the drafter the GPU round continues: the release (round 18 since session 42)
tar -cJf .dev1/ckpt.tar.xz -C checkpoints --transform "s|^$INIT_CKPT|init|" "$INIT_CKPT"
pip download -q --no-deps gguf==0.19.0 -d .dev1
SCRIPTS=${SCRIPTS:-benchmarks/results/gpu-s42}
cp $SCRIPTS/device_tests.sh .dev1/tests.sh
cp $SCRIPTS/device_go.sh .dev2/go.sh && cp benchmarks/results/gpu-s40/device_pack.py .dev2/pack.py
# the first call holds the tree (~2 MB) and .dev1: fill it to ~62 MB with the head of the GGUF
room=$(( 62000000 - $(du -cb .dev1/* | tail -1 | cut -f1) - 2500000 ))
head -c $room /tmp/payload/target.gguf.xz > .dev1/gguf.xz.a
tail -c +$(( room + 1 )) /tmp/payload/target.gguf.xz > .dev2/gguf.xz.b
sha256sum "$G" | cut -c1-64 > .dev2/gguf.sha256
du -cb .dev1/* | tail -1; du -cb .dev2/* | tail -1
