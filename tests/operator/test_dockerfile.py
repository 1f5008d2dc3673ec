"""The Dockerfile builds the one image from files that exist, with `kvrelay` as entrypoint."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def test_copied_paths_exist_and_cover_every_package_folder():
    sources = [src for line in re.findall(r"^COPY (?!--from)(.+)$", DOCKERFILE, re.MULTILINE) for src in line.split()[:-1]]
    for src in sources:
        assert (ROOT / src).exists(), src
    pyproject = (ROOT / "pyproject.toml").read_text()
    package_dirs = re.findall(r'^"kvrelay[^"]*" = "([^"]+)"', pyproject, re.MULTILINE)
    top_folders = {d.split("/")[0] for d in package_dirs}
    assert top_folders <= set(sources), top_folders - set(sources)


def test_entrypoint_is_kvrelay_and_the_example_model_path_is_linked():
    (entrypoint,) = re.findall(r"^ENTRYPOINT (.+)$", DOCKERFILE, re.MULTILINE)
    assert json.loads(entrypoint) == ["kvrelay"]
    example = yaml.safe_load((ROOT / "examples/inferenceservice.yaml").read_text())
    assert example["spec"]["model"]["uri"] in DOCKERFILE


def test_installs_the_lock_with_hashes_and_labels_its_versions():
    assert "pip install --require-hashes --no-deps -r requirements.lock" in DOCKERFILE
    assert "pip install --no-deps ." in DOCKERFILE  # nothing resolved past the lock
    labels = " ".join(re.findall(r"^LABEL ((?:.*\\\n)*.*)$", DOCKERFILE, re.MULTILINE))
    for key, arg in (("org.opencontainers.image.version", "KVRELAY_VERSION"), ("io.kvrelay.torch.version",
                     "TORCH_VERSION"), ("io.kvrelay.requirements-lock.sha256", "LOCK_SHA256")):
        assert f'{key}="${{{arg}}}"' in labels
        assert f"--build-arg {arg}=" in (ROOT / "scripts/docker-build.sh").read_text()
