#!/usr/bin/env bash
# Create .venv and install kvrelay with its test dependencies. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# torch first: the CPU wheel on disk. Any range it satisfies then installs nothing more.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q "torch==2.13.0"
.venv/bin/pip install -q -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import kvrelay, torch; print('kvrelay ready, torch', torch.__version__)"
