"""W3C Trace Context (`traceparent` / `tracestate`) for gRPC metadata, without an SDK.

Tandem records no spans itself; it only carries the trace across its hop so that the frontend's
and the engine's log lines of one request share a `trace_id` with whatever the client traced.
Each service acts as one span: it keeps the incoming trace ID, remembers the caller's span ID as
its parent, and sends a fresh span ID of its own downstream. A missing or malformed header
starts a new trace (and, as the specification requires, drops `tracestate` with it).

Format (https://www.w3.org/TR/trace-context/): `version-traceid-parentid-flags`, lowercase hex,
`00-<32 hex>-<16 hex>-<2 hex>`; all-zero IDs and version `ff` are invalid.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Iterable

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

_HEX = re.compile(r"[0-9a-f]+\Z")
_INVALID_TRACE_ID = "0" * 32
_INVALID_SPAN_ID = "0" * 16
# The specification lets a receiver drop tracestate it cannot keep; 512 characters and 32
# list members are the limits it asks propagators to honour.
_MAX_TRACESTATE_CHARS = 512
_MAX_TRACESTATE_MEMBERS = 32
SAMPLED = 0x01


def _is_hex(s: str, length: int) -> bool:
    return len(s) == length and _HEX.match(s) is not None


def new_trace_id() -> str:
    while True:  # all zeros is invalid; astronomically unlikely, but cheap to rule out
        value = os.urandom(16).hex()
        if value != _INVALID_TRACE_ID:
            return value


def new_span_id() -> str:
    while True:
        value = os.urandom(8).hex()
        if value != _INVALID_SPAN_ID:
            return value


@dataclass(frozen=True)
class TraceParent:
    """A parsed `traceparent` header: trace ID, the sender's span ID and the trace flags."""

    trace_id: str
    span_id: str
    flags: int = 0

    @property
    def sampled(self) -> bool:
        return bool(self.flags & SAMPLED)

    def header(self) -> str:
        """The header value, always in version 00 (the only version this code writes)."""
        return f"00-{self.trace_id}-{self.span_id}-{self.flags:02x}"


def parse_traceparent(value: str | None) -> TraceParent | None:
    """Parses a `traceparent` value; None when absent or invalid.

    Versions above 00 are accepted if their first four fields parse, with anything after a
    further `-` ignored, as the specification asks of version-00 parsers.
    """
    if not value:
        return None
    value = value.strip()
    if len(value) < 55:
        return None
    version = value[:2]
    if not _is_hex(version, 2) or version == "ff":
        return None
    if version == "00" and len(value) != 55:
        return None
    if len(value) > 55 and value[55] != "-":
        return None
    if value[2] != "-" or value[35] != "-" or value[52] != "-":
        return None
    trace_id, span_id, flags = value[3:35], value[36:52], value[53:55]
    if not (_is_hex(trace_id, 32) and _is_hex(span_id, 16) and _is_hex(flags, 2)):
        return None
    if trace_id == _INVALID_TRACE_ID or span_id == _INVALID_SPAN_ID:
        return None
    return TraceParent(trace_id, span_id, int(flags, 16))


def clean_tracestate(values: Iterable[str]) -> str | None:
    """Joins repeated `tracestate` values into one; None if empty or beyond the limits.

    Tandem adds no entry of its own, so it passes the list on unchanged when it is within the
    specification's limits and printable ASCII, and drops it otherwise.
    """
    members = [m.strip() for v in values for m in v.split(",") if m.strip()]
    if not members or len(members) > _MAX_TRACESTATE_MEMBERS:
        return None
    joined = ",".join(members)
    if len(joined) > _MAX_TRACESTATE_CHARS or not all(32 < ord(c) < 127 or c == " " for c in joined):
        return None
    if any("=" not in m for m in members):
        return None
    return joined


@dataclass(frozen=True)
class TraceContext:
    """This service's place in a trace: the trace, the caller's span (if any) and our own span."""

    trace_id: str
    span_id: str
    parent_span_id: str | None = None
    flags: int = 0
    tracestate: str | None = None

    @classmethod
    def from_metadata(cls, metadata: Iterable[tuple[str, str | bytes]] | None) -> "TraceContext":
        """Continues the caller's trace from gRPC metadata, or starts a new one."""
        parent_value: str | None = None
        states: list[str] = []
        for key, value in metadata or ():
            if isinstance(value, bytes):  # binary (-bin) metadata: never a trace header
                continue
            key = key.lower()
            if key == TRACEPARENT and parent_value is None:
                parent_value = value
            elif key == TRACESTATE:
                states.append(value)
        parent = parse_traceparent(parent_value)
        if parent is None:
            return cls(trace_id=new_trace_id(), span_id=new_span_id())
        return cls(
            trace_id=parent.trace_id,
            span_id=new_span_id(),
            parent_span_id=parent.span_id,
            flags=parent.flags,
            tracestate=clean_tracestate(states),
        )

    def traceparent(self) -> str:
        """The header that names this service's span as the parent of the next hop."""
        return TraceParent(self.trace_id, self.span_id, self.flags).header()

    def outgoing_metadata(self) -> tuple[tuple[str, str], ...]:
        """gRPC metadata for a downstream call."""
        md: tuple[tuple[str, str], ...] = ((TRACEPARENT, self.traceparent()),)
        if self.tracestate:
            md += ((TRACESTATE, self.tracestate),)
        return md

    def log_fields(self) -> dict[str, str]:
        fields = {"trace_id": self.trace_id, "span_id": self.span_id}
        if self.parent_span_id:
            fields["parent_span_id"] = self.parent_span_id
        return fields
