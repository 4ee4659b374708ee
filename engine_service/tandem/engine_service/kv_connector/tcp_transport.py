"""TCP transport: the producer's KV pull server and the consumer's pull (any host, CPU or GPU).

`KVPullServer` (producer) listens on the engine's KV address; one thread per connection serves
one message (`wire.py`): a `PullRequest` is answered with one `BlockFrame` per block followed by
its raw bytes (read by `read_blocks`, lazily: a chunk's device-to-host copy overlaps the sending;
each block's CRC32 computed on a helper thread while the block before it is sent), a `StateFrame`
when the request names the lease's state slot (hybrid models; bytes by `read_state`, CRC32
likewise) and a `PullEnd`; a lease it does not hold, or a
block id outside the lease, or a state slot that is not the lease's, gets a `PullError`. A CUDA IPC or NIXL handshake is answered with
what the consumer needs to copy the blocks itself, and the connection stays open until it did. The lease is pinned while its blocks are read and
released when the connection ends, whatever happened. The server never touches the block
manager: a release is recorded in the lease table and freed by the engine-core thread.

Access (`auth.py`): with TLS configured the connection is TLS first (mutual with a client CA);
then every message must carry an accepted bearer token (when the engine has one) and the lease's
secret, else it gets a `PullError` and nothing is pinned, read or released. A pull or handshake
whose prompt digest differs from the lease's, or that names blocks outside the lease, out of the
lease's order or twice, is refused and the lease released (the lease was presented with its
secret, so its holder gave up on it).

`pull` (consumer) sends the request and checks every frame: its length before reading it (a
frame is an envelope; no longer one is read), the block's (state's) announced size against its
own before its bytes are received — straight into the row preallocated for that block, so a peer's
field never sizes an allocation —, that each requested (group, index) comes exactly once, the state exactly once
when requested and never otherwise, the CRC32 (on a helper thread while the next block arrives;
the first mismatch in request order is reported), and the closing count. Any mismatch raises `TransferError`
with what was wrong and its `kind`: "refused" (the producer refused what the consumer was given:
the caller's parameters are wrong, INVALID_ARGUMENT) or "unavailable" (the producer could not be
reached, the stream broke or arrived corrupted: retryable); the caller fails the request.
"""

from __future__ import annotations

import socket
import ssl
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import structlog

from tandem.engine_service.kv_connector.auth import KVCredentials, secret_matches
from tandem.engine_service.kv_connector.leases import LeaseTable
from tandem.engine_service.kv_connector.wire import (
    MAX_REQUEST_BYTES,
    BlockFrame,
    IpcHandles,
    MAX_PULL_PARTS,
    IpcHandlesRequest,
    NixlHandshake,
    NixlMemory,
    PullEnd,
    PullError,
    PullRequest,
    ReleaseLease,
    StateFrame,
    WireError,
    checksum,
    frame_limit,
    recv_message,
    recv_payload_into,
    send_message,
)

log = structlog.get_logger(__name__)

# bytes-like, one per block, in order; may be produced lazily (`KVBlockIO.iter_block_views`)
BlockReader = Callable[[int, list[int]], Iterable[bytes | memoryview]]
StateReader = Callable[[int], bytes]
# Kernel socket buffers asked for on both ends of a pull (Linux caps them at net.core.[rw]mem_max;
# a buffer already larger is kept).
SOCKET_BUFFER_BYTES = 16 << 20
# Helper threads per pull end computing block CRC32s (zlib's runs at a few GB/s on one core).
CRC_THREADS = 2
# A large pull travels in parts of at least `MIN_PART_BYTES` on up to `PULL_STREAMS` connections at
# once (one stream is held to about 3 GB/s by one core's socket copies and framing).
PULL_STREAMS = 4
MIN_PART_BYTES = 64 << 20


