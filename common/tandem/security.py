"""Transport security and bearer-token authentication for both gRPC services.

One `SecurityOptions` describes one hop: the server side (certificate, key, and a client CA
that turns TLS into mutual TLS), the client side (CA to verify the server, client
certificate and key for mTLS) and the bearer token(s). The CLI builds it from flags with
`add_security_args` / `SecurityOptions.from_args`; the apps turn it into gRPC credentials and
interceptors.

Tokens come from a flag, a file or an environment variable. A file or variable may hold several
tokens separated by whitespace (each is accepted by a server; a client sends the first), which
lets operators rotate a token without an outage. Tokens never appear in logs, reprs or `--help`.

A server's certificate, key and client CA are re-read when their files change (`ReloadingCertificates`):
a rotated Kubernetes Secret reaches new connections without a restart; connections already open
keep the certificate they were made with.

The grpc.health.v1 service is deliberately exempt from the token check: Kubernetes gRPC probes
cannot send metadata, and health status reveals nothing worth protecting. TLS and mTLS still
apply to it, because they are enforced by the transport before any RPC is dispatched.

State-changing operations (Utility FLUSH_PREFIX_CACHE, START_PROFILE, STOP_PROFILE) need more
than a client token: an admin token (`--admin-token-file` or `$TANDEM_ADMIN_AUTH_TOKEN`, accepted
wherever a client token is) or the explicit `--allow-admin-commands`. `AccessPolicy` answers
"who is calling" and "may they administer" for a servicer.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import structlog

log = structlog.get_logger(__name__)

# Health RPCs answer without a token (Kubernetes probes cannot send one); see the module doc.
AUTH_EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)

# RFC 6750 b64token: a token with any other character would not survive metadata or a header.
_TOKEN_RE = re.compile(r"^[A-Za-z0-9\-._~+/]+=*$")


class SecurityConfigError(ValueError):
    """A security flag combination or file that cannot work (raised once, at start)."""


def _env_name(prefix: str) -> str:
    return "TANDEM_" + prefix.replace("-", "_").upper() + "AUTH_TOKEN"


def _dest(prefix: str, name: str) -> str:
    return (prefix + name).replace("-", "_")


def add_security_args(parser: argparse.ArgumentParser, prefix: str = "", server: bool = True,
                      client: bool = False, admin: bool = False) -> None:
    """Adds the TLS/mTLS and token flags of one hop, named `--{prefix}tls-...` and
    `--{prefix}auth-token...`.

    `server` adds what a listening service needs (its certificate, key and client CA);
    `client` adds what a caller needs (the CA to trust, its own certificate for mTLS). The token
    flags are shared: a server accepts the token, a client sends it. `admin` adds the admin
    credential and `--allow-admin-commands` (the client-facing service only).
    """
    p = "--" + prefix
    what = f"{prefix.rstrip('-')} " if prefix else ""
    g = parser.add_argument_group(f"{what}security (TLS, mTLS, bearer token)".strip())
    if server:
        g.add_argument(p + "tls-cert", dest=_dest(prefix, "tls_cert"), default=None,
                       help=f"{what}server certificate chain (PEM); enables TLS")
        g.add_argument(p + "tls-key", dest=_dest(prefix, "tls_key"), default=None,
                       help=f"{what}server private key (PEM)")
        g.add_argument(p + "tls-client-ca", dest=_dest(prefix, "tls_client_ca"), default=None,
                       help=f"CA bundle (PEM) that signs {what}client certificates; requires and verifies them (mTLS)")
    if client:
        g.add_argument(p + "tls", dest=_dest(prefix, "tls"), action="store_true",
                       help=f"connect to the {what}server over TLS with the system's root CAs")
        g.add_argument(p + "tls-ca", dest=_dest(prefix, "tls_ca"), default=None,
                       help=f"CA bundle (PEM) that signs the {what}server certificate; implies TLS")
        g.add_argument(p + "tls-client-cert", dest=_dest(prefix, "tls_client_cert"), default=None,
                       help=f"client certificate chain (PEM) presented to the {what}server (mTLS)")
        g.add_argument(p + "tls-client-key", dest=_dest(prefix, "tls_client_key"), default=None,
                       help="client private key (PEM)")
        g.add_argument(p + "tls-server-name", dest=_dest(prefix, "tls_server_name"), default=None,
                       help="name to verify in the server certificate instead of the dialled host")
    # No argparse default from the environment: `--help` would print the secret.
    g.add_argument(p + "auth-token", p + "token", dest=_dest(prefix, "auth_token"), default=None,
                   help=f"{what}bearer token (prefer {p}auth-token-file or ${_env_name(prefix)}: "
                        "a flag is visible in the process list)")
    g.add_argument(p + "auth-token-file", dest=_dest(prefix, "auth_token_file"), default=None,
                   help=f"file holding the {what}bearer token(s), whitespace-separated "
                        "(a server accepts each, a client sends the first)")
    if admin:
        g.add_argument(p + "admin-token-file", dest=_dest(prefix, "admin_token_file"), default=None,
                       help="file holding admin bearer token(s): they may also flush the prefix cache, "
                            f"profile, abort any request and read detailed health (or ${_env_name(prefix + 'admin-')})")
        g.add_argument(p + "allow-admin-commands", dest=_dest(prefix, "allow_admin_commands"), action="store_true",
                       help="let every caller flush the prefix cache and profile (off by default: those "
                            "need an admin token)")


def parse_tokens(text: str, source: str) -> tuple[str, ...]:
    """Splits `text` into tokens and checks each is a valid bearer token (never echoing it)."""
    tokens = tuple(text.split())
    for i, token in enumerate(tokens):
        if not _TOKEN_RE.match(token):
            raise SecurityConfigError(f"{source}: token #{i + 1} has characters not allowed in a bearer token")
    return tokens


def _tokens_from_file(path: str, flag: str) -> tuple[str, ...]:
    """The whitespace-separated tokens of a token file; a file that holds none is an error."""
    tokens = parse_tokens(_read(path, flag).decode("ascii", "replace"), flag)
    if not tokens:
        raise SecurityConfigError(f"{flag}: {path} holds no token")
    return tokens


def _read(path: str | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise SecurityConfigError(f"{what}: cannot read {path}: {exc.strerror}") from None


@dataclass(frozen=True)
class SecurityOptions:
    """The security settings of one gRPC hop: server side, client side and bearer tokens."""

    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    tls: bool = False
    tls_ca: str | None = None
    tls_client_cert: str | None = None
    tls_client_key: str | None = None
    tls_server_name: str | None = None
    tokens: tuple[str, ...] = field(default=(), repr=False)
    admin_tokens: tuple[str, ...] = field(default=(), repr=False)
    allow_admin_commands: bool = False

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise SecurityConfigError("tls-cert and tls-key must be given together")
        if self.tls_client_ca and not self.tls_cert:
            raise SecurityConfigError("tls-client-ca (mTLS) needs tls-cert and tls-key")
        if bool(self.tls_client_cert) != bool(self.tls_client_key):
            raise SecurityConfigError("tls-client-cert and tls-client-key must be given together")
        for name in ("tls_cert", "tls_key", "tls_client_ca", "tls_ca", "tls_client_cert", "tls_client_key"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise SecurityConfigError(f"{name.replace('_', '-')}: no such file: {path}")

    @classmethod
    def from_args(cls, args: argparse.Namespace, prefix: str = "") -> "SecurityOptions":
        """Builds the options from flags added by `add_security_args` with the same prefix.

        Token precedence: the flag, then the file, then `$TANDEM_{PREFIX}AUTH_TOKEN`. When the
        parser had both sides (as `tandem serve` has for the engine hop), a server certificate
        implies that the client side dials TLS.
        """
        def get(name):
            return getattr(args, _dest(prefix, name), None)

        flag, path = get("auth_token"), get("auth_token_file")
        if flag and path:
            raise SecurityConfigError(f"--{prefix}auth-token and --{prefix}auth-token-file are exclusive")
        if flag:
            tokens = parse_tokens(flag, f"--{prefix}auth-token")
        elif path:
            tokens = _tokens_from_file(path, f"--{prefix}auth-token-file")
        else:
            tokens = parse_tokens(os.environ.get(_env_name(prefix), ""), f"${_env_name(prefix)}")
        both_sides = hasattr(args, _dest(prefix, "tls_cert")) and hasattr(args, _dest(prefix, "tls"))
        admin_tokens: tuple[str, ...] = ()
        if hasattr(args, _dest(prefix, "admin_token_file")):
            admin_path = get("admin_token_file")
            admin_env = _env_name(prefix + "admin-")
            if admin_path:
                admin_tokens = _tokens_from_file(admin_path, f"--{prefix}admin-token-file")
            else:
                admin_tokens = parse_tokens(os.environ.get(admin_env, ""), f"${admin_env}")
        return cls(
            tls_cert=get("tls_cert"), tls_key=get("tls_key"), tls_client_ca=get("tls_client_ca"),
            tls=bool(get("tls")) or (both_sides and bool(get("tls_cert"))),
            tls_ca=get("tls_ca"), tls_client_cert=get("tls_client_cert"), tls_client_key=get("tls_client_key"),
            tls_server_name=get("tls_server_name"), tokens=tokens,
            admin_tokens=admin_tokens, allow_admin_commands=bool(get("allow_admin_commands")),
        )

    # -- what the options turn on --------------------------------------------------------------
    @property
    def server_tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def mtls(self) -> bool:
        return self.tls_client_ca is not None

    @property
    def client_tls(self) -> bool:
        return self.tls or self.tls_ca is not None or self.tls_client_cert is not None

    @property
    def auth(self) -> bool:
        return bool(self.tokens)

    def summary(self, side: str) -> dict:
        """Loggable description (no secrets) of the `server` or `client` side."""
        if side == "server":
            return {"tls": self.server_tls, "mtls": self.mtls, "token_auth": self.auth,
                    "admin_token": bool(self.admin_tokens), "admin_commands_open": self.allow_admin_commands}
        return {"tls": self.client_tls, "client_cert": self.tls_client_cert is not None, "token": self.auth}

    # -- server side ---------------------------------------------------------------------------
    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials (mTLS when a client CA is set) that follow the files as they are
        rotated (`ReloadingCertificates`), or None for a plaintext port."""
        if not self.server_tls:
            return None
        certificates = ReloadingCertificates(self.tls_cert, self.tls_key, self.tls_client_ca)
        return grpc.dynamic_ssl_server_credentials(certificates.initial(), certificates.fetch,
                                                   require_client_authentication=self.mtls)

    def server_ssl_context(self):
        """The same server TLS (and mTLS) as `server_credentials`, for the HTTP face, following
        the files as they are rotated too; None for plaintext.

        Each new connection is handed the context of the files as they are now: the listening
        context's `sni_callback` (called for every handshake, with or without SNI) swaps it in."""
        if not self.server_tls:
            return None
        certificates = ReloadingCertificates(self.tls_cert, self.tls_key, self.tls_client_ca, build=ssl_server_context)
        current = [certificates.initial()]

        def use_current(ssl_object, _server_name, _context) -> None:
            fresh = certificates.fetch()
            if fresh is not None:
                current[0] = fresh
            if ssl_object.context is not current[0]:
                ssl_object.context = current[0]

        listening = current[0]
        listening.sni_callback = use_current
        return listening

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        # An admin token is also a client token (an admin may do whatever a client may).
        return [BearerTokenInterceptor(self.tokens + self.admin_tokens)] if self.auth else []

    def access_policy(self) -> "AccessPolicy":
        return AccessPolicy(auth=self.auth, admin_tokens=self.admin_tokens,
                            allow_admin_commands=self.allow_admin_commands)

    # -- client side ---------------------------------------------------------------------------
    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS channel credentials (with a client certificate for mTLS), or None for plaintext."""
        if not self.client_tls:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.tls_ca, "tls-ca"),
            private_key=_read(self.tls_client_key, "tls-client-key"),
            certificate_chain=_read(self.tls_client_cert, "tls-client-cert"),
        )

    def channel_options(self) -> list[tuple[str, str]]:
        if self.tls_server_name:
            return [("grpc.ssl_target_name_override", self.tls_server_name)]
        return []

    def call_metadata(self) -> list[tuple[str, str]]:
        """The metadata a client attaches to every call (the first token)."""
        return [("authorization", f"Bearer {self.tokens[0]}")] if self.auth else []

    def aio_client_interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        """Interceptors for an asyncio channel that attach the token to every call.

        An interceptor rather than call credentials: gRPC refuses call credentials on plaintext
        channels, and a token over plaintext is legitimate behind a mesh that terminates mTLS."""
        return metadata_interceptors(self.call_metadata()) if self.auth else []

    def warn_if_weak(self, side: str, host: str | None = None) -> None:
        """Logs a warning for a token that would travel in clear text off this machine."""
        tls = self.server_tls if side == "server" else self.client_tls
        loopback = host is not None and (host.startswith("127.") or host in ("localhost", "::1", "[::1]"))
        if self.auth and not tls and not loopback:
            log.warning("auth_token_without_tls", side=side,
                        hint="the token crosses the network in clear text unless a mesh encrypts it")


def grpc_certificate_configuration(files: "ReloadingCertificates") -> grpc.ServerCertificateConfiguration:
    """gRPC's server certificate configuration of the files as they are now; raises when the key
    does not match the certificate (or a file cannot be read)."""
    ssl_server_context(files)  # the pair matches
    return grpc.ssl_server_certificate_configuration(
        [(_read(files.key, "tls-key"), _read(files.cert, "tls-cert"))],
        root_certificates=_read(files.client_ca, "tls-client-ca"))


def ssl_server_context(files: "ReloadingCertificates"):
    """An `ssl.SSLContext` serving the files as they are now (client certificates required when
    there is a client CA); raises on an unusable set."""
    import ssl

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(files.cert, files.key)
    if files.client_ca is not None:
        context.load_verify_locations(cafile=files.client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class ReloadingCertificates:
    """A server's certificate, key and client CA files, read again when one of them changes.

    `build(self)` turns the files into what a server uses (`grpc_certificate_configuration`, the
    default, or `ssl_server_context`). `fetch` is called at each new TLS handshake (it is gRPC's
    certificate-configuration fetcher): it returns None while the files are unchanged (their
    mtime, size and inode, symlinks followed, so the atomic `..data` swap of a mounted Kubernetes
    Secret counts) and a newly built one once they changed. A half-written rotation (unreadable
    files, or a key that does not match the certificate) keeps the current one until the files
    change again.
    """

    def __init__(self, cert: str, key: str, client_ca: str | None = None, build=grpc_certificate_configuration) -> None:
        self.paths = tuple(p for p in (cert, key, client_ca) if p is not None)
        self.cert, self.key, self.client_ca = cert, key, client_ca
        self._build = build
        self._stamp: tuple | None = None  # the files' state when the configuration in use was read
        self._refused: tuple | None = None  # a state found unusable (warned about once)

    def _stamp_now(self) -> tuple:
        stats = [os.stat(p) for p in self.paths]
        return tuple((s.st_mtime_ns, s.st_size, s.st_ino) for s in stats)

    def initial(self):
        """What the server starts with (errors raise: the server must not start)."""
        stamp = self._stamp_now()
        config = self._build(self)
        self._stamp = stamp
        return config

    def fetch(self):
        """A newly built configuration when the files changed since the last one, else None."""
        stamp = None
        try:
            stamp = self._stamp_now()
            if stamp in (self._stamp, self._refused):
                return None
            config = self._build(self)
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError; SecurityConfigError a ValueError
            if stamp is None or stamp != self._refused:
                log.warning("tls_certificate_reload_failed", files=list(self.paths), error=str(exc),
                            hint="the current certificate stays in use until the files change again")
            self._refused = stamp
            return None
        self._stamp = stamp
        log.info("tls_certificate_reloaded", cert=self.cert)
        return config


def add_port(server, address: str, security: SecurityOptions | None) -> int:
    """Binds `address` with TLS when the options carry a server certificate; returns the port (0 on failure)."""
    credentials = security.server_credentials() if security is not None else None
    if credentials is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, credentials)


def engine_child_security(security: SecurityOptions) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that give an engine subprocess the server side of `security`.

    Tokens go through the environment, never argv, because argv is world-readable in `ps`. The
    returned environment always sets the variable, so a frontend token inherited from the parent
    cannot leak into the engine as its token."""
    argv: list[str] = []
    for flag, value in (("--tls-cert", security.tls_cert), ("--tls-key", security.tls_key),
                        ("--tls-client-ca", security.tls_client_ca)):
        if value is not None:
            argv += [flag, value]
    return argv, {_env_name(""): " ".join(security.tokens)}


