"""Per-hop TTFT stamps for `stamps.patch` (a diagnostic, never imported by Tandem itself).

`stamp(name, t_ns=None)` appends "<perf_counter_ns> <pid> <name>" to the file named by $HOP_FILE (nothing
when it is unset). perf_counter is CLOCK_MONOTONIC on Linux: one clock for every process of the
machine, so the client's, frontend's, engine's and core's stamps line up. See README.md.
"""

import os
import time

_fd = None


def stamp(name: str, t_ns: int | None = None) -> None:
    global _fd
    if _fd is None:
        path = os.environ.get("HOP_FILE")
        _fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else -1
    if _fd >= 0:
        os.write(_fd, f"{time.perf_counter_ns() if t_ns is None else t_ns} {os.getpid()} {name}\n".encode())
