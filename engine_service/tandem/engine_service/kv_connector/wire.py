"""The KV pull wire protocol: msgspec structs, length-prefixed msgpack frames, raw block payloads, a CRC32 per block.

A pull is one TCP connection from the consumer to the producer's KV address:

    consumer -> PullRequest(lease_id, block ids per group,      (or ReleaseLease, IpcHandlesRequest,
                            state slot or None)                  NixlHandshake)
    producer -> BlockFrame * n, [StateFrame], then PullEnd(n)   (or PullError(message) at any point)

(a large pull: several such connections at once, each a `PullRequest` part with its own blocks)

Each frame is a 4-byte big-endian length and a msgpack body (a tagged union, so one decoder reads
every message). A `BlockFrame` announces one block of one paged group — every layer of that group,
concatenated — by its size and the CRC32 of its bytes (computed by the producer before sending);
the block's bytes follow the frame raw, `nbytes` of them, outside the msgpack body, so neither end
copies them into or out of an encoding: the producer sends them from its staging memory, the
consumer checks `nbytes` against its own block size and receives them straight into the row it
preallocated for that block, then recomputes the CRC32 and fails the pull on a mismatch. A
`StateFrame` (hybrid models, when the request names the lease's state slot) announces that slot of
every state layer (`state_io.py`'s order) the same way, after the blocks; `PullEnd` counts it. The producer releases the lease when
the connection ends, whatever happened (the consumer pulls once).

Every consumer message carries the engine's bearer token and the lease's secret, and a pull or a
handshake the digest of the consumer's prompt (`auth.py`). Frame lengths are checked before
anything is allocated: the producer reads a request of at most `MAX_REQUEST_BYTES`; the consumer
reads frames of at most `frame_limit` (a small envelope: payloads travel raw), and a payload only
into memory it sized itself, so a peer's length field never sizes an allocation.
"""

from __future__ import annotations

import socket
import struct
import zlib
from typing import Union

import msgspec

MAX_FRAME_BYTES = 1 << 31  # a frame claiming more is corrupt (a block of one group is far smaller)
# A consumer's request: block ids (a few bytes each in msgpack) for a prompt at most a context long.
MAX_REQUEST_BYTES = 4 << 20
# What a frame carries besides its payload: msgpack tags, field names, small integers, a message.
FRAME_ENVELOPE_BYTES = 4096
MAX_PULL_PARTS = 16  # connections one pull may use at once
_LEN = struct.Struct(">I")


class LayerRegion(msgspec.Struct, array_like=True):
    """Where one layer's blocks lie in a producer's memory: block b's chunk c starts at
    `base + b * block_stride + c * chunk_stride` and is `chunk_bytes` long (2 chunks, K and V,
    for attention layers; 1 for latent layers)."""

    base: int
    block_stride: int
    chunk_stride: int
    chunk_bytes: int
    num_chunks: int


class PullRequest(msgspec.Struct, tag="pull", kw_only=True):
    """Send these of the lease's blocks, per paged group (ids in the producer's tables, in the
    lease's order, each once), and the lease's state slot `state_slot` (hybrid models; None: no
    state). `token`, `lease_secret`, `prompt_digest`: see the module docstring. A large pull
    travels as `parts` requests on as many connections at once, this one part `part` (its own
    slice of the blocks); the producer releases the lease once every part was served in full, or
    as soon as one fails."""

    lease_id: str
    block_ids: list[list[int]]
    state_slot: int | None = None
    token: str = ""
    lease_secret: str = ""
    prompt_digest: str = ""
    part: int = 0
    parts: int = 1


class ReleaseLease(msgspec.Struct, tag="release", kw_only=True):
    """The consumer needs nothing (its own prefix cache held every block) or gives up."""

    lease_id: str
    token: str = ""
    lease_secret: str = ""


class IpcHandlesRequest(msgspec.Struct, tag="ipc_handles", kw_only=True):
    """CUDA IPC handshake: the producer's cache tensors' handles for this lease's pull."""

    lease_id: str
    token: str = ""
    lease_secret: str = ""
    prompt_digest: str = ""


