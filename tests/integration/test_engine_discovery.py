"""Issue 24, acceptance 2: a frontend given one `dns:///` name follows the engines behind it.

Two engines on loopback addresses 127.0.0.2 and 127.0.0.3 (one port), and a frontend given
`--engine dns:///engines.test:PORT`; the name is pinned by an /etc/hosts-style file
(`$TANDEM_HOSTS_FILE`, read at every lookup). Requests spread over both engines; a third
engine added to the file gets traffic without a restart; killing one engine fails only the
requests it had in flight.
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tandem.client import TandemClient
from tandem.v1 import common_pb2, engine_pb2_grpc

MODEL = "dummy:tiny-qwen3"  # 512 positions
NAME = "engines.test"


def engine_stats(address: str) -> dict:
    from google.protobuf import json_format

    with grpc.insecure_channel(address) as ch:
        resp = engine_pb2_grpc.EngineStub(ch).Utility(
            common_pb2.UtilityRequest(command=common_pb2.UTILITY_COMMAND_STATS), timeout=10)
    return json_format.MessageToDict(resp.result)


def generated(address: str) -> float:
    return engine_stats(address)["generation_tokens_total"]


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.2)


@pytest.fixture
def cluster(server_tools, tmp_path):
    t = server_tools
    port, fport = t.free_port(), t.free_port()
    hosts = tmp_path / "hosts"
    engines: dict[str, object] = {}
    procs = []

    def start_engine(ip: str) -> str:
        address = f"{ip}:{port}"
        proc = t.ServerProcess(["engine", "--model", MODEL, "--device", "cpu", "--host", ip, "--port", str(port),
                                "--max-num-seqs", "16"])
        procs.append(proc)
        engines[address] = proc
        t.wait_serving(address, "tandem.v1.Engine", 300, proc.proc)
        return address

    def publish() -> None:  # the name's records: every engine started and not killed
        hosts.write_text("".join(f"{a.rsplit(':', 1)[0]} {NAME}\n" for a, p in engines.items() if p.proc.poll() is None))

    first, second = start_engine("127.0.0.2"), start_engine("127.0.0.3")
    publish()
    front = t.ServerProcess(["frontend", "--host", "127.0.0.1", "--port", str(fport), "--engine",
                             f"dns:///{NAME}:{port}", "--engine-resolve-interval", "0.5",
                             "--engine-connect-timeout", "60"], env={"TANDEM_HOSTS_FILE": str(hosts)})
    procs.append(front)
    try:
        t.wait_serving(f"127.0.0.1:{fport}", "tandem.v1.Frontend", 300, front.proc)
        with TandemClient(f"127.0.0.1:{fport}") as client:
            yield {"client": client, "engines": engines, "start_engine": start_engine, "publish": publish,
                   "first": first, "second": second}
    finally:
        for p in procs:
            p.stop()


def ready_engines(client: TandemClient) -> set[str]:
    return set(client.utility("stats")["frontend"]["ready_engines"])


def run_concurrently(client: TandemClient, count: int, **kwargs) -> list:
    """`count` generations at once; each result is the response or the grpc.RpcError."""
    def one(i: int):
        try:
            return client.generate(f"Request {i}:", timeout=120, temperature=0.0, ignore_eos=True, **kwargs)
        except grpc.RpcError as exc:
            return exc

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count)))


def test_engines_follow_the_name(cluster):
    client, first, second = cluster["client"], cluster["first"], cluster["second"]
    wait_until(lambda: ready_engines(client) == {first, second}, 30, "both engines of the name in rotation")

    # Concurrent requests spread over both (least in flight).
    before = {a: generated(a) for a in (first, second)}
    results = run_concurrently(client, 8, max_tokens=48)
    assert all(not isinstance(r, grpc.RpcError) for r in results), results
    assert all(generated(a) > before[a] for a in (first, second)), "a resolved engine got no request"

    # A third engine appears under the name: it joins without a restart and takes requests.
    third = cluster["start_engine"]("127.0.0.4")
    cluster["publish"]()
    wait_until(lambda: third in ready_engines(client), 30, "the new engine in rotation")
    results = run_concurrently(client, 9, max_tokens=48)
    assert all(not isinstance(r, grpc.RpcError) for r in results), results
    assert generated(third) > 0

    # Killing one engine fails only its in-flight requests.
    long = dict(max_tokens=400)
    with ThreadPoolExecutor(1) as waiter:
        pending = waiter.submit(run_concurrently, client, 9, **long)
        wait_until(lambda: all(engine_stats(a)["num_running"] >= 1 for a in (first, second, third)), 60,
                   "every engine running a long request")
        on_second = engine_stats(second)["num_running"]
        cluster["engines"][second].stop(signal.SIGKILL)
        results = pending.result(timeout=300)
    failed = [r for r in results if isinstance(r, grpc.RpcError)]
    assert len(failed) == on_second, [r.code() for r in failed]
    assert all(r.code() == grpc.StatusCode.UNAVAILABLE for r in failed), [(r.code(), r.details()) for r in failed]
    assert all(len(r.choices[0].token_ids) == 400 for r in results if not isinstance(r, grpc.RpcError))

    # Afterwards requests go to the engines left, with or without the name updated.
    results = run_concurrently(client, 4, max_tokens=8)
    assert all(not isinstance(r, grpc.RpcError) for r in results), results
    cluster["publish"]()
    wait_until(lambda: second not in {r for r in client.utility("stats")["engines"]}, 30,
               "the killed engine dropped from the pool once its name no longer lists it")
