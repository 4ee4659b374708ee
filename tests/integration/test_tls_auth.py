"""TLS, mutual TLS and bearer tokens on both hops of `tandem serve`.

One server is started with two separate PKIs: a public CA for clients → frontend and an internal
CA for frontend → engine, each hop with its own token. Every refusal below must happen at the
layer that owns it: the TLS handshake (no or foreign client certificate, plaintext) or the token
interceptor (missing or wrong token), and a refused call must never reach the engine.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import secrets
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.client import TandemClient
from tandem.v1 import engine_pb2, engine_pb2_grpc

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
CALL_TIMEOUT = 60.0


# -- a throwaway PKI ---------------------------------------------------------------------------------
def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, key, cert: x509.Certificate) -> tuple[Path, Path]:
    key_path, cert_path = path.with_suffix(".key"), path.with_suffix(".crt")
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


class CertificateAuthority:
    """A self-signed CA that issues server and client certificates into a directory."""

    def __init__(self, directory: Path, name: str) -> None:
        self.directory = directory
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (
            x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
            .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.path = directory / f"{name}.pem"
        self.path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, cn: str, server: bool) -> tuple[Path, Path]:
        """Returns (certificate, key) paths; server certificates name 127.0.0.1 and localhost."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(self.cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        return _write(self.directory / cn, key, builder.sign(self.key, hashes.SHA256()))


def _creds(ca: Path, cert_key: tuple[Path, Path] | None = None) -> grpc.ChannelCredentials:
    cert, key = cert_key if cert_key else (None, None)
    return grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes(),
        private_key=key.read_bytes() if key else None,
        certificate_chain=cert.read_bytes() if cert else None,
    )


# -- one secured `tandem serve` ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def secured(tmp_path_factory, launch_serve, get_free_port):
    free_port = get_free_port
    d = tmp_path_factory.mktemp("pki")
    public, internal, rogue = (CertificateAuthority(d, n) for n in ("public-ca", "internal-ca", "rogue-ca"))
    frontend_token, engine_token = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    token_file = d / "frontend.token"
    token_file.write_text(frontend_token + "\n")
    pki = {
        "public_ca": public.path, "internal_ca": internal.path,
        "client": public.issue("client", server=False),
        "frontend_to_engine": internal.issue("frontend-to-engine", server=False),
        "rogue_client": rogue.issue("rogue-client", server=False),
    }
    fe_cert, fe_key = public.issue("frontend", server=True)
    en_cert, en_key = internal.issue("engine", server=True)
    fe_client_cert, fe_client_key = pki["frontend_to_engine"]
    extra = [
        # clients → frontend: TLS + mTLS (public CA) + token from a file
        "--tls-cert", str(fe_cert), "--tls-key", str(fe_key), "--tls-client-ca", str(public.path),
        "--auth-token-file", str(token_file),
        # frontend → engine: TLS + mTLS (internal CA) on both ends; token from the environment
        "--engine-tls-cert", str(en_cert), "--engine-tls-key", str(en_key),
        "--engine-tls-client-ca", str(internal.path),
        "--engine-tls-ca", str(internal.path),
        "--engine-tls-client-cert", str(fe_client_cert), "--engine-tls-client-key", str(fe_client_key),
    ]
    http_port = free_port()
    extra += ["--http-port", str(http_port)]  # the OpenAI HTTP face: the same TLS, mTLS and token
    server, frontend, engine = launch_serve(
        extra, env={"TANDEM_ENGINE_AUTH_TOKEN": engine_token},
        credentials=_creds(public.path, pki["client"]),
    )
    yield {"frontend": frontend, "engine": engine, "server": server, "pki": pki, "http_port": http_port,
           "frontend_token": frontend_token, "engine_token": engine_token, "token_file": token_file}


def _client(s, token: str | None = None, client_cert: str | None = "client", ca: str = "public_ca") -> TandemClient:
    pki = s["pki"]
    creds = _creds(pki[ca], pki[client_cert] if client_cert else None)
    return TandemClient(s["frontend"], credentials=creds, token=token)


