"""The folders are the import paths: every Python file of a distribution sits at the path its
module name spells, relative to that distribution's folder, and Python finds it there."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The top-level folders that are distributions, each contributing to the `tandem` namespace.
DISTRIBUTIONS = ("protos", "common", "frontend", "kernels", "engine_service", "tools")


def _module_files(dist: str) -> list[Path]:
    # Build output (build/, *.egg-info) is not source: git ignores it, and so does this check.
    return sorted(p for p in (REPO / dist).rglob("*.py")
                  if not {"__pycache__", "build"} & set(p.parts) and not any(x.endswith(".egg-info") for x in p.parts))


def _module_name(dist: str, path: Path) -> str:
    parts = list(path.relative_to(REPO / dist).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_every_python_file_is_found_at_its_module_path(dist):
    files = _module_files(dist)
    assert files, f"{dist}/ holds no Python file"
    for path in files:
        assert path.relative_to(REPO / dist).parts[0] == "tandem", f"{path} is outside {dist}/tandem/"
        name = _module_name(dist, path)
        spec = importlib.util.find_spec(name)
        assert spec is not None, f"{name} ({path}) is not importable"
        assert Path(spec.origin).resolve() == path.resolve(), f"{name} resolves to {spec.origin}, not {path}"


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_each_folder_is_a_distribution_of_the_tandem_namespace(dist):
    # No portion may own `tandem/__init__.py`: one would hide every other distribution's modules.
    assert not (REPO / dist / "tandem" / "__init__.py").exists()
    project = tomllib.loads((REPO / dist / "pyproject.toml").read_text())
    assert project["project"]["name"].startswith("tandem-")
    assert project["tool"]["setuptools"]["packages"]["find"]["namespaces"] is True


def test_the_root_distribution_installs_every_folder():
    root = tomllib.loads((REPO / "pyproject.toml").read_text())
    names = {tomllib.loads((REPO / d / "pyproject.toml").read_text())["project"]["name"] for d in DISTRIBUTIONS}
    assert set(root["project"]["dependencies"]) == names
    assert "package-dir" not in root["tool"]["setuptools"]


def test_the_frontend_distribution_does_not_depend_on_torch():
    def deps(dist: str) -> list[str]:
        return tomllib.loads((REPO / dist / "pyproject.toml").read_text())["project"]["dependencies"]

    for dist in ("protos", "common", "frontend"):
        assert not any(d.split(">")[0].split("=")[0].strip() in ("torch", "triton", "tandem-engine", "tandem-kernels")
                       for d in deps(dist)), dist
