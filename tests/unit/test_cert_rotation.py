"""Issue 24, acceptance 3: a TLS server's certificate files are rotated while it runs, and new
connections see the new certificate (`tandem.security.ReloadingCertificates` behind
`SecurityOptions.server_credentials`); a half-done rotation keeps the old one."""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import ssl
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tandem.security import ReloadingCertificates, SecurityOptions, add_port


def self_signed(cn: str) -> tuple[bytes, bytes]:
    """(key PEM, certificate PEM) for localhost / 127.0.0.1."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


def replace(path: Path, data: bytes) -> None:
    """Writes `path` as a rotation does: a new file renamed over the old one."""
    tmp = path.with_suffix(".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def presented_certificate(port: int) -> bytes:
    """The DER certificate the server presents to a new TLS connection (verification off: the
    test reads what is served, whoever signed it)."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname="localhost") as tls:
            return tls.getpeercert(binary_form=True)


def der(cert_pem: bytes) -> bytes:
    return x509.load_pem_x509_certificate(cert_pem).public_bytes(serialization.Encoding.DER)


def health_check(port: int, trusted_cert_pem: bytes) -> health_pb2.HealthCheckResponse.ServingStatus:
    with grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(trusted_cert_pem),
                             options=[("grpc.ssl_target_name_override", "localhost")]) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


@pytest.fixture
def tls_server(tmp_path):
    old_key, old_cert = self_signed("old")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(old_cert)
    key.write_bytes(old_key)
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = add_port(server, "127.0.0.1:0", SecurityOptions(tls_cert=str(cert), tls_key=str(key)))
    assert port
    server.start()
    try:
        yield {"port": port, "cert": cert, "key": key, "old": (old_key, old_cert)}
    finally:
        server.stop(None)


def test_new_connections_see_the_rotated_certificate(tls_server) -> None:
    port, (_, old_cert) = tls_server["port"], tls_server["old"]
    assert presented_certificate(port) == der(old_cert)
    assert health_check(port, old_cert) == health_pb2.HealthCheckResponse.SERVING

    new_key, new_cert = self_signed("new")
    replace(tls_server["key"], new_key)
    replace(tls_server["cert"], new_cert)
    assert presented_certificate(port) == der(new_cert)
    assert health_check(port, new_cert) == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as err:  # a client that trusts only the old one is refused
        health_check(port, old_cert)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_half_done_rotation_keeps_the_current_certificate(tls_server) -> None:
    port, (_, old_cert) = tls_server["port"], tls_server["old"]
    new_key, new_cert = self_signed("new")
    replace(tls_server["key"], new_key)  # the key alone: it does not match the certificate
    assert presented_certificate(port) == der(old_cert)
    assert health_check(port, old_cert) == health_pb2.HealthCheckResponse.SERVING
    replace(tls_server["cert"], new_cert)  # the pair is complete: taken at the next connection
    assert presented_certificate(port) == der(new_cert)


def test_fetch_answers_none_until_the_files_change(tmp_path) -> None:
    key_pem, cert_pem = self_signed("a")
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_bytes(cert_pem)
    key.write_bytes(key_pem)
    files = ReloadingCertificates(str(cert), str(key))
    assert files.initial() is not None
    assert files.fetch() is None
    key2, cert2 = self_signed("b")
    replace(key, key2)
    replace(cert, cert2)
    assert files.fetch() is not None
    assert files.fetch() is None


def test_the_http_face_context_follows_the_rotation_too(tmp_path) -> None:
    """`server_ssl_context` (the HTTP port's TLS): each new connection gets the files' current
    certificate."""
    import threading

    old_key, old_cert = self_signed("old")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(old_cert)
    key.write_bytes(old_key)
    context = SecurityOptions(tls_cert=str(cert), tls_key=str(key)).server_ssl_context()
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            try:
                with context.wrap_socket(conn, server_side=True):
                    pass
            except (ssl.SSLError, OSError):
                pass

    threading.Thread(target=serve, daemon=True).start()
    try:
        assert presented_certificate(port) == der(old_cert)
        new_key, new_cert = self_signed("new")
        replace(key, new_key)
        assert presented_certificate(port) == der(old_cert)  # half done: the old pair still served
        replace(cert, new_cert)
        assert presented_certificate(port) == der(new_cert)
        assert presented_certificate(port) == der(new_cert)
    finally:
        listener.close()
