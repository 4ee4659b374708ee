"""Checks a server command makes before it starts anything, each failing with one clear line.

A wrong flag should cost the user one line naming the flag and its value, not a model load,
two tracebacks and an exit code of 0. Each check raises `StartupError(flag, value, reason)`;
`tandem.cli` prints it as one line (or one JSON record) and exits non-zero.
"""

from __future__ import annotations

import errno
import os
import socket
import time
from pathlib import Path


class StartupError(Exception):
    """A flag value the command cannot start with: which flag, its value, and why."""

    def __init__(self, flag: str, value: object, reason: str) -> None:
        super().__init__(reason if value is None else f"{flag} {value}: {reason}")
        self.flag, self.value, self.reason = flag, value, reason


def check_model(spec: str) -> None:
    from tandem.model_spec import ModelSpecError, check_model_spec

    try:
        check_model_spec(spec)
    except ModelSpecError as exc:
        raise StartupError("--model", spec, str(exc)) from None


def check_tokenizer(spec: str | None) -> None:
    """`--tokenizer`: a directory with tokenizer files, or any `--model` form."""
    if spec is None:
        return
    from tandem.model_spec import ModelSpecError, check_tokenizer_spec

    try:
        check_tokenizer_spec(spec)
    except ModelSpecError as exc:
        raise StartupError("--tokenizer", spec, str(exc)) from None


def check_generation_config(setting: str) -> None:
    if setting in ("auto", "none"):
        return
    from tandem.generation_defaults import GenerationConfigError, read_generation_config

    try:
        read_generation_config(setting)
    except GenerationConfigError as exc:
        raise StartupError("--generation-config", setting, str(exc).removeprefix(f"{setting}: ")) from None


def check_port_free(flag: str, host: str, port: int | None) -> None:
    """Binds and releases `host:port` without SO_REUSEPORT: gRPC binds with SO_REUSEPORT, so a
    second server on a busy port would otherwise start silently and share the port."""
    if port is None or port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise StartupError(flag, port, f"{host}:{port} is already in use (another server is "
                                               f"listening there; pick another {flag})") from None
            if exc.errno == errno.EACCES:
                raise StartupError(flag, port, f"no permission to listen on {host}:{port}") from None
            raise StartupError(flag, port, f"cannot listen on {host}:{port} ({exc.strerror})") from None


def free_port(host: str) -> int:
    """A port of `host` that nothing listens on now (for a flag given as port 0, resolved
    before any process dials it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host.strip("[]"), 0))
        return s.getsockname()[1]


# (certificate flag, its key flag) pairs and CA-bundle flags of one hop (`tandem.security`).
_CERT_KEY_FLAGS = (("tls_cert", "tls_key"), ("tls_client_cert", "tls_client_key"))
_CA_FLAGS = ("tls_client_ca", "tls_ca")


def check_pem_files(args, prefix: str = "") -> None:
    """Every TLS file flag of one hop names a readable PEM file that parses: certificates and
    CA bundles as X.509 certificates, a key as the private key of its certificate (parsed by
    the standard library's OpenSSL, so gRPC never meets a file it cannot load)."""

    def given(name: str) -> tuple[str, str] | None:
        path = getattr(args, (prefix + name).replace("-", "_"), None)
        return None if path is None else ("--" + (prefix + name).replace("_", "-"), str(Path(path).expanduser()))

    for cert_name, key_name in _CERT_KEY_FLAGS:
        cert, key = given(cert_name), given(key_name)
        for entry in (cert, key):
            if entry is not None:
                _read_pem(*entry)
        if cert is not None:
            _load_pem(cert[0], cert[1], lambda ctx: ctx.load_verify_locations(cafile=cert[1]), "certificate")
        if cert is not None and key is not None:
            _load_pem(key[0], key[1], lambda ctx: ctx.load_cert_chain(cert[1], key[1], password=_no_password),
                      f"private key of {cert[0]}")
    for name in _CA_FLAGS:
        ca = given(name)
        if ca is not None:
            _read_pem(*ca)
            _load_pem(ca[0], ca[1], lambda ctx: ctx.load_verify_locations(cafile=ca[1]), "CA certificate bundle")


def _read_pem(flag: str, path: str) -> None:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise StartupError(flag, path, f"cannot read it ({exc.strerror})") from None
    if b"-----BEGIN " not in data:
        raise StartupError(flag, path, "is not a PEM file (no -----BEGIN line)")


def _no_password() -> bytes:
    raise ValueError("the key is encrypted")


def _load_pem(flag: str, path: str, load, what: str) -> None:
    import ssl

    try:
        load(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT))
    except (ssl.SSLError, ValueError) as exc:
        detail = getattr(exc, "reason", None) or str(exc).splitlines()[0]
        raise StartupError(flag, path, f"is not a valid {what} ({str(detail).lower().replace('_', ' ')})") from None


def _connect_any(host: str, port: int, named: bool) -> None:
    """Connects to `host:port` (for a `dns:///` name, to the first of the addresses the frontend
    would resolve it to that accepts); raises OSError when none does."""
    if named:
        from tandem.frontend.engine_discovery import HOSTS_FILE_ENV, hosts_file_addresses

        pinned = hosts_file_addresses(os.environ[HOSTS_FILE_ENV], host) if os.environ.get(HOSTS_FILE_ENV) else None
        for ip in pinned or []:
            try:
                with socket.create_connection((ip, port), timeout=2.0):
                    return
            except OSError as exc:
                error = exc
        if pinned:
            raise error
    with socket.create_connection((host, port), timeout=2.0):
        return


def check_engines_reachable(addresses: list[str], timeout: float) -> None:
    """Each engine address resolves and accepts TCP connections within `timeout` seconds (an
    engine that is still loading already listens, so this does not wait for the model). A
    timeout of 0 skips the check: orchestrated deployments start frontends before their engines
    and let the frontend wait for them while it answers health."""
    if timeout <= 0:
        return
    for address in addresses:
        # A `dns:///NAME:PORT` name passes when one of its addresses accepts (the frontend
        # dials each of them; engines behind it may come and go).
        host, sep, port_text = address.removeprefix("dns:///").rpartition(":")
        if not sep or not port_text.isdigit():
            raise StartupError("--engine", address, "expected HOST:PORT")
        host = host.strip("[]")
        deadline = time.monotonic() + timeout
        while True:
            try:
                _connect_any(host, int(port_text), address.startswith("dns:///"))
                break
            except OSError as exc:  # a name that does not resolve yet may resolve soon: retried too
                if time.monotonic() >= deadline:
                    if isinstance(exc, socket.gaierror):
                        raise StartupError("--engine", address, f"cannot resolve {host} ({exc.strerror})") from None
                    reason = exc.strerror or type(exc).__name__
                    raise StartupError("--engine", address, f"no engine answers there ({reason}) after "
                                                            f"{timeout:g}s; start one with `tandem engine "
                                                            f"--port {port_text}`") from None
                time.sleep(0.5)
