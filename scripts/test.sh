#!/usr/bin/env bash
# Set up everything the tests need on a fresh machine, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Services and tools the tests use (redis-server, promtool, helm, ...): one script each.
for s in scripts/ci.d/*.sh; do
  [ -e "$s" ] || continue
  echo "== $s"
  bash "$s"
done
export PATH="$PWD/.venv/bin:$PATH"
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
