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
    good, _ = _self_signed(tmp_path)
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
    (["--max-num-seqs", "0"], "--max-num-seqs 0: max_num_seqs must be >= 1"),
    (["--block-size", "24"], "--block-size 24: block_size must be a power of two"),
    (["--kv-lease-seconds", "0"], "--kv-lease-seconds 0.0: kv lease seconds must be > 0"),
])
def test_invalid_engine_config_is_a_startup_error_naming_the_flag(argv, message):
    """The engine's configs validate themselves when the CLI builds them, so a bad value is a
    start-up error (one line naming the flag, exit 2), not a failure of the engine core after it
    loaded the model."""
    from tandem import cli, options

    args = options.parse_args(cli.build_parser(), ["engine", "--model", "dummy:tiny-qwen3", *argv], environ={})
    with pytest.raises(StartupError) as exc:
        cli._check_engine_flags(args)
    assert str(exc.value) == message and exc.value.flag == argv[0]


def _self_signed(tmp_path, name: str = "server"):
    """A real certificate and its key (PEM files), made with `cryptography`."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def test_pem_files_must_parse_not_just_look_like_pem(tmp_path):
    """A file with a BEGIN line but garbage inside is refused here, naming its flag, instead of
    reaching gRPC's C core (three C-core lines and a RuntimeError naming nothing)."""
    cert, key = _self_signed(tmp_path)
    _, other_key = _self_signed(tmp_path, "other")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n-----END CERTIFICATE-----\n")

    class Args:
        tls_cert, tls_key, tls_ca = cert, key, cert

    startup_checks.check_pem_files(Args())  # a real pair and a real CA bundle pass
    for dest, value, flag in (("tls_cert", str(garbage), "--tls-cert"), ("tls_key", str(garbage), "--tls-key"),
                              ("tls_key", other_key, "--tls-key"), ("tls_ca", str(garbage), "--tls-ca")):
        bad = type("Bad", (Args,), {dest: value})
        with pytest.raises(StartupError) as exc:
            startup_checks.check_pem_files(bad())
        assert exc.value.flag == flag and str(exc.value).startswith(f"{flag} {value}: is not a valid"), str(exc.value)


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


def test_port_zero_is_resolved_before_anything_dials_it():
    """`serve --engine-port 0` used to make the frontend dial port 0 for up to 900 s: port 0
    flags become real free ports before any process starts (the decode engine's too)."""
    from tandem import cli, options

    args = options.parse_args(cli.build_parser(), ["serve", "--engine-port", "0", "--port", "0", "--disaggregated"],
                              environ={})
    cli._resolve_serve_ports(args)
    assert args.port > 0 and args.engine_port > 0 and args.decode_engine_port > 0
    assert args.decode_engine_port != args.engine_port


def test_tokenizer_flag_takes_every_model_form_and_is_checked(tmp_path):
    startup_checks.check_tokenizer(None)
    for spec in ("smollm2-135m-instruct", "dummy:tiny-qwen3"):
        startup_checks.check_tokenizer(spec)
    (tmp_path / "tokenizer.json").write_text("{}")
    startup_checks.check_tokenizer(str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    for bad, needle in ((str(empty), "no tokenizer files"), ("dummy:nope", "unknown dummy config"),
                        ("/nonexistent/tok", "no such file")):
        with pytest.raises(StartupError) as exc:
            startup_checks.check_tokenizer(bad)
        assert exc.value.flag == "--tokenizer" and needle in str(exc.value)


def test_uncached_hub_id_without_network_fails_at_once_in_one_line(tmp_path):
    """No network and no HF_HUB_OFFLINE: the Hub is probed once (a few seconds), not retried for
    minutes, and the message says how to point at a local directory."""
    import time

    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_ENDPOINT": "http://127.0.0.1:9"}
    env.pop("HF_HUB_OFFLINE", None)
    code = ("from tandem.model_spec import check_model_spec\n"
            "try:\n    check_model_spec('someorg/absent')\nexcept Exception as e:\n    print('ERR', e)\n")
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert time.monotonic() - start < 20
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ERR") and "cannot be reached" in out.stdout and "local model directory" in out.stdout
    assert len(out.stdout.strip().splitlines()) == 1
