"""Checks before a server starts (one clear error naming the flag) and `--model org/name`
resolving through the local Hugging Face cache."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from tandem import startup_checks
from tandem.model_spec import ModelSpecError, check_model_spec, is_hub_id
from tandem.startup_checks import StartupError


def test_model_spec_kinds(tmp_path):
    check_model_spec("smollm2-135m-instruct")
    check_model_spec("dummy:tiny-qwen3")
    (tmp_path / "config.json").write_text("{}")
    check_model_spec(str(tmp_path))
    for bad, needle in (("dummy:nope", "unknown dummy config"), ("/nonexistent/model", "no such file"),
                        (str(tmp_path / "config.json"), "neither a model directory")):
        with pytest.raises(ModelSpecError, match=needle):
            check_model_spec(bad)
    assert is_hub_id("Qwen/Qwen3-0.6B") and not is_hub_id("/abs/path") and not is_hub_id("a/b/c")


def test_bad_model_names_the_flag():
    with pytest.raises(StartupError) as exc:
        startup_checks.check_model("/nonexistent/model")
    assert str(exc.value).startswith("--model /nonexistent/model: ")


def test_port_in_use_names_the_flag():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(StartupError, match=f"--engine-port {port}: .*already in use"):
            startup_checks.check_port_free("--engine-port", "127.0.0.1", port)
    startup_checks.check_port_free("--engine-port", "127.0.0.1", port)  # free again


def test_pem_files(tmp_path):
    good = tmp_path / "cert.pem"
    good.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    plain = tmp_path / "notes.txt"
    plain.write_text("hello")

    class Args:
        tls_cert = str(good)
        engine_tls_ca = str(plain)

    startup_checks.check_pem_files(Args())
    with pytest.raises(StartupError, match="--engine-tls-ca .*not a PEM file"):
        startup_checks.check_pem_files(Args(), "engine-")
    Args.tls_cert = str(tmp_path)
    with pytest.raises(StartupError, match="--tls-cert .*cannot read it"):
        startup_checks.check_pem_files(Args())


@pytest.mark.parametrize("argv,message", [
    (["--max-num-seqs", "0"], "max_num_seqs must be >= 1"),
    (["--block-size", "24"], "block_size must be a power of two"),
    (["--kv-lease-seconds", "0"], "kv lease seconds must be > 0"),
])
def test_invalid_engine_config_is_a_startup_error(argv, message):
    """The engine's configs validate themselves when the CLI builds them, so a bad value is a
    start-up error (one line, exit 2), not a failure of the engine core after it loaded the model."""
    from tandem import cli, options

    args = options.parse_args(cli.build_parser(), ["engine", "--model", "dummy:tiny-qwen3", *argv], environ={})
    with pytest.raises(StartupError) as exc:
        cli._check_engine_flags(args)
    assert str(exc.value) == message


def test_unreachable_engine_names_the_flag():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        with pytest.raises(StartupError, match=f"--engine 127.0.0.1:{port}: no engine answers"):
            startup_checks.check_engines_reachable([f"127.0.0.1:{port}"], timeout=0.5)
    with pytest.raises(StartupError, match="expected HOST:PORT"):
        startup_checks.check_engines_reachable(["nowhere"], timeout=0.5)


def _fake_hub_cache(root, repo_id: str) -> str:
    """The on-disk layout huggingface_hub keeps for a downloaded model."""
    folder = root / ("models--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    (snapshot / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return str(snapshot)


def test_hub_id_resolves_through_the_local_cache_offline(tmp_path):
    snapshot = _fake_hub_cache(tmp_path, "someorg/tiny-model")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    code = ("from tandem.model_spec import resolve_hub_model, check_model_spec\n"
            "check_model_spec('someorg/tiny-model')\n"
            "print(resolve_hub_model('someorg/tiny-model'))\n"
            "try:\n    check_model_spec('someorg/absent')\nexcept Exception as e:\n    print('ERR', e)\n"
            "from tandem.engine_service.worker.loader import resolve_model\n"
            "print(resolve_model('someorg/tiny-model').path)\n")
    out = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == snapshot
    assert lines[1].startswith("ERR") and "HF_HUB_OFFLINE" in lines[1]
    assert lines[2] == snapshot  # the engine's loader resolves the id the same way
