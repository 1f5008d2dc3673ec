"""Import kvrelay from a plain checkout, without pip: each package of pyproject.toml's package-dir
is loaded from its folder, as setuptools would map it. For bare GPU machines that have torch,
triton and transformers but cannot install kvrelay."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def package_dirs(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, Path]:
    """{package: folder} from [tool.setuptools.package-dir] (read with a regex: tomllib is 3.11+)."""
    text = pyproject.read_text()
    section = text.split("[tool.setuptools.package-dir]", 1)[1].split("\n[", 1)[0]
    return {m[1]: ROOT / m[2] for m in re.finditer(r'^"([\w.]+)"\s*=\s*"([^"]+)"', section, re.MULTILINE)}


def map_kvrelay() -> None:
    """Make `import kvrelay...` work; a no-op where kvrelay is installed."""
    try:
        import kvrelay.engine  # noqa: F401

        return
    except ImportError:
        pass
    for name, folder in sorted(package_dirs().items(), key=lambda kv: kv[0].count(".")):
        if name in sys.modules:
            continue
        spec = importlib.util.spec_from_file_location(
            name, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