def tune_socket(sock: socket.socket) -> None:
    """No Nagle delay; send and receive buffers of at least `SOCKET_BUFFER_BYTES` where allowed."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            if sock.getsockopt(socket.SOL_SOCKET, opt) < SOCKET_BUFFER_BYTES:
                sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
        except OSError:
            pass


def _with_checksums(items: Iterable[tuple[int, int, bytes | memoryview]], pool: ThreadPoolExecutor
                    ) -> Iterator[tuple[int, int, bytes | memoryview, int]]:
    """(group, index, data, crc32) for each item, in order; the CRC32s of the next `CRC_THREADS`
    items are computed on `pool` while the caller sends the current one (zlib releases the GIL
    over large buffers, so a pull is not held to one core's CRC32 speed)."""
    pending: deque[tuple[tuple[int, int, bytes | memoryview], Future[int]]] = deque()
    for item in items:
        pending.append((item, pool.submit(checksum, item[2])))
        if len(pending) > CRC_THREADS:
            done, crc = pending.popleft()
            yield (*done, crc.result())
    while pending:
        done, crc = pending.popleft()
        yield (*done, crc.result())


class TransferError(RuntimeError):
    """A pull failed: the producer refused it (`kind` "refused"), or it could not be reached, the
    stream broke or a block was corrupt (`kind` "unavailable": retryable)."""

    def __init__(self, message: str, kind: str = "unavailable") -> None:
        super().__init__(message)
        self.kind = kind


_REQUESTS = (PullRequest, ReleaseLease, IpcHandlesRequest, NixlHandshake)


class KVPullServer:
    """Serves pulls of leased blocks on (host, port); see the module docstring.

    `tamper` and `tamper_state` are testing seams: applied to each block's (the state's) bytes
    after the checksum was computed (a corrupted transfer). `ipc_export` answers a CUDA IPC
    handshake (None: not offered). `read_state` reads a state slot (None: no state groups).
    `credentials`: the engine's token and TLS (None: no token, plaintext).
    """

    def __init__(self, host: str, port: int, leases: LeaseTable, read_blocks: BlockReader,
                 ipc_export: Callable[[], IpcHandles] | None = None,
                 on_release: Callable[[], None] | None = None,
                 nixl_export: Callable[[], NixlMemory] | None = None,
                 read_state: StateReader | None = None,
                 credentials: KVCredentials | None = None) -> None:
        self.credentials = credentials or KVCredentials()
        self._tls = self.credentials.server_context()
        self.leases = leases
        self.read_blocks = read_blocks
        self.read_state = read_state
        self.tamper_state: Callable[[bytes], bytes] | None = None
        self.ipc_export = ipc_export
        self.nixl_export = nixl_export
        self.on_release = on_release or (lambda: None)
        self.tamper: Callable[[bytes], bytes] | None = None
        self.frames_sent = 0
        self._parts_served: dict[str, set[int]] = {}  # lease id -> parts of its pull served in full
        self._parts_lock = threading.Lock()
        self._sock = socket.create_server((host, port), reuse_port=False)
        self._sock.settimeout(0.5)
        self.host = host
        self.port = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="tandem-kv-server", daemon=True)

    def start(self) -> "KVPullServer":
        self._thread.start()
        log.info("kv_pull_server_listening", host=self.host, port=self.port)
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="tandem-kv-pull", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        lease_id = None
        release = True  # unless a part of a pull whose other parts are still to be served
        try:
            conn.settimeout(60)
            tune_socket(conn)
            if self._tls is not None:
                conn = self._tls.wrap_socket(conn, server_side=True)
            msg = recv_message(conn, MAX_REQUEST_BYTES)
            if not isinstance(msg, _REQUESTS):
                send_message(conn, PullError(message=f"unexpected message {type(msg).__name__}"))
                return
            if not self.credentials.token_accepted(msg.token):
                send_message(conn, PullError(message="the KV pull port needs the engine's bearer token",
                                             kind="unauthenticated"))
                return
            if not self.leases.authorize(msg.lease_id, msg.lease_secret):
                # One answer for an unknown lease and a wrong secret: existence is not revealed.
                send_message(conn, PullError(message="the lease is unknown, expired, released or not yours"))
                return
            if isinstance(msg, ReleaseLease):
                self.leases.request_release(msg.lease_id)
                self.on_release()
                send_message(conn, PullEnd(num_frames=0))
                return
            tables = self.leases.pin(msg.lease_id)
            if tables is None:
                send_message(conn, PullError(message="the lease is unknown, expired, released or not yours"))
                return
            lease_id = msg.lease_id
            if not secret_matches(self.leases.prompt_digest(lease_id) or "", msg.prompt_digest):
                send_message(conn, PullError(message="the lease was made for another prompt"))
                return
            if isinstance(msg, IpcHandlesRequest):
                self._serve_handshake(conn, self.ipc_export, "cuda_ipc")
            elif isinstance(msg, NixlHandshake):
                self._serve_handshake(conn, self.nixl_export, "nixl")
            elif self._serve_pull(conn, msg, tables):
                release = self._all_parts_served(msg)
        except (OSError, WireError) as exc:
            log.info("kv_pull_connection_ended", error=str(exc), lease_id=lease_id)
        finally:
            if lease_id is not None:
                if release:
                    self._parts_served.pop(lease_id, None)
                self.leases.unpin(lease_id, release=release)
                self.on_release()
            conn.close()

    def _all_parts_served(self, msg: PullRequest) -> bool:
        """Record that part `msg.part` of a pull was served in full; whether every part has been."""
        if msg.parts == 1:
            return True
        with self._parts_lock:
            if len(self._parts_served) > 1024:  # pulls whose other parts never came: their leases ended
                for stale in [x for x in self._parts_served if self.leases.prompt_digest(x) is None]:
                    del self._parts_served[stale]
            done = self._parts_served.setdefault(msg.lease_id, set())
            done.add(msg.part)
            return len(done) == msg.parts

    def _serve_pull(self, conn: socket.socket, msg: PullRequest, tables: list[list[int]]) -> bool:
        """Serve one pull (or one part of one); whether every frame and the PullEnd were sent."""
        if not 0 <= msg.part < msg.parts <= MAX_PULL_PARTS:
            send_message(conn, PullError(message=f"part {msg.part} of {msg.parts}: at most {MAX_PULL_PARTS} parts"))
            return False
        if len(msg.block_ids) != len(tables):
            send_message(conn, PullError(message=f"{len(msg.block_ids)} cache groups requested, "
                                                 f"the producer has {len(tables)}"))
            return False
        for g, ids in enumerate(msg.block_ids):
            problem = blocks_outside_lease(ids, tables[g])
            if problem:
                send_message(conn, PullError(message=f"group {g}: {problem}"))
                return False
        if msg.state_slot is not None:
            leased_slot = self.leases.state_slot(msg.lease_id)
            if self.read_state is None or leased_slot is None or msg.state_slot != leased_slot:
                send_message(conn, PullError(message=f"state slot {msg.state_slot} is not in the lease"))
                return False
        n = 0
        blocks = ((g, j, data) for g, ids in enumerate(msg.block_ids)
                  for j, data in enumerate(self.read_blocks(g, ids)))
        with ThreadPoolExecutor(CRC_THREADS, thread_name_prefix="tandem-kv-crc") as pool:
            for g, j, data, crc in _with_checksums(blocks, pool):
                if self.tamper is not None:
                    data = self.tamper(bytes(data))
                send_message(conn, BlockFrame(group=g, index=j, nbytes=len(data), crc32=crc), data)
                n += 1
        if msg.state_slot is not None:
            assert self.read_state is not None
            data = self.read_state(msg.state_slot)
            crc = checksum(data)
            if self.tamper_state is not None:
                data = self.tamper_state(data)
            send_message(conn, StateFrame(slot=msg.state_slot, nbytes=len(data), crc32=crc), data)
            n += 1
        self.frames_sent += n
        send_message(conn, PullEnd(num_frames=n))
        return True

    def _serve_handshake(self, conn: socket.socket, export: Callable | None, name: str) -> None:
        if export is None:
            send_message(conn, PullError(message=f"this producer does not offer {name}"))
            return
        send_message(conn, export())
        # The consumer copies while the lease stays pinned, then closes (or sends anything).
        conn.settimeout(120)
        try:
            recv_message(conn, MAX_REQUEST_BYTES)
        except WireError:
            pass


