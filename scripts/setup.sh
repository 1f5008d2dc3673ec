#!/usr/bin/env bash
# Create .venv and install kvrelay with its test dependencies at the locked versions. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
quiet() { "$@" 2> >(grep -v "^WARNING: Location" >&2); }  # pip's notes about this machine's offline indexes
# torch first: the CPU wheel on disk (scripts/torch.pin).
.venv/bin/python -c "import torch" 2>/dev/null || quiet .venv/bin/pip install -q -r scripts/torch.pin
# Every other dependency at exactly the version in requirements-test.lock, checked against its hashes
# (scripts/lock.sh writes the lock from pyproject.toml's ranges); then kvrelay itself, resolving nothing.
quiet .venv/bin/pip install -q --require-hashes --no-deps -r requirements-test.lock
quiet .venv/bin/pip install -q --no-deps -e .
.venv/bin/python -c "import kvrelay, torch; print('kvrelay ready, torch', torch.__version__)"
