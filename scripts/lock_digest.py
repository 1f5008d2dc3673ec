"""Print the sha256 of pyproject.toml's dependency lists (runtime + test) and the torch pin:
recorded in the lock files by scripts/lock.sh, compared by tests/test_lock.py."""

from __future__ import annotations

import hashlib
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def digest() -> str:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = sorted(project["dependencies"]) + ["[test]"] + sorted(project["optional-dependencies"]["test"])
    pin = [x for x in (ROOT / "scripts" / "torch.pin").read_text().splitlines() if x and not x.startswith("#")]
    return hashlib.sha256("\n".join(lines + ["[torch]"] + pin).encode()).hexdigest()


if __name__ == "__main__":
    print(digest())
