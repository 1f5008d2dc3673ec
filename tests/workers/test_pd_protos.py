"""The committed kvrelay.v1 code is what grpc_tools generates from protos/kvrelay/v1/*.proto."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "protos" / "kvrelay" / "v1"

# Lines that name the generator's version: a newer grpcio-tools may change them and nothing else.
_VERSION_LINES = [
    (re.compile(r"^# Protobuf Python Version: .*$", re.MULTILINE), "# Protobuf Python Version: X"),
    (re.compile(r"_runtime_version\.Domain\.PUBLIC,\s*\d+,\s*\d+,\s*\d+,\s*'[^']*',"),
     "_runtime_version.Domain.PUBLIC, X,"),
    (re.compile(r"^GRPC_GENERATED_VERSION = '[^']*'$", re.MULTILINE), "GRPC_GENERATED_VERSION = 'X'"),
]


def _normalize(text: str) -> str:
    for pattern, repl in _VERSION_LINES:
        text = pattern.sub(repl, text)
    return text


def test_generated_code_matches_protos(tmp_path):
    out = tmp_path / "protos"
    shutil.copytree(ROOT / "protos", out, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    protos = sorted(str(p.relative_to(out)) for p in (out / "kvrelay" / "v1").glob("*.proto"))
    assert len(protos) == 5
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", ".", "--python_out=.", "--grpc_python_out=.",
                    *protos], cwd=out, check=True)
    generated = sorted((out / "kvrelay" / "v1").glob("*_pb2*.py"))
    assert {p.name for p in generated} == {p.name for p in PROTO_DIR.glob("*_pb2*.py")}
    for path in generated:
        committed = (PROTO_DIR / path.name).read_text()
        assert _normalize(path.read_text()) == _normalize(committed), (
            f"{path.name} is stale: regenerate with `python -m grpc_tools.protoc -I protos --python_out=protos "
            f"--grpc_python_out=protos protos/kvrelay/v1/*.proto`")


def test_generated_imports_use_the_package_name():
    for path in PROTO_DIR.glob("*_pb2*.py"):
        for line in path.read_text().splitlines():
            if line.startswith(("import ", "from ")) and "_pb2" in line:
                assert line.startswith("from kvrelay.v1 import "), f"{path.name}: {line}"
