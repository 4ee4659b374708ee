"""Client request IDs ↔ engine request IDs, unique across frontend replicas."""

from __future__ import annotations

import os
import re
import socket
import threading
import uuid
from dataclasses import dataclass

MAX_EXTERNAL_ID_LEN = 256
_PRINTABLE_ASCII = re.compile(r"[\x20-\x7e]+")
_PREFIX_OK = re.compile(r"[A-Za-z0-9._-]{1,64}")
_PREFIX_SANITIZE = re.compile(r"[^A-Za-z0-9._-]+")


class DuplicateRequestId(ValueError):
    """The client reused an external request ID that is still in flight."""

    def __init__(self, external_id: str) -> None:
        super().__init__(f"request id {external_id!r} is already in flight")
        self.external_id = external_id


@dataclass(frozen=True)
class Registration:
    """One registered client request: its external ID and one internal ID per choice."""

    external_id: str
    internal_ids: list[str]
    owner: str | None = None


@dataclass
class _Entry:
    """What the map knows of one in-flight request: its choices still running, whether an
    abort was asked for (recorded from arrival, whatever stage the request is at), its owner."""

    internal_ids: list[str]
    owner: str | None
    aborted: bool = False


def default_replica_prefix() -> str:
    """`<host>-<pid>`, cleaned to [A-Za-z0-9._-]: tells replicas apart in logs; uniqueness
    itself comes from the uuid4 that follows it."""
    host = _PREFIX_SANITIZE.sub("-", socket.gethostname()).strip("-")[:40] or "host"
    return f"{host}-{os.getpid()}"


class RequestIdMap:
    """Tracks which engine (internal) request IDs serve which in-flight client (external) ID.

    Internal IDs are `<replica prefix>-<uuid4 hex>`, with `-<choice index>` appended when a
    request fans out into n > 1 choices. Every ending (finish, abort, error, disconnect) must
    call `release` or `release_internal`; both are idempotent, so calling them from several
    cleanup paths is safe. `abort` marks a request from the moment it is registered, so the
    request path can honour an abort that arrived before its choices reached an engine. All methods take one lock and never await, so the map may be used
    from the event loop and from threads alike.
    """

    def __init__(self, replica_prefix: str | None = None) -> None:
        prefix = default_replica_prefix() if replica_prefix is None else replica_prefix
        if not _PREFIX_OK.fullmatch(prefix):
            raise ValueError("replica prefix must be 1-64 characters from [A-Za-z0-9._-]")
        self.replica_prefix = prefix
        self._lock = threading.Lock()
        # external id -> internal ids still in flight (insertion order = choice index), flags
        self._by_external: dict[str, _Entry] = {}
        self._by_internal: dict[str, str] = {}

    def register(self, external_id: str | None, n: int = 1, owner: str | None = None) -> Registration:
        """Registers a request with `n` choices; generates the external ID when None. `owner`
        names the caller (None: callers are not told apart); only it may `abort` the request.

        Raises `DuplicateRequestId` when `external_id` is in flight, ValueError when it is
        malformed or `n` < 1.
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if external_id is None:
            external_id = f"req-{uuid.uuid4().hex}"
        else:
            validate_external_id(external_id)
        base = f"{self.replica_prefix}-{uuid.uuid4().hex}"
        internal = [base] if n == 1 else [f"{base}-{i}" for i in range(n)]
        with self._lock:
            if external_id in self._by_external:
                raise DuplicateRequestId(external_id)
            self._by_external[external_id] = _Entry(list(internal), owner)
            for iid in internal:
                self._by_internal[iid] = external_id
        return Registration(external_id, internal, owner)

    def internal_ids(self, external_id: str) -> list[str]:
        """Internal IDs of `external_id` still in flight ([] when it is unknown or released)."""
        with self._lock:
            entry = self._by_external.get(external_id)
            return list(entry.internal_ids) if entry is not None else []

    def abort(self, external_id: str, caller: str | None = None, override: bool = False) -> list[str] | None:
        """Marks the request aborted; returns its internal IDs still in flight, or None when it
        is not in flight or (without `override`) belongs to an owner other than `caller`.
        Aborting twice returns [] the second time: the first abort already ended every choice."""
        with self._lock:
            entry = self._by_external.get(external_id)
            if entry is None or (not override and entry.owner is not None and entry.owner != caller):
                return None
            if entry.aborted:
                return []
            entry.aborted = True
            return list(entry.internal_ids)

    def is_aborted(self, external_id: str) -> bool:
        with self._lock:
            entry = self._by_external.get(external_id)
            return entry is not None and entry.aborted

    def external_for(self, internal_id: str) -> str | None:
        with self._lock:
            return self._by_internal.get(internal_id)

    def release(self, external_id: str) -> list[str]:
        """Forgets the request; returns the internal IDs that were still in flight (to abort)."""
        with self._lock:
            entry = self._by_external.pop(external_id, None)
            internal = entry.internal_ids if entry is not None else []
            for iid in internal:
                self._by_internal.pop(iid, None)
            return internal

    def release_internal(self, internal_id: str) -> bool:
        """Forgets one ended choice; True when it was the request's last one (the external ID
        is then released too)."""
        with self._lock:
            external_id = self._by_internal.pop(internal_id, None)
            if external_id is None:
                return False
            remaining = self._by_external[external_id].internal_ids
            remaining.remove(internal_id)
            if remaining:
                return False
            del self._by_external[external_id]
            return True

    def __contains__(self, external_id: object) -> bool:
        with self._lock:
            return external_id in self._by_external

    def __len__(self) -> int:
        """External IDs in flight."""
        with self._lock:
            return len(self._by_external)

    @property
    def num_internal(self) -> int:
        """Internal IDs in flight; with `len`, what a leak check looks at."""
        with self._lock:
            return len(self._by_internal)


def validate_external_id(external_id: str) -> None:
    """External IDs are echoed in headers and logs: 1-256 printable ASCII characters."""
    if not isinstance(external_id, str):
        raise ValueError(f"request id must be a string, got {type(external_id).__name__}")
    if not external_id:
        raise ValueError("request id must not be empty")
    if len(external_id) > MAX_EXTERNAL_ID_LEN:
        raise ValueError(f"request id is {len(external_id)} characters long; the limit is {MAX_EXTERNAL_ID_LEN}")
    if not _PRINTABLE_ASCII.fullmatch(external_id):
        raise ValueError("request id must contain only printable ASCII characters (0x20-0x7E)")