def blocks_outside_lease(ids: list[int], leased: list[int]) -> str:
    """What is wrong with pulling `ids` of a lease holding `leased` (one group), or "": every id
    must be in the lease, once, in the lease's order (so entry j lands where the consumer's
    prompt position says)."""
    where = {b: i for i, b in enumerate(leased)}
    last = -1
    for b in ids:
        i = where.get(b)
        if i is None or b < 0:
            return f"block {b} is not in the lease"
        if i <= last:
            return f"block {b} is named twice or out of the lease's order"
        last = i
    return ""


def connect(host: str, port: int, timeout: float, tls: ssl.SSLContext | None = None) -> socket.socket:
    """A connection to a producer's pull address (TLS with `tls`, verifying `host`)."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise TransferError(f"cannot reach the KV producer at {host}:{port}: {exc}") from None
    tune_socket(sock)
    if tls is not None:
        try:
            sock = tls.wrap_socket(sock, server_hostname=host)
        except OSError as exc:
            sock.close()
            raise TransferError(f"TLS with the KV producer at {host}:{port} failed: {exc}") from None
    return sock


def refusal(msg: PullError) -> TransferError:
    """The consumer's error for a producer's PullError."""
    if msg.kind == "unauthenticated":
        return TransferError(f"producer refused the pull: {msg.message} (check the engines' --auth-token)")
    return TransferError(f"producer refused the pull: {msg.message}", kind="refused")


class Pulled:
    """What one pull brought: per group, the blocks' bytes in request order (`blocks[g][j]`, a view
    of row j of `rows[g]`, the `[n, block_bytes]` uint8 array they were received into); the
    state's bytes (None when no state slot was requested)."""

    __slots__ = ("blocks", "rows", "state")

    def __init__(self, rows: list[np.ndarray], state: bytes | None) -> None:
        self.rows = rows
        self.blocks = [[memoryview(r[j]) for j in range(r.shape[0])] for r in rows]
        self.state = state


