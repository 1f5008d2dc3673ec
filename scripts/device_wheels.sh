#!/usr/bin/env bash
# Wheels the device checks need that the bare GPU image lacks, into .whl/ (git-ignored): run here,
# where PyPI is reachable, then name .whl in the device call's `carry`; scripts/device_check.sh
# installs them there. Today: pytest-asyncio (the CUDA IPC tests are async; the image has pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('pytest-asyncio'))")
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl "pytest-asyncio==$version"
ls .whl
