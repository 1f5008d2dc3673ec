#!/usr/bin/env bash
# Set up (first time only) and run the main job: `kvrelay serve` on the bundled model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/kvrelay serve "$@"