def pull(sock: socket.socket, lease_id: str, block_ids: list[list[int]], block_bytes: list[int],
         state_slot: int | None = None, state_bytes: int = 0, *, token: str = "", lease_secret: str = "",
         prompt_digest: str = "", rows: list[np.ndarray] | None = None, part: int = 0, parts: int = 1) -> Pulled:
    """Pull `block_ids[g]` of every group, and the lease's state slot `state_slot` (of
    `state_bytes` bytes) when not None, over the connected `sock`, presenting `token`,
    `lease_secret` and `prompt_digest`. Blocks are received into `rows[g]` (writable, C-contiguous
    `[len(block_ids[g]), block_bytes[g]]` uint8 arrays, e.g. pinned host memory; allocated here
    when None). `part` of `parts`: see `PullRequest` (`pull_parts` splits a pull). Raises
    TransferError (see the module docstring)."""
    if rows is None:
        rows = [np.empty((len(ids), size), dtype=np.uint8) for ids, size in zip(block_ids, block_bytes)]
    for g, (r, ids) in enumerate(zip(rows, block_ids)):
        if r.shape != (len(ids), block_bytes[g]) or r.dtype != np.uint8 or not r.flags.c_contiguous:
            raise ValueError(f"group {g}: rows {r.shape} {r.dtype} for {len(ids)} blocks of {block_bytes[g]} bytes")
    state: bytearray | None = None
    seen = [np.zeros(len(ids), dtype=bool) for ids in block_ids]
    crcs: list[tuple[int, int, int, Future[int]]] = []  # (group, index, announced CRC32, computed)
    try:
        with ThreadPoolExecutor(CRC_THREADS, thread_name_prefix="tandem-kv-crc") as pool:
            send_message(sock, PullRequest(lease_id=lease_id, block_ids=block_ids, state_slot=state_slot,
                                           token=token, lease_secret=lease_secret, prompt_digest=prompt_digest,
                                           part=part, parts=parts))
            received = 0
            while True:
                msg = recv_message(sock, frame_limit())
                if isinstance(msg, PullError):
                    raise refusal(msg)
                if isinstance(msg, PullEnd):
                    break
                if isinstance(msg, StateFrame):
                    if state_slot is None or msg.slot != state_slot:
                        raise TransferError(f"state frame for slot {msg.slot}, requested {state_slot}")
                    if state is not None:
                        raise TransferError("state frame sent twice")
                    if msg.nbytes != state_bytes:
                        raise TransferError(f"state frame has {msg.nbytes} bytes, expected {state_bytes} "
                                            "(different model or state layout?)")
                    state = bytearray(state_bytes)
                    recv_payload_into(sock, memoryview(state))
                    if checksum(state) != msg.crc32:
                        raise TransferError(f"checksum mismatch in the state of slot {msg.slot}: the transfer was "
                                            "corrupted")
                    received += 1
                    continue
                if not isinstance(msg, BlockFrame):
                    raise TransferError(f"unexpected {type(msg).__name__} in a pull")
                g, j = msg.group, msg.index
                if not (0 <= g < len(rows) and 0 <= j < len(seen[g])):
                    raise TransferError(f"frame for unknown block (group {g}, index {j})")
                if seen[g][j]:
                    raise TransferError(f"block (group {g}, index {j}) sent twice")
                if msg.nbytes != block_bytes[g]:
                    raise TransferError(f"block (group {g}, index {j}) has {msg.nbytes} bytes, "
                                        f"expected {block_bytes[g]} (different model or cache layout?)")
                row = memoryview(rows[g][j])
                recv_payload_into(sock, row)
                seen[g][j] = True
                crcs.append((g, j, msg.crc32, pool.submit(checksum, row)))
                received += 1
            for g, j, announced, computed in sorted(crcs, key=lambda c: c[:2]):
                if computed.result() != announced:
                    raise TransferError(f"checksum mismatch in block (group {g}, index {j}): "
                                        "the transfer was corrupted")
    except (OSError, WireError) as exc:
        raise TransferError(f"KV pull connection failed: {exc}") from None
    expected = sum(len(ids) for ids in block_ids) + (state_slot is not None)
    if received != expected or msg.num_frames != expected:
        what = "blocks" if state_slot is None else "frames (blocks and the state)"
        raise TransferError(f"pull ended after {received} of {expected} {what}")
    if state_slot is not None and state is None:
        raise TransferError("pull ended without the state")
    return Pulled(rows, bytes(state) if state is not None else None)


