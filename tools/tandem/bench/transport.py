"""`tandem bench transport`: the engine core's output transport, measured on the messages it sends.

One step of a 256-request decode batch is one `CoreOutputs` message (every request's delta plus
the core's stats). This benchmark sends such messages from this process (the "core") to a child
process (the "gRPC server") that decodes each one, over:

- `zmq-ipc`: ZeroMQ PUSH/PULL over an IPC socket, msgspec msgpack (what the engine uses);
- `pipe`: an OS pipe with 4-byte length framing, msgspec msgpack (what a multiprocessing Pipe
  does underneath, without its pickling).

Per transport and message shape it records what the core pays per message (encode + send, µs:
the time a step waits), the round trip of one message to a decoded reply (µs, p50/p99), and the
streaming rate (messages/s, the child decoding every message). Payloads are built from
`tandem.core_protocol`, so the sizes are the real ones.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any

import msgspec

from tandem.core_protocol import CoreCodec, CoreOutputs, EngineStats, RequestOutput, TokenLogprobs

TRANSPORTS = ("zmq-ipc", "pipe")
_ACK = b"k"


def step_message(num_requests: int, tokens_per_request: int = 1, top_logprobs: int | None = None) -> CoreOutputs:
    """A decode step's CoreOutputs: `num_requests` deltas of `tokens_per_request` tokens each."""
    outputs = []
    for i in range(num_requests):
        ids = [1000 + i + j for j in range(tokens_per_request)]
        lps = ([TokenLogprobs(t, -0.25, 1, [(t + k, -0.25 - k) for k in range(top_logprobs)]) for t in ids]
               if top_logprobs is not None else [None] * tokens_per_request)
        outputs.append(RequestOutput(f"cmpl-{i:08d}-0", ids, lps, num_prompt_tokens=512, arrival_time=123.0))
    return CoreOutputs(outputs=outputs, stats=EngineStats(num_running=num_requests, steps_total=10_000),
                       step_time=0.012, stepped=True, timestamp=time.monotonic())


# -- the two ends ----------------------------------------------------------------------------------


class _ZmqSender:
    def __init__(self, tmp: str) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.SNDHWM, 0)
        self.push.bind(f"ipc://{tmp}/to-child")
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(f"ipc://{tmp}/to-parent")
        self.child_args = ["--transport", "zmq-ipc", "--dir", tmp]
        self.pass_fds: tuple[int, ...] = ()

    def send(self, data: bytes) -> None:
        self.push.send(data, copy=False)

    def recv_ack(self) -> None:
        self.pull.recv()

    def close(self) -> None:
        self.push.close(0)
        self.pull.close(0)
        self.ctx.term()


class _PipeSender:
    def __init__(self, tmp: str) -> None:
        self.to_child_r, self.to_child_w = os.pipe()
        self.to_parent_r, self.to_parent_w = os.pipe()
        self.out = os.fdopen(self.to_child_w, "wb", buffering=0)
        self.child_args = ["--transport", "pipe", "--in-fd", str(self.to_child_r), "--out-fd", str(self.to_parent_w)]
        self.pass_fds = (self.to_child_r, self.to_parent_w)

    def send(self, data: bytes) -> None:
        self.out.write(struct.pack("<I", len(data)) + data)

    def recv_ack(self) -> None:
        os.read(self.to_parent_r, 1)

    def after_spawn(self) -> None:
        os.close(self.to_child_r)
        os.close(self.to_parent_w)

    def close(self) -> None:
        self.out.close()
        os.close(self.to_parent_r)


