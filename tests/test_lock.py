"""The pinned environment: requirements-test.lock and requirements.lock say exactly what
scripts/setup.sh, CI and the Dockerfile install, and stay in sync with pyproject.toml."""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from lock_digest import digest

PIN = re.compile(r"^([A-Za-z0-9._-]+)==([^ ;\\]+)(?: ;[^\\]*)? \\$")  # name==version [; marker] \


def _pins(name: str) -> dict[str, str]:
    text = (ROOT / name).read_text()
    pins = {canonicalize_name(m.group(1)): m.group(2) for line in text.splitlines() if (m := PIN.match(line))}
    # Every pinned distribution carries its hashes on the following lines.
    blocks = re.split(r"\n(?=[A-Za-z0-9])", text)
    for block in blocks:
        if PIN.match(block.splitlines()[0]):
            assert "--hash=sha256:" in block, block.splitlines()[0]
    return pins


def _requirements() -> tuple[list[Requirement], list[Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return ([Requirement(r) for r in project["dependencies"]],
            [Requirement(r) for r in project["optional-dependencies"]["test"]])


@pytest.mark.parametrize("lock", ["requirements.lock", "requirements-test.lock"])
def test_lock_was_generated_from_this_pyproject(lock):
    text = (ROOT / lock).read_text()
    recorded = re.findall(r"^# pyproject-dependencies-sha256: ([0-9a-f]{64})$", text, re.MULTILINE)
    assert recorded == [digest()], f"{lock} is out of date: run `bash scripts/lock.sh`"


def test_every_dependency_is_pinned_inside_its_range():
    runtime, test = _requirements()
    pins, test_pins = _pins("requirements.lock"), _pins("requirements-test.lock")
    for req, locked in [(r, pins) for r in runtime] + [(r, test_pins) for r in runtime + test]:
        name = canonicalize_name(req.name)
        if name == "torch" or (req.marker and not req.marker.evaluate({"sys_platform": "linux"})):
            continue
        assert name in locked, f"{req.name} is not pinned"
        assert req.specifier.contains(locked[name], prereleases=True), (req, locked[name])
    assert "torch" not in pins and "torch" not in test_pins  # installed first, from scripts/torch.pin
    # The image runs exactly the versions the tests ran with.
    assert {n: v for n, v in pins.items() if n in test_pins} == pins


def test_torch_pin_fits_the_range():
    (torch_req,) = [r for r in _requirements()[0] if r.name == "torch"]
    pin = [x for x in (ROOT / "scripts/torch.pin").read_text().splitlines() if x and not x.startswith("#")]
    assert pin == ["torch==2.13.0"] and torch_req.specifier.contains("2.13.0")


def test_this_environment_was_installed_from_the_lock():
    runtime, test = _requirements()
    pins = _pins("requirements-test.lock")
    for req in runtime + test:
        name = canonicalize_name(req.name)
        if name in pins:
            assert metadata.version(req.name) == pins[name], f"{req.name}: rerun `bash scripts/setup.sh`"