def num_parts(block_ids: list[list[int]], block_bytes: list[int]) -> int:
    """Connections for a pull of these blocks: one per `MIN_PART_BYTES`, at most `PULL_STREAMS`
    and at most one per block of the largest group."""
    total = sum(len(ids) * size for ids, size in zip(block_ids, block_bytes))
    most = max((len(ids) for ids in block_ids), default=0)
    return max(1, min(PULL_STREAMS, total // MIN_PART_BYTES, most))


def pull_parts(socks: list[socket.socket], lease_id: str, block_ids: list[list[int]], block_bytes: list[int],
               state_slot: int | None = None, state_bytes: int = 0, *, rows: list[np.ndarray] | None = None,
               **auth: str) -> Pulled:
    """`pull` in `len(socks)` parts at once, part k over `socks[k]`: slice k of every group's ids
    (k/n to (k+1)/n of them), received into the same slice of `rows`; part 0 also brings the
    state. The first part to fail shuts the other connections down, and its error is raised
    (naming the part)."""
    n = len(socks)
    if rows is None:
        rows = [np.empty((len(ids), size), dtype=np.uint8) for ids, size in zip(block_ids, block_bytes)]
    if n == 1:
        return pull(socks[0], lease_id, block_ids, block_bytes, state_slot, state_bytes, rows=rows, **auth)
    cuts = [[len(ids) * k // n for k in range(n + 1)] for ids in block_ids]
    results: list[Pulled | None] = [None] * n
    failed: list[TransferError] = []
    lock = threading.Lock()

    def run(k: int) -> None:
        try:
            results[k] = pull(socks[k], lease_id, [ids[c[k]:c[k + 1]] for ids, c in zip(block_ids, cuts)],
                              block_bytes, state_slot if k == 0 else None, state_bytes,
                              rows=[r[c[k]:c[k + 1]] for r, c in zip(rows, cuts)], part=k, parts=n, **auth)
        except TransferError as exc:
            with lock:
                failed.append(TransferError(f"part {k} of {n}: {exc}", exc.kind))
                if len(failed) > 1:
                    return  # a consequence of the first failure's shutdown
            for i, other in enumerate(socks):
                if i != k:
                    try:
                        other.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

    threads = [threading.Thread(target=run, args=(k,), name="tandem-kv-pull-part", daemon=True)
               for k in range(1, n)]
    for t in threads:
        t.start()
    run(0)
    for t in threads:
        t.join()
    if failed:
        raise failed[0]
    first = results[0]
    assert first is not None
    return Pulled(rows, first.state)


def pull_blocks(sock: socket.socket, lease_id: str, block_ids: list[list[int]],
                block_bytes: list[int], **auth: str) -> list[list[memoryview]]:
    """`pull` of blocks only: per group, the blocks' bytes in request order."""
    return pull(sock, lease_id, block_ids, block_bytes, **auth).blocks


def release_lease(host: str, port: int, lease_id: str, lease_secret: str, credentials: KVCredentials | None = None,
                  timeout: float = 5.0) -> None:
    """Tell the producer the lease's blocks are not needed (best effort: expiry frees them anyway)."""
    credentials = credentials or KVCredentials()
    try:
        with connect(host, port, timeout, credentials.client_context()) as sock:
            send_message(sock, ReleaseLease(lease_id=lease_id, token=credentials.token, lease_secret=lease_secret))
            reply = recv_message(sock, frame_limit())
        if isinstance(reply, PullError):
            raise refusal(reply)
    except (TransferError, OSError, WireError) as exc:
        log.warning("kv_lease_release_failed", lease_id=lease_id, error=str(exc))
