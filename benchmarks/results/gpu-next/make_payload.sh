#!/usr/bin/env bash
# The next GPU round under today's device limits (15 minutes of device time a session, 64 MiB a call for the
# tree plus what is carried, no network there): everything the machine needs goes as ONE tarball (the target's
# GGUF, the corpus with its T=1 and long folders, both releases to continue, the gguf wheel), split into chunks that
# travel in consecutive calls inside the machine's 30 s warm window.
#   1. bash benchmarks/results/gpu-next/make_payload.sh    (.dev1/ .. .devN/, git-ignored; prints the calls)
#   2. move checkpoints/ corpus/ benchmarks/results/* (but gpu-next) out of the tree (~2 MB left)
#   3. calls 1..N-1, carry [".devK"]:  mkdir -p /root/stage && cp .devK/* /root/stage/ && ls /root/stage
#      call N, carry [".devN"]:       BUDGET=420 bash .devN/go.sh
#   4. move the folders back; see go.sh for what comes back in $OUT and how to unpack it
set -euo pipefail
cd "$(dirname "$0")/../../.."
HERE=benchmarks/results/gpu-next
CHUNK=${CHUNK:-58000000}  # bytes a call carries beside the ~2 MB tree
G=$(python -c "from anchorspec.models.hub import alias_gguf; print(alias_gguf('smollm2-135m-instruct'))")
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
mkdir -p "$W/p/data" "$W/p/site"
cp "$G" "$W/p/target.gguf"; sha256sum "$G" | cut -c1-64 > "$W/p/target.gguf.sha256"
cp -r corpus/smollm2-135m-instruct corpus/smollm2-135m-instruct-t1 corpus/smollm2-135m-instruct-long "$W/p/data/"
for v in eagle3.1 eagle3; do cp -r checkpoints/smollm2-135m-instruct-$v "$W/p/data/init-$v"; done
pip download -q --no-deps gguf==0.19.0 -d "$W/p/site"
tar -C "$W/p" -cf - . | xz -6 -T2 > "$W/payload.tar.xz"
rm -rf .dev[0-9]*; X=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$X")"
grep -qsx '/.dev\*/' "$X" || echo '/.dev*/' >> "$X"
split -b "$CHUNK" -d -a 1 "$W/payload.tar.xz" "$W/payload.tar.xz."
n=0; for c in "$W"/payload.tar.xz.*; do n=$((n + 1)); mkdir -p .dev$n; mv "$c" .dev$n/; done
cp $HERE/go.sh $HERE/train_gpu.sh benchmarks/results/gpu-s42/device_tests.sh benchmarks/results/gpu-s40/device_pack.py .dev$n/
du -sh .dev*; echo "calls: 1..$((n - 1)) copy into /root/stage; call $n: BUDGET=420 bash .dev$n/go.sh"
