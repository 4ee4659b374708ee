"""Error details bounded in size: what a status message may echo of what the caller sent.

A status's details travel in the call's trailing metadata, which gRPC bounds (8 KiB by default):
a message that echoed a 24 KiB request id whole would turn the intended status into
RESOURCE_EXHAUSTED at the caller. Every echo of a caller's value goes through `echo`, and every
detail built from another component's text (an engine's error relayed by the frontend) through
`bounded`.
"""

from __future__ import annotations

MAX_ECHO_CHARS = 128  # of one echoed value
MAX_DETAIL_CHARS = 2048  # of a whole status message


def echo(value: object) -> str:
    """`repr(value)`, cut to MAX_ECHO_CHARS with a note of the full length."""
    text = repr(value)
    if len(text) <= MAX_ECHO_CHARS:
        return text
    size = len(value) if isinstance(value, (str, bytes)) else len(text)
    return f"{text[:MAX_ECHO_CHARS]}... ({size} characters)"


def bounded(details: str) -> str:
    """`details` cut to MAX_DETAIL_CHARS (with a note that it was cut)."""
    if len(details) <= MAX_DETAIL_CHARS:
        return details
    return details[:MAX_DETAIL_CHARS] + f"... ({len(details)} characters)"
