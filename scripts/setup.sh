#!/usr/bin/env bash
# One-command setup: venv, pinned dependencies, protobuf code, embedded model pair (offline after this).
# SPECDEC_SKIP_MODELS=1 skips the model download/conversion (CI runs only tiny in-process models).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[worker,test]"
.venv/bin/python scripts/gen_protos.py
if [ "${SPECDEC_SKIP_MODELS:-0}" != "1" ]; then
    .venv/bin/python -m specdec.embedded
fi
echo "setup done: run 'make test' or 'make demo'"
