"""Model configurations for `dummy:<name>` specs (random weights, real shapes).

Each configuration is a JSON file `<name>.json` holding what a model directory's `config.json`
would: the hyperparameters the model is built from, nothing else. The built-in ones live in
`dummy_models/` beside this module (shipped as package data; its README says what each is for).
`$TANDEM_DUMMY_MODELS_PATH` names more directories of such files (separated by `os.pathsep`, read
at every lookup, so a process and the servers it starts see the same set); the test suite adds
its test-only models (`tests/dummy_models/`) this way. A name found in two directories is an error.

Every hybrid configuration (one with Gated DeltaNet layers, i.e. `linear_num_value_heads`) also
has a derived `<name>-full-attention`: the same config with every layer full (gated) attention,
the same depth and shapes without recurrent state (the comparison side of `tandem bench prefix`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

BUILTIN_DIR = Path(__file__).resolve().parent / "dummy_models"
PATH_ENV = "TANDEM_DUMMY_MODELS_PATH"
FULL_ATTENTION_SUFFIX = "-full-attention"


def search_dirs() -> list[Path]:
    """The directories searched: `$TANDEM_DUMMY_MODELS_PATH`'s entries, then the built-in one."""
    extra = [Path(p).expanduser() for p in os.environ.get(PATH_ENV, "").split(os.pathsep) if p]
    return [*extra, BUILTIN_DIR]


def _config_files() -> dict[str, Path]:
    """name -> file over every search directory; raises `ValueError` when a name is in two."""
    files: dict[str, Path] = {}
    for directory in search_dirs():
        if not directory.is_dir():
            continue
        for path in sorted(directory.glob("*.json")):
            if path.stem in files and files[path.stem] != path:
                raise ValueError(f"dummy config {path.stem!r} is defined twice: {files[path.stem]} and {path}")
            files[path.stem] = path
    return files


def _is_hybrid(cfg: dict[str, Any]) -> bool:
    return "linear_num_value_heads" in cfg


def _all_full_attention(cfg: dict[str, Any]) -> dict[str, Any]:
    return cfg | {"layer_types": ["full_attention"] * cfg["num_hidden_layers"]}


def _read(path: Path) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def dummy_config_names() -> list[str]:
    """Every name `get_dummy_config` accepts, sorted (the files and the hybrids' twins)."""
    files = _config_files()
    twins = [name + FULL_ATTENTION_SUFFIX for name, path in files.items() if _is_hybrid(_read(path))]
    return sorted([*files, *twins])


def get_dummy_config(name: str) -> dict[str, Any]:
    """A fresh copy of the named config; raises `KeyError` listing the known names."""
    files = _config_files()
    if name in files:
        return _read(files[name])
    base = name.removesuffix(FULL_ATTENTION_SUFFIX)
    if base != name and base in files:
        cfg = _read(files[base])
        if _is_hybrid(cfg):
            return _all_full_attention(cfg)
    raise KeyError(f"unknown dummy config {name!r}; known: {', '.join(dummy_config_names())}")