@dataclass(frozen=True)
class AccessPolicy:
    """Who is calling a service, and whether they may administer it.

    Identity: with token auth on, a caller is the token it presented (a digest, never the token)
    plus its client certificate's common name under mTLS; with auth off every caller is the same
    anonymous identity (None). Admin: `allow_admin_commands`, or a presented admin token.
    """

    auth: bool = False
    admin_tokens: tuple[str, ...] = field(default=(), repr=False)
    allow_admin_commands: bool = False

    def caller_identity(self, context) -> str | None:
        """A stable, non-secret name of the caller; None when callers are not told apart."""
        if not self.auth:
            return None
        parts = []
        token = _bearer(context.invocation_metadata())
        if token is not None:
            parts.append("token:" + hashlib.sha256(token.encode("latin-1", "replace")).hexdigest()[:24])
        try:
            names = (context.auth_context() or {}).get("x509_common_name") or []
        except Exception:  # noqa: BLE001 - a context without an auth context (plaintext) names nothing
            names = []
        if names:
            name = names[0]
            parts.append("cert:" + (name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)))
        return "|".join(parts) or "anonymous"

    def is_admin(self, context) -> bool:
        if self.allow_admin_commands:
            return True
        token = _bearer(context.invocation_metadata())
        if token is None or not self.admin_tokens:
            return False
        candidate = token.encode("latin-1", "replace")
        ok = False
        for admin in self.admin_tokens:  # no early exit, as in BearerTokenInterceptor
            ok |= hmac.compare_digest(candidate, admin.encode("ascii"))
        return ok