def _read_exact(fd: int, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        b = os.read(fd, n - got)
        if not b:
            raise EOFError
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def child_main(argv: list[str] | None = None) -> int:
    """The receiving end: decode every message; ack when asked (a message whose `stepped` is
    False ends a burst, and every message in ping-pong mode is such a message)."""
    p = argparse.ArgumentParser()
    p.add_argument("--transport", choices=TRANSPORTS, required=True)
    p.add_argument("--dir")
    p.add_argument("--in-fd", type=int)
    p.add_argument("--out-fd", type=int)
    args = p.parse_args(argv)
    decode = CoreCodec().message_decoder.decode
    if args.transport == "zmq-ipc":
        import zmq

        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        pull.connect(f"ipc://{args.dir}/to-child")
        push = ctx.socket(zmq.PUSH)
        push.connect(f"ipc://{args.dir}/to-parent")

        def recv() -> bytes:
            return pull.recv(copy=False).buffer

        def ack() -> None:
            push.send(_ACK)
    else:
        def recv() -> bytes:
            (n,) = struct.unpack("<I", _read_exact(args.in_fd, 4))
            return _read_exact(args.in_fd, n)

        def ack() -> None:
            os.write(args.out_fd, _ACK)
    while True:
        try:
            data = recv()
        except EOFError:
            return 0
        if len(data) == 1:  # the end
            return 0
        msg = decode(data)
        if not msg.stepped:
            ack()


def _measure(transport: str, message: CoreOutputs, pings: int, burst: int) -> dict[str, Any]:
    codec = CoreCodec()
    encode = codec.encoder.encode
    tmp = tempfile.mkdtemp(prefix="tandem-bench-transport-")
    sender = _ZmqSender(tmp) if transport == "zmq-ipc" else _PipeSender(tmp)
    child = subprocess.Popen([sys.executable, "-P", "-m", "tandem.bench.transport", *sender.child_args],
                             pass_fds=sender.pass_fds)
    if isinstance(sender, _PipeSender):
        sender.after_spawn()
    try:
        ping = msgspec.structs.replace(message, stepped=False)
        stream = msgspec.structs.replace(message, stepped=True)
        size = len(encode(stream))
        for _ in range(20):  # warm up: connections, caches
            sender.send(encode(ping))
            sender.recv_ack()
        rtts, send_costs = [], []
        for _ in range(pings):
            t0 = time.perf_counter()
            sender.send(encode(ping))
            t1 = time.perf_counter()
            sender.recv_ack()
            rtts.append(time.perf_counter() - t0)
            send_costs.append(t1 - t0)
        t0 = time.perf_counter()
        burst_send = 0.0
        for _ in range(burst):
            s0 = time.perf_counter()
            sender.send(encode(stream))
            burst_send += time.perf_counter() - s0
        sender.send(encode(ping))
        sender.recv_ack()
        elapsed = time.perf_counter() - t0
        sender.send(b"x")
    finally:
        child.wait(30)
        sender.close()
        shutil.rmtree(tmp, ignore_errors=True)
    rtts.sort()
    return {
        "transport": transport,
        "bytes_per_message": size,
        "send_us_p50": round(1e6 * statistics.median(send_costs), 2),
        "send_us_in_burst": round(1e6 * burst_send / burst, 2),
        "round_trip_us_p50": round(1e6 * rtts[len(rtts) // 2], 2),
        "round_trip_us_p99": round(1e6 * rtts[min(len(rtts) - 1, int(0.99 * len(rtts)))], 2),
        "messages_per_s": round((burst + 1) / elapsed, 1),
    }


SHAPES = {
    "decode-256": dict(num_requests=256),
    "decode-256-logprobs5": dict(num_requests=256, top_logprobs=5),
    "decode-64": dict(num_requests=64),
    "decode-1": dict(num_requests=1),
}


def run_transport(record: Any, shapes: list[str], pings: int, burst: int) -> None:
    """Fill `record.results["points"]` (one per transport and message shape) and the choice."""
    codec = CoreCodec()
    points = []
    for shape in shapes:
        message = step_message(**SHAPES[shape])
        for _ in range(50):  # warm up the encoder's buffers
            codec.encoder.encode(message)
        t0 = time.perf_counter()
        for _ in range(200):
            codec.encoder.encode(message)
        encode_us = 1e6 * (time.perf_counter() - t0) / 200
        data = codec.encoder.encode(message)
        t0 = time.perf_counter()
        for _ in range(200):
            codec.message_decoder.decode(data)
        decode_us = 1e6 * (time.perf_counter() - t0) / 200
        for transport in TRANSPORTS:
            with record.stage(f"{transport}-{shape}"):
                point = _measure(transport, message, pings, burst)
                point.update(shape=shape, encode_us=round(encode_us, 2), decode_us=round(decode_us, 2))
                points.append(point)
    record.results["points"] = points


def short_table(results: dict[str, Any]) -> list[str]:
    lines = [f"{'shape':<22} {'transport':<8} {'bytes':>7} {'encode us':>9} {'send us':>8} {'burst send us':>13} "
             f"{'rtt p50 us':>10} {'rtt p99 us':>10} {'msg/s':>9}"]
    for p in results.get("points", []):
        lines.append(f"{p['shape']:<22} {p['transport']:<8} {p['bytes_per_message']:>7} {p['encode_us']:>9.1f} "
                     f"{p['send_us_p50']:>8.1f} {p['send_us_in_burst']:>13.1f} {p['round_trip_us_p50']:>10.1f} "
                     f"{p['round_trip_us_p99']:>10.1f} {p['messages_per_s']:>9.0f}")
    return lines


if __name__ == "__main__":
    sys.exit(child_main())
