"""Import kvrelay from a plain checkout, without pip: for bare GPU machines that have torch, triton
and transformers but cannot install kvrelay.

pyproject.toml's package-dir spreads `kvrelay` over several folders. map_kvrelay() builds that
package as a tree of symbolic links in a temporary folder (src/kvrelay's entries, and each top-level
subpackage's folder) and puts the folder first on sys.path and on PYTHONPATH, so the processes the
engine starts (spawned parallel ranks, the engine-core process, workers) import it the same way.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def package_dirs(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, Path]:
    """{package: folder} from [tool.setuptools.package-dir] (read with a regex: tomllib is 3.11+)."""
    text = pyproject.read_text()
    section = text.split("[tool.setuptools.package-dir]", 1)[1].split("\n[", 1)[0]
    return {m[1]: ROOT / m[2] for m in re.finditer(r'^"([\w.]+)"\s*=\s*"([^"]+)"', section, re.MULTILINE)}


def link_tree(target: Path, dirs: dict[str, Path] | None = None) -> Path:
    """target/kvrelay: links to the root package's entries and to every top-level subpackage's folder
    (deeper subpackages live inside their parent's folder, as setuptools requires of them)."""
    dirs = package_dirs() if dirs is None else dirs
    package = target / "kvrelay"
    package.mkdir(parents=True)
    for entry in dirs["kvrelay"].iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name, folder in dirs.items():
        parts = name.split(".")
        if len(parts) == 2 and not (package / parts[1]).exists():
            (package / parts[1]).symlink_to(folder)
        elif len(parts) > 2 and folder != dirs[".".join(parts[:-1])] / parts[-1]:
            raise ValueError(f"{name} is not in its parent package's folder: extend link_tree")
    return target


def map_kvrelay() -> None:
    """Make `import kvrelay...` work here and in child processes; a no-op where kvrelay is installed."""
    try:
        import kvrelay.engine  # noqa: F401

        return
    except ImportError:
        pass
    tree = str(link_tree(Path(tempfile.mkdtemp(prefix="kvrelay-packages-"))))
    sys.path.insert(0, tree)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH")) if p)
    for name in [m for m in sys.modules if m == "kvrelay" or m.startswith("kvrelay.")]:
        del sys.modules[name]  # the failed import above may have left a partial `kvrelay`


if __name__ == "__main__":  # `export PYTHONPATH=$(python3 benchmarks/package_map.py)`: tests on a bare machine
    tree = link_tree(Path(tempfile.mkdtemp(prefix="kvrelay-packages-")))
    print(os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p))
