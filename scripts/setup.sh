#!/usr/bin/env bash
# One-command setup: venv, pinned dependencies, protobuf code, embedded model pair (offline after this).
# SPECDEC_SKIP_MODELS=1 skips the model download/conversion (CI runs only tiny in-process models).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "setup: $PYTHON is $("$PYTHON" -V 2>&1); specdec needs Python 3.11 or newer (PYTHON=python3.12 make setup picks one)" >&2
    exit 1
fi
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# torch first, pinned, and the CPU build: PyPI's torch==2.13.0 for Linux x86_64 is the CUDA build (GBs
# of CUDA libraries). The PyTorch CPU index is an extra index, so a mirror or find-links in pip's own
# configuration that serves 2.13.0+cpu works too where that index cannot be reached (pip then warns
# and goes on); TORCH_INDEX_URL="" uses pip's configuration alone, another URL another build.
TORCH_INDEX_URL="${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}"
# An index out of reach costs pip about 8 s of retries for torch and for each of its dependencies:
# looked at once here, and left out if it does not answer.
if [ -n "$TORCH_INDEX_URL" ] && ! .venv/bin/python - "$TORCH_INDEX_URL" <<'PROBE'
import sys
import urllib.request
try:
    urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=10).read(1)
except Exception as exc:  # noqa: BLE001 - any failure: not reachable from here
    print(f"setup: {sys.argv[1]} is out of reach ({exc}); torch comes from pip's own configuration")
    sys.exit(1)
PROBE
then
    TORCH_INDEX_URL=""
fi
.venv/bin/python -m pip install --quiet ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[worker,test]"
.venv/bin/python scripts/gen_protos.py
if [ "${SPECDEC_SKIP_MODELS:-0}" != "1" ]; then
    .venv/bin/python -m specdec.embedded
fi
echo "setup done: run 'make test' or 'make demo'"
