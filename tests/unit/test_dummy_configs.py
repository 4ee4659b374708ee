"""`dummy:<name>` configs: JSON files in the built-in folder and on `$TANDEM_DUMMY_MODELS_PATH`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.engine_service import dummy_configs
from tandem.engine_service.dummy_configs import BUILTIN_DIR, PATH_ENV, dummy_config_names, get_dummy_config

TESTS_DIR = Path(__file__).resolve().parent.parent / "dummy_models"


def test_builtin_and_test_models_are_found_and_test_only_ones_are_not_shipped() -> None:
    builtin = {p.stem for p in BUILTIN_DIR.glob("*.json")}
    test_only = {p.stem for p in TESTS_DIR.glob("*.json")}
    assert {"qwen3-0.6b", "qwen3-next-80b-a3b", "tiny-qwen3.5"} <= builtin
    assert {"tiny-qwen2", "tiny-mistral", "tiny-qwen3-sw", "tiny-qwen3-moe"} == test_only
    assert not builtin & test_only
    # tests/conftest.py put the test folder on the search path of this process.
    assert builtin | test_only <= set(dummy_config_names())
    for name in builtin | test_only:
        assert get_dummy_config(name) == json.loads(
            ((TESTS_DIR if name in test_only else BUILTIN_DIR) / f"{name}.json").read_text())


def test_without_the_search_path_only_builtin_models_exist(monkeypatch) -> None:
    monkeypatch.delenv(PATH_ENV)
    assert "tiny-qwen3" in dummy_config_names() and "tiny-qwen2" not in dummy_config_names()
    with pytest.raises(KeyError, match="unknown dummy config 'tiny-qwen2'; known: .*tiny-qwen3"):
        get_dummy_config("tiny-qwen2")


def test_search_path_adds_directories_and_rejects_a_name_defined_twice(tmp_path: Path, monkeypatch) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "mine.json").write_text(json.dumps({"hidden_size": 8}))
    monkeypatch.setenv(PATH_ENV, os.pathsep.join([str(a), str(tmp_path / "missing"), str(b)]))
    assert get_dummy_config("mine") == {"hidden_size": 8}
    assert "mine" in dummy_config_names() and "qwen3-8b" in dummy_config_names()
    (b / "qwen3-8b.json").write_text("{}")
    with pytest.raises(ValueError, match="'qwen3-8b' is defined twice"):
        get_dummy_config("mine")


def test_each_call_returns_a_fresh_copy() -> None:
    cfg = get_dummy_config("llama-3.1-8b")
    cfg["rope_scaling"]["factor"] = 0.0
    cfg["eos_token_id"].append(7)
    again = get_dummy_config("llama-3.1-8b")
    assert again["rope_scaling"]["factor"] == 8.0 and again["eos_token_id"] == [128001, 128008, 128009]


def test_hybrids_and_only_hybrids_have_a_full_attention_twin() -> None:
    names = dummy_config_names()
    for base in ("tiny-qwen3.5", "tiny-qwen3-next", "qwen3.5-9b", "qwen3-next-80b-a3b"):
        twin = get_dummy_config(base + dummy_configs.FULL_ATTENTION_SUFFIX)
        cfg = get_dummy_config(base)
        assert "layer_types" not in cfg
        assert twin == cfg | {"layer_types": ["full_attention"] * cfg["num_hidden_layers"]}
        assert base + "-full-attention" in names
    for plain in ("tiny-qwen3", "qwen3-8b", "tiny-qwen3-moe"):
        assert plain + "-full-attention" not in names
        with pytest.raises(KeyError):
            get_dummy_config(plain + "-full-attention")


def test_a_server_subprocess_finds_test_only_models() -> None:
    """The variable set by tests/conftest.py reaches child processes (the servers tests start)."""
    code = ("from tandem.model_spec import check_model_spec; check_model_spec('dummy:tiny-qwen3-sw'); "
            "from tandem.engine_service.dummy_configs import get_dummy_config; "
            "print(get_dummy_config('tiny-qwen3-sw')['sliding_window'])")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, cwd="/", timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "8"