def _engine_counters(s) -> tuple[int, int]:
    """(finished requests, prompt tokens) summed over the engines, read through an authorized client."""
    with _client(s, token=s["frontend_token"]) as c:
        engines = c.utility("stats")["engines"]
    assert engines and all("error" not in e for e in engines.values()), engines
    return (sum(int(e["finished_requests_total"]) for e in engines.values()),
            sum(int(e["prompt_tokens_total"]) for e in engines.values()))


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


# -- the frontend ------------------------------------------------------------------------------------
def test_authorized_client_gets_an_answer(secured):
    with _client(secured, token=secured["frontend_token"]) as c:
        reply = c.chat(FRANCE, max_tokens=16, temperature=0.0, timeout=CALL_TIMEOUT)
    assert "Paris" in reply.choices[0].text


def test_token_is_checked_after_the_handshake(secured):
    """Valid mTLS but no or a wrong token: the interceptor's two codes, and the engine sees nothing."""
    before = _engine_counters(secured)
    with _client(secured, token=None) as c:
        assert _code(lambda: c.chat(FRANCE, max_tokens=4, timeout=CALL_TIMEOUT)) == grpc.StatusCode.UNAUTHENTICATED
        stream = c.stream("Hello", max_tokens=4, timeout=CALL_TIMEOUT)  # server-streaming is guarded too
        assert _code(lambda: list(stream)) == grpc.StatusCode.UNAUTHENTICATED
    with _client(secured, token=secured["frontend_token"] + "x") as c:
        assert _code(lambda: c.chat(FRANCE, max_tokens=4, timeout=CALL_TIMEOUT)) == grpc.StatusCode.PERMISSION_DENIED
        assert _code(lambda: c.utility("stats")) == grpc.StatusCode.PERMISSION_DENIED
    # The engine token opens the engine, not the frontend.
    with _client(secured, token=secured["engine_token"]) as c:
        assert _code(lambda: c.chat(FRANCE, max_tokens=4, timeout=CALL_TIMEOUT)) == grpc.StatusCode.PERMISSION_DENIED
    assert _engine_counters(secured) == before


def test_handshake_refuses_foreign_missing_or_no_tls(secured):
    before = _engine_counters(secured)
    token = secured["frontend_token"]
    attempts = {
        "client cert from another CA": _client(secured, token=token, client_cert="rogue_client"),
        "no client cert": _client(secured, token=token, client_cert=None),
        "plaintext": TandemClient(secured["frontend"], token=token),
    }
    for what, client in attempts.items():
        with client:
            code = _code(lambda: client.chat(FRANCE, max_tokens=4, timeout=CALL_TIMEOUT))
        assert code == grpc.StatusCode.UNAVAILABLE, what
    assert _engine_counters(secured) == before


def test_health_needs_tls_but_no_token(secured):
    """Kubernetes probes carry no token: health is exempt, yet still behind TLS/mTLS."""
    pki = secured["pki"]
    with grpc.secure_channel(secured["frontend"], _creds(pki["public_ca"], pki["client"])) as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="tandem.v1.Frontend"),
                                                 timeout=CALL_TIMEOUT)
        assert r.status == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(secured["frontend"]) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        assert _code(lambda: stub.Check(health_pb2.HealthCheckRequest(), timeout=CALL_TIMEOUT)) == \
            grpc.StatusCode.UNAVAILABLE


