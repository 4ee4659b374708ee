"""Producer-side leases: a finished prefill's blocks, kept for the decode leg's pull (torch-free).

A lease holds the blocks a prefill request owned when it finished, and for a hybrid model its
state slot (`LeasedBlocks`, shaped like what `BlockManager.free` reads from a sequence, so freeing
the lease frees the slot too), until one of:

- the consumer's pull connection ends (it pulled, failed or gave up) or it sent `ReleaseLease`;
- the prefill request id is aborted (the client went away before the decode leg);
- the lease expires (`expiry_unix` passed; a periodic sweep in the engine core).

Each lease has a random `secret` (`auth.new_lease_secret`) that a pull or a release must present,
and the `prompt_digest` of the prompt it was made for, which a pull's digest must equal.

Threads: the KV server's threads only `pin` / `unpin` / `request_release` (under the table's
lock); the engine-core thread grants leases and, in `take_releasable`, removes the ones to free
and frees their blocks itself. Invariant: a pinned lease (a pull is reading its blocks) is never
returned by `take_releasable`, even when expired, so a block being sent is never reallocated.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field

from tandem.engine_service.kv_connector.auth import new_lease_secret, secret_matches


@dataclass(eq=False)
class LeasedBlocks:
    """The blocks (and state slot) a lease owns, in the attributes `BlockManager.free` reads."""

    request_id: str
    block_tables: list[list[int]]
    block_hashes: list[int] = field(default_factory=list)
    state_slot: int | None = None


@dataclass(eq=False)
class Lease:
    """One prefill's blocks under a lease (see the module docstring)."""

    lease_id: str
    request_id: str
    blocks: LeasedBlocks
    expiry_unix: float
    secret: str = field(default_factory=new_lease_secret, repr=False)
    prompt_digest: str = ""
    caller: str | None = None  # who made it (the engine's caller identity; lease caps)
    pins: int = 0
    release_requested: bool = False


class LeaseTable:
    """Live leases by id and by prefill request id (see the module docstring for the threads)."""

    def __init__(self, clock=time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._by_id: dict[str, Lease] = {}
        self._by_request: dict[str, str] = {}
        self.expired_total = 0
        self.released_total = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def now(self) -> float:
        return self._clock()

    def grant(self, request_id: str, blocks: LeasedBlocks, ttl_seconds: float, prompt_digest: str = "",
              caller: str | None = None) -> Lease:
        lease = Lease(uuid.uuid4().hex, request_id, blocks, self._clock() + ttl_seconds, prompt_digest=prompt_digest,
                      caller=caller)
        with self._lock:
            old = self._by_request.get(request_id)
            if old is not None:  # a reused prefill id: the older lease goes first
                self._by_id[old].release_requested = True
            self._by_id[lease.lease_id] = lease
            self._by_request[request_id] = lease.lease_id
        return lease

    def count_for(self, caller: str | None) -> int:
        """Live leases made by `caller`."""
        with self._lock:
            return sum(1 for lease in self._by_id.values() if lease.caller == caller)

    # -- KV server threads -----------------------------------------------------------------------
    def authorize(self, lease_id: str, secret: str) -> bool:
        """Whether `secret` is the live lease `lease_id`'s (constant-time comparison)."""
        with self._lock:
            lease = self._by_id.get(lease_id)
            expected = lease.secret if lease is not None else ""
        return secret_matches(expected, secret)

    def prompt_digest(self, lease_id: str) -> str | None:
        """The digest of the prompt the lease was made for (None for an unknown lease)."""
        with self._lock:
            lease = self._by_id.get(lease_id)
            return None if lease is None else lease.prompt_digest

    def pin(self, lease_id: str) -> list[list[int]] | None:
        """The lease's block tables (a copy) while a pull reads them; None if unknown, expired or
        released. Every successful `pin` is followed by one `unpin`."""
        with self._lock:
            lease = self._by_id.get(lease_id)
            if lease is None or lease.release_requested or lease.expiry_unix <= self._clock():
                return None
            lease.pins += 1
            return [list(t) for t in lease.blocks.block_tables]

    def state_slot(self, lease_id: str) -> int | None:
        """The lease's state slot (hybrid models; None without one or for an unknown lease). Read
        by a pull that pinned the lease, so the slot cannot change hands meanwhile."""
        with self._lock:
            lease = self._by_id.get(lease_id)
            return None if lease is None else lease.blocks.state_slot

    def unpin(self, lease_id: str, release: bool = True) -> None:
        with self._lock:
            lease = self._by_id.get(lease_id)
            if lease is not None:
                lease.pins -= 1
                lease.release_requested |= release

    def request_release(self, lease_id: str) -> bool:
        with self._lock:
            lease = self._by_id.get(lease_id)
            if lease is None:
                return False
            lease.release_requested = True
            return True

    # -- engine-core thread ----------------------------------------------------------------------
    def release_request_id(self, request_id: str) -> bool:
        """Abort of the prefill request: its lease (if any) is released at the next sweep."""
        with self._lock:
            lease_id = self._by_request.get(request_id)
            if lease_id is None:
                return False
            self._by_id[lease_id].release_requested = True
            return True

    def take_releasable(self) -> list[Lease]:
        """Remove and return every unpinned lease that was released or has expired."""
        now = self._clock()
        out: list[Lease] = []
        with self._lock:
            for lease in list(self._by_id.values()):
                if lease.pins > 0:
                    continue
                expired = lease.expiry_unix <= now
                if lease.release_requested or expired:
                    del self._by_id[lease.lease_id]
                    if self._by_request.get(lease.request_id) == lease.lease_id:
                        del self._by_request[lease.request_id]
                    out.append(lease)
                    if lease.release_requested:
                        self.released_total += 1
                    else:
                        self.expired_total += 1
        return out

    def has_pending_release(self) -> bool:
        with self._lock:
            return any(lease.release_requested and lease.pins == 0 for lease in self._by_id.values())
