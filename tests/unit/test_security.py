"""tandem.security without a server: flag parsing, token sources, validation, secrecy."""

from __future__ import annotations

import argparse

import pytest

from tandem.security import (
    BearerTokenInterceptor,
    SecurityConfigError,
    SecurityOptions,
    _bearer,
    add_security_args,
    engine_child_security,
)


def parse(argv: list[str], prefix: str = "", server: bool = True, client: bool = False) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_security_args(p, prefix, server=server, client=client)
    return p.parse_args(argv)


@pytest.fixture
def pem(tmp_path):
    """Placeholder PEM paths: option validation only checks that the files exist."""
    paths = {}
    for name in ("cert", "key", "ca"):
        paths[name] = tmp_path / f"{name}.pem"
        paths[name].write_text("-----BEGIN PLACEHOLDER-----\n")
    return {k: str(v) for k, v in paths.items()}


def test_token_precedence_flag_then_file_then_env(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_ENGINE_AUTH_TOKEN", "from-env")
    f = tmp_path / "tok"
    f.write_text("new-token\nold-token\n")
    assert SecurityOptions.from_args(parse([], "engine-"), "engine-").tokens == ("from-env",)
    by_file = SecurityOptions.from_args(parse(["--engine-auth-token-file", str(f)], "engine-"), "engine-")
    assert by_file.tokens == ("new-token", "old-token")
    assert by_file.call_metadata() == [("authorization", "Bearer new-token")]  # a client sends the first
    by_flag = SecurityOptions.from_args(parse(["--engine-token", "from-flag"], "engine-"), "engine-")
    assert by_flag.tokens == ("from-flag",)
    with pytest.raises(SecurityConfigError, match="exclusive"):
        SecurityOptions.from_args(parse(["--engine-auth-token", "a", "--engine-auth-token-file", str(f)], "engine-"),
                                  "engine-")


def test_unset_or_empty_env_means_no_auth(monkeypatch):
    monkeypatch.setenv("TANDEM_AUTH_TOKEN", "   ")
    opts = SecurityOptions.from_args(parse([]))
    assert not opts.auth and opts.server_interceptors() == [] and opts.aio_client_interceptors() == []


def test_bad_token_files_and_characters_are_refused(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(SecurityConfigError, match="holds no token"):
        SecurityOptions.from_args(parse(["--auth-token-file", str(empty)]))
    with pytest.raises(SecurityConfigError, match="cannot read"):
        SecurityOptions.from_args(parse(["--auth-token-file", str(tmp_path / "missing")]))
    with pytest.raises(SecurityConfigError, match="not allowed") as info:
        SecurityOptions.from_args(parse(["--auth-token", '"secret-value"']))
    assert "secret-value" not in str(info.value)  # errors never echo a token


def test_tls_flag_combinations(pem, tmp_path):
    with pytest.raises(SecurityConfigError, match="together"):
        SecurityOptions(tls_cert=pem["cert"])
    with pytest.raises(SecurityConfigError, match="needs tls-cert"):
        SecurityOptions(tls_client_ca=pem["ca"])
    with pytest.raises(SecurityConfigError, match="together"):
        SecurityOptions(tls_client_cert=pem["cert"])
    with pytest.raises(SecurityConfigError, match="no such file"):
        SecurityOptions(tls_ca=str(tmp_path / "nope.pem"))
    mtls = SecurityOptions(tls_cert=pem["cert"], tls_key=pem["key"], tls_client_ca=pem["ca"])
    assert mtls.server_tls and mtls.mtls and not mtls.client_tls


def test_serve_engine_hop_implies_client_tls(pem):
    argv = ["--engine-tls-cert", pem["cert"], "--engine-tls-key", pem["key"]]
    args = parse(argv, "engine-", server=True, client=True)
    assert SecurityOptions.from_args(args, "engine-").client_tls
    # A frontend alone (client side only) dials plaintext unless told otherwise.
    assert not SecurityOptions.from_args(parse([], "engine-", server=False, client=True), "engine-").client_tls


def test_tokens_stay_out_of_repr_summary_and_child_argv(pem):
    opts = SecurityOptions(tls_cert=pem["cert"], tls_key=pem["key"], tokens=("s3cret-token",))
    assert "s3cret" not in repr(opts)
    assert "s3cret" not in str(opts.summary("server")) + str(opts.summary("client"))
    argv, env = engine_child_security(opts)
    assert argv == ["--tls-cert", pem["cert"], "--tls-key", pem["key"]]
    assert env == {"TANDEM_AUTH_TOKEN": "s3cret-token"}
    # Without an engine token the child's variable is blanked, so a frontend token cannot leak in.
    assert engine_child_security(SecurityOptions())[1] == {"TANDEM_AUTH_TOKEN": ""}


def test_bearer_parsing_and_comparison():
    assert _bearer([("x-other", "1"), ("authorization", "Bearer abc")]) == "abc"
    assert _bearer([("authorization", "bearer  abc ")]) == "abc"  # the scheme is case-insensitive
    assert _bearer([("authorization", "Basic abc")]) is None
    assert _bearer([("authorization", "Bearer ")]) is None
    assert _bearer(None) is None
    check = BearerTokenInterceptor(("new", "old"))
    assert check._valid("new") and check._valid("old")
    assert not check._valid("ne") and not check._valid("newer") and not check._valid("\u00e9")