def test_cli_chat_with_tls_flags(secured):
    pki = secured["pki"]
    cert, key = pki["client"]
    out = subprocess.run(
        [sys.executable, "-P", "-m", "tandem.cli", "chat", "What is the capital of France?", "--address",
         secured["frontend"], "--max-tokens", "16", "--temperature", "0", "--tls-ca", str(pki["public_ca"]),
         "--tls-client-cert", str(cert), "--tls-client-key", str(key),
         # The = form: a token_urlsafe token begins with "-" one time in 64, which argparse would
         # take for an option.
         f"--token={secured['frontend_token']}"],
        capture_output=True, text=True, timeout=120, cwd="/",
        env={k: v for k, v in os.environ.items() if not k.startswith("TANDEM_") or k == "TANDEM_CACHE_DIR"},
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


# -- the engine, reached directly (a compromised pod on the network) ---------------------------------
def _engine_model_info(s, creds: grpc.ChannelCredentials, token: str | None) -> engine_pb2.EngineModelInfo:
    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.secure_channel(s["engine"], creds) as ch:
        return engine_pb2_grpc.EngineStub(ch).GetModelInfo(
            engine_pb2.EngineModelInfoRequest(), timeout=CALL_TIMEOUT, metadata=metadata)


def test_engine_port_refuses_callers_without_its_cert_and_token(secured):
    pki = secured["pki"]
    internal = pki["internal_ca"]
    before = _engine_counters(secured)
    # The frontend's public client certificate (and token) do not open the engine.
    assert _code(lambda: _engine_model_info(secured, _creds(internal, pki["client"]), secured["frontend_token"])) == \
        grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(secured["engine"]) as ch:
        stub = engine_pb2_grpc.EngineStub(ch)
        request = engine_pb2.EngineRequest(request_id="intruder", prompt_token_ids=[1, 2, 3])
        assert _code(lambda: list(stub.Stream(request, timeout=CALL_TIMEOUT))) == grpc.StatusCode.UNAVAILABLE
    # The engine's own client certificate without the engine token: the interceptor still refuses.
    engine_creds = _creds(internal, pki["frontend_to_engine"])
    assert _code(lambda: _engine_model_info(secured, engine_creds, None)) == grpc.StatusCode.UNAUTHENTICATED
    assert _code(lambda: _engine_model_info(secured, engine_creds, secured["frontend_token"])) == \
        grpc.StatusCode.PERMISSION_DENIED
    assert _engine_counters(secured) == before
    # Both together work, and the engine's health answers without a token (its probes carry none).
    assert _engine_model_info(secured, engine_creds, secured["engine_token"]).vocab_size >= 49152
    with grpc.secure_channel(secured["engine"], engine_creds) as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="tandem.v1.Engine"),
                                                 timeout=CALL_TIMEOUT)
        assert r.status == health_pb2.HealthCheckResponse.SERVING


def test_engine_token_never_on_a_command_line(secured):
    """`tandem serve` hands the engine token to its child through the environment, not argv."""
    needle = secured["engine_token"].encode()
    engine_port = secured["engine"].rsplit(":", 1)[1].encode()
    engine_children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # a process that ended while we looked
            continue
        assert needle not in cmdline, f"engine token visible in the argv of pid {entry.name}"
        args = cmdline.split(b"\0")
        if b"engine" in args and engine_port in args:
            engine_children.append(entry)
    assert len(engine_children) == 1  # the scan saw the engine child ...
    assert needle in (engine_children[0] / "environ").read_bytes()  # ... which got its token by env


def _https(s, path: str, token: str | None, client_cert: str | None = "client"):
    """GET https://127.0.0.1:<http_port><path>: (status, JSON body)."""
    pki = s["pki"]
    context = ssl.create_default_context(cafile=str(pki["public_ca"]))
    if client_cert is not None:
        cert, key = pki[client_cert]
        context.load_cert_chain(str(cert), str(key))
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(f"https://127.0.0.1:{s['http_port']}{path}", headers=headers)
    try:
        with urllib.request.urlopen(req, context=context, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_http_port_has_the_same_tls_mtls_and_token(secured):
    status, body = _https(secured, "/v1/models", secured["frontend_token"])
    assert status == 200 and body["data"][0]["id"]
    assert _https(secured, "/v1/models", None)[0] == 401
    assert _https(secured, "/v1/models", "not-the-token")[0] == 403
    assert _https(secured, "/health", None) == (200, {"status": "SERVING"})  # probes: TLS, no token
    with pytest.raises(OSError):  # mTLS: no client certificate, no connection
        _https(secured, "/health", None, client_cert=None)
    with pytest.raises(OSError):  # no plaintext on the TLS port
        urllib.request.urlopen(f"http://127.0.0.1:{secured['http_port']}/health", timeout=10)
