"""The repo's folders map onto one import root and shadow no stdlib module."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_from_root(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_stdlib_operator_is_not_shadowed_from_repo_root():
    # Run in a fresh interpreter whose sys.path[0] is the repo root.
    path = run_from_root("import operator; print(operator.__file__)")
    assert not path.startswith(str(ROOT)), path
    assert run_from_root("import operator; print(operator.add(2, 3))") == "5"


def test_kvrelay_operator_is_ours():
    path = run_from_root("import kvrelay.operator as o; print(o.__file__)")
    assert path.startswith(str(ROOT / "operator")), path


def test_no_root_folder_is_a_regular_package():
    """A root folder with __init__.py would win over an installed package of its name whenever the
    repo root is sys.path[0] (transformers 5.25 imports the `kernels` package that kernels/ once hid);
    a folder without one is only a namespace portion, which any installed package beats."""
    for child in ROOT.iterdir():
        if child.is_dir() and not child.name.startswith("."):
            assert not (child / "__init__.py").exists(), f"{child.name}/ could shadow a module named {child.name}"


def test_kvrelay_kernels_is_ours_and_kernels_is_not():
    path = run_from_root("import kvrelay.kernels as k; print(k.__file__)")
    assert path.startswith(str(ROOT / "kernels" / "ops")), path
    origin = run_from_root("import importlib.util as u; s = u.find_spec('kernels'); print(s and s.origin)")
    assert not origin.startswith(str(ROOT / "kernels")), origin  # "None" when no `kernels` is installed


def test_subpackages_map_to_design_folders():
    import kvrelay.engine
    import kvrelay.kernels

    assert Path(kvrelay.engine.__file__).parent == ROOT / "services" / "engine"
    assert Path(kvrelay.kernels.__file__).parent == ROOT / "kernels" / "ops"


def test_bundled_model_is_packaged():
    from kvrelay.models import BUNDLED_MODEL

    for name in ("config.json", "model.safetensors", "tokenizer.json", "README.md", "LICENSE"):
        assert (BUNDLED_MODEL / name).is_file(), name


def test_wheel_carries_every_subpackage_and_the_bundled_model(tmp_path):
    import zipfile

    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("kvrelay-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in (
        "kvrelay/cli.py",
        "kvrelay/engine/llm_engine.py",
        "kvrelay/kernels/registry.py",
        "kvrelay/operator/__init__.py",
        "kvrelay/models/stories260K/model.safetensors",
        "kvrelay/models/stories260K/LICENSE",
    ):
        assert module in names, module
    assert not any(n.startswith("operator/") for n in names)
    # Every source file under a mapped folder ships: a subpackage left out of pyproject's list
    # works in the editable checkout and is missing from the image.
    import tomllib

    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in package_dir.items():
        for source in (ROOT / folder).glob("*.py"):
            assert f"{package.replace('.', '/')}/{source.name}" in names, source.relative_to(ROOT)
    for init in ROOT.glob("services/**/__init__.py"):
        assert init.parent.relative_to(ROOT).as_posix() in package_dir.values(), f"{init.parent} is not mapped"