class NixlHandshake(msgspec.Struct, tag="nixl_handshake", kw_only=True):
    """NIXL: the producer's agent metadata and block layout for this lease's pull."""

    lease_id: str
    token: str = ""
    lease_secret: str = ""
    prompt_digest: str = ""


class BlockFrame(msgspec.Struct, tag="block", kw_only=True):
    """Block `index` (position in the request's `block_ids[group]`) of paged group `group`: its
    `nbytes` bytes follow this frame raw."""

    group: int
    index: int
    nbytes: int
    crc32: int


class StateFrame(msgspec.Struct, tag="state", kw_only=True):
    """State slot `slot` (the producer's) of every state layer, in `state_io.py`'s order: its
    `nbytes` bytes follow this frame raw."""

    slot: int
    nbytes: int
    crc32: int


class PullEnd(msgspec.Struct, tag="end", kw_only=True):
    """Every requested block (and the state, if requested) was sent: `num_frames` frames."""

    num_frames: int


class PullError(msgspec.Struct, tag="error", kw_only=True):
    """The producer cannot serve the request. `kind`: "refused" (an unknown, expired or released
    lease, a wrong secret, blocks or a prompt the lease does not hold: what the consumer was
    given does not fit) or "unauthenticated" (no or a wrong bearer token)."""

    message: str
    kind: str = "refused"


class IpcHandles(msgspec.Struct, tag="ipc", kw_only=True):
    """Per paged group, per layer: the cache tensor's CUDA IPC handle fields (`cuda_ipc.py`);
    `state`: the same fields per state tensor, in `state_io.py`'s order (empty without state)."""

    device_uuid: str
    groups: list[list[list]]
    state: list[list] = msgspec.field(default_factory=list)


class NixlMemory(msgspec.Struct, tag="nixl", kw_only=True):
    """The producer's NIXL agent metadata, its device, and per paged group, per layer, where each
    block's chunks lie (`nixl_transport.LayerRegion` fields)."""

    agent_metadata: bytes
    device_id: int
    groups: list[list[LayerRegion]]


WireMessage = Union[PullRequest, ReleaseLease, IpcHandlesRequest, NixlHandshake, BlockFrame, StateFrame, PullEnd,
                    PullError, IpcHandles, NixlMemory]

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(WireMessage)


class WireError(ConnectionError):
    """The stream ended early or carried a malformed frame."""


def checksum(data: bytes | memoryview) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def send_message(sock: socket.socket, msg: WireMessage, payload: bytes | memoryview | None = None) -> None:
    """Send `msg` as one frame, then `payload` (a BlockFrame's or StateFrame's bytes) raw, uncopied."""
    frame = bytearray(_LEN.size)
    _ENCODER.encode_into(msg, frame, _LEN.size)
    _LEN.pack_into(frame, 0, len(frame) - _LEN.size)
    sock.sendall(frame)
    if payload is not None:
        sock.sendall(payload)


def recv_payload_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` (writable, bytes) from the stream: the raw payload announced by the last frame."""
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    n, got = view.nbytes, 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise WireError(f"connection closed after {got} of {n} bytes")
        got += k


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    recv_payload_into(sock, memoryview(buf))
    return buf


def frame_limit(*payload_bytes: int) -> int:
    """The largest frame a consumer accepts when the msgpack bodies it expects carry at most these
    many bytes (a handshake's answer); a pull's frames are envelopes (`frame_limit()`): block and
    state bytes travel raw after them."""
    return max(payload_bytes, default=0) + FRAME_ENVELOPE_BYTES


def recv_message(sock: socket.socket, max_bytes: int = MAX_FRAME_BYTES) -> WireMessage:
    """The next message; WireError on a closed stream, a frame longer than `max_bytes` (checked
    before its buffer is allocated) or an undecodable frame."""
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > min(max_bytes, MAX_FRAME_BYTES):
        raise WireError(f"frame of {n} bytes exceeds the limit of {min(max_bytes, MAX_FRAME_BYTES)}")
    body = _recv_exact(sock, n)
    try:
        return _DECODER.decode(body)
    except msgspec.DecodeError as exc:
        raise WireError(f"malformed frame: {exc}") from None