# -- interceptors ------------------------------------------------------------------------------------
def _bearer(metadata) -> str | None:
    """The token of the first `authorization: Bearer <token>` entry, or None."""
    for key, value in metadata or ():
        if key == "authorization":
            if isinstance(value, bytes):
                value = value.decode("latin-1")
            scheme, _, token = value.strip().partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return None


def _token_matches(tokens: tuple[bytes, ...], presented: str) -> bool:
    candidate = presented.encode("latin-1", "replace")
    ok = False
    for token in tokens:  # no early exit: timing must not tell which token matched
        ok |= hmac.compare_digest(candidate, token)
    return ok


def bearer_denial(tokens: tuple[str, ...], metadata) -> grpc.StatusCode | None:
    """How a call carrying `metadata` (lower-case (key, value) pairs; HTTP headers alike) is
    refused under `tokens`: None when auth is off or its bearer token is one of them, else
    UNAUTHENTICATED (no token) or PERMISSION_DENIED (a wrong one). The HTTP face's check; the
    gRPC one is `BearerTokenInterceptor`, which answers the same."""
    if not tokens:
        return None
    presented = _bearer(metadata)
    if presented is None:
        return grpc.StatusCode.UNAUTHENTICATED
    if _token_matches(tuple(t.encode("ascii") for t in tokens), presented):
        return None
    return grpc.StatusCode.PERMISSION_DENIED


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without a valid bearer token: none → UNAUTHENTICATED, wrong → PERMISSION_DENIED."""

    def __init__(self, tokens: tuple[str, ...]) -> None:
        if not tokens:
            raise ValueError("at least one token is needed")
        self._tokens = tuple(t.encode("ascii") for t in tokens)

    def _valid(self, presented: str) -> bool:
        return _token_matches(self._tokens, presented)

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(AUTH_EXEMPT_PREFIXES):
            return await continuation(handler_call_details)
        presented = _bearer(handler_call_details.invocation_metadata)
        if presented is not None and self._valid(presented):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: let gRPC answer UNIMPLEMENTED as usual
            return None
        if presented is None:
            return _denial(handler, method, grpc.StatusCode.UNAUTHENTICATED, "missing bearer token")
        return _denial(handler, method, grpc.StatusCode.PERMISSION_DENIED, "invalid bearer token")


def _denial(handler: grpc.RpcMethodHandler, method: str, code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only aborts with `code`."""

    async def deny(request_or_iterator, context) -> None:
        log.warning("auth_rejected", method=method, peer=context.peer(), code=code.name)
        await context.abort(code, details)

    kwargs = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny, **kwargs)
    return grpc.unary_unary_rpc_method_handler(deny, **kwargs)


class _MetadataAdder:
    """Adds fixed metadata (the bearer token) to the details of an outgoing call."""

    def __init__(self, metadata: list[tuple[str, str]]) -> None:
        self._metadata = list(metadata)

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        merged = grpc.aio.Metadata(*(details.metadata or ()))
        for key, value in self._metadata:
            if key in merged:  # one authorization entry only: ours replaces the caller's
                merged.delete_all(key)
            merged.add(key, value)
        return details._replace(metadata=merged)


class _UnaryUnaryMetadata(_MetadataAdder, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _UnaryStreamMetadata(_MetadataAdder, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _StreamUnaryMetadata(_MetadataAdder, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStreamMetadata(_MetadataAdder, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


def metadata_interceptors(metadata: list[tuple[str, str]]) -> list[grpc.aio.ClientInterceptor]:
    """One interceptor per call kind: an asyncio channel files each interceptor under the first
    kind it implements, so a single class covering all four would miss streaming calls."""
    kinds = (_UnaryUnaryMetadata, _UnaryStreamMetadata, _StreamUnaryMetadata, _StreamStreamMetadata)
    return [kind(metadata) for kind in kinds]
