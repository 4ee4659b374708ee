"""Who may use a KV pull port, and what binds a lease to its prompt (torch-free).

The pull port serves other users' KV bytes, so every message a consumer sends on it carries:

- the engine's bearer token (`KVCredentials.tokens`, the engine service's own `--auth-token`):
  required when the engine has one, compared in constant time against each accepted token;
- the lease's secret (`new_lease_secret`, made when the lease is granted): it travels only on the
  trusted path (the producer's reply to the frontend, the frontend's decode leg to the consumer),
  never to a public client, and is compared in constant time (`secret_matches`);
- for a pull or a handshake, the digest of the consumer's own prompt (`prompt_digest` of the
  first `num_prompt_tokens` token ids): a lease serves only the prompt it was made for.

With TLS configured on the engine (`--tls-cert`/`--tls-key`), the pull connection is TLS too:
the producer serves with the engine's certificate and, with `--tls-client-ca`, requires a client
certificate signed by that CA (mutual TLS); the consumer verifies the producer against
`--kv-tls-ca` (default: the engine's `--tls-client-ca`, else the system's roots) and presents
the engine's certificate as its client certificate.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


def new_lease_secret() -> str:
    """A fresh per-lease secret (256 random bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def secret_matches(expected: str, presented: str) -> bool:
    """Constant-time comparison of a lease secret (an empty expected secret never matches)."""
    return bool(expected) and hmac.compare_digest(expected.encode(), presented.encode("utf-8", "replace"))


def prompt_digest(token_ids: Sequence[int]) -> str:
    """SHA-256 of the token ids (as little-endian int64): the binding of a lease to its prompt."""
    return hashlib.sha256(np.asarray(token_ids, dtype="<i8").tobytes()).hexdigest()


@dataclass(frozen=True)
class KVCredentials:
    """One engine's credentials on the KV pull port (see the module docstring). Built from the
    engine's `KVTransferConfig`, whose token and certificate fields the engine service fills from
    its own security options."""

    tokens: tuple[str, ...] = field(default=(), repr=False)
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    tls_ca: str | None = None

    @property
    def token(self) -> str:
        """The token this engine presents to a producer ("" without one)."""
        return self.tokens[0] if self.tokens else ""

    def token_accepted(self, presented: str) -> bool:
        """Whether a peer's token is accepted: any token when none is configured, else one of
        ours, compared in constant time without an early exit."""
        if not self.tokens:
            return True
        candidate = presented.encode("utf-8", "replace")
        ok = False
        for token in self.tokens:
            ok |= hmac.compare_digest(candidate, token.encode())
        return ok

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def server_context(self) -> ssl.SSLContext | None:
        """The producer's TLS context (mTLS with a client CA), or None for plaintext."""
        if not self.tls:
            return None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.tls_cert, self.tls_key)
        if self.tls_client_ca is not None:
            ctx.load_verify_locations(self.tls_client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_context(self) -> ssl.SSLContext | None:
        """The consumer's TLS context (verifying the producer, presenting our certificate), or
        None for plaintext."""
        if not self.tls:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca or self.tls_client_ca)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.tls_cert, self.tls_key)
        return ctx
