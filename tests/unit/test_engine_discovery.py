"""`dns:///` engine names: parsing, the hosts-file override, and the pool following a name's
addresses (added, drained once idle, kept through a failed lookup). No engine answers here: the
replicas' health checks fail fast against closed loopback ports."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from tandem.frontend import engine_discovery as d
from tandem.frontend.engine_pool import EnginePool
from tandem.v1 import common_pb2, engine_pb2


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_names_and_addresses_parse() -> None:
    assert d.parse_engine_name("10.0.0.1:50052") is None
    name = d.parse_engine_name("dns:///tandem-engine.ns.svc:50052")
    assert (name.host, name.port, str(name)) == ("tandem-engine.ns.svc", 50052, "dns:///tandem-engine.ns.svc:50052")
    with pytest.raises(ValueError):
        d.parse_engine_name("dns:///no-port")
    assert d.engine_address("10.0.0.1", 5) == "10.0.0.1:5"
    assert d.engine_address("fd00::1", 5) == "[fd00::1]:5"


def test_the_hosts_file_pins_a_name_and_dns_answers_the_rest(tmp_path, monkeypatch) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("# engines\n127.0.0.2 engines.test\n127.0.0.3 other engines.test  # second\n"
                     "127.0.0.2 engines.test\n")
    monkeypatch.setenv(d.HOSTS_FILE_ENV, str(hosts))
    assert asyncio.run(d.resolve_name("engines.test", 1)) == ["127.0.0.2", "127.0.0.3"]
    assert asyncio.run(d.resolve_name("ENGINES.test", 1)) == ["127.0.0.2", "127.0.0.3"]
    assert "127.0.0.1" in asyncio.run(d.resolve_name("localhost", 1))  # not in the file: the system resolver


class FakeDns:
    def __init__(self, records: list[str]) -> None:
        self.records = records
        self.fail = False

    async def __call__(self, host: str, port: int) -> list[str]:
        assert host == "engines.test"
        if self.fail:
            raise socket.gaierror(socket.EAI_AGAIN, "temporary failure")
        return list(self.records)


def test_the_pool_follows_the_name() -> None:
    port = closed_port()
    static = f"127.0.0.9:{closed_port()}"

    async def run() -> None:
        dns = FakeDns(["127.0.0.1", "127.0.0.2"])
        pool = EnginePool([f"dns:///engines.test:{port}", static], resolve=dns, resolve_interval=0.01)
        assert [r.address for r in pool.replicas] == [static]
        await pool.refresh()
        addresses = lambda: sorted(r.address for r in pool.replicas)  # noqa: E731
        assert addresses() == sorted([static, f"127.0.0.1:{port}", f"127.0.0.2:{port}"])

        dns.records = ["127.0.0.2", "127.0.0.3"]
        first = next(r for r in pool.replicas if r.address == f"127.0.0.1:{port}")
        first.healthy, first.model_info, first.in_flight = True, engine_pb2.EngineModelInfo(model="m"), 1
        await pool.refresh()
        assert addresses() == sorted([static, f"127.0.0.1:{port}", f"127.0.0.2:{port}", f"127.0.0.3:{port}"])
        assert first.draining and not first.routable  # no new requests, its in-flight one continues
        await asyncio.sleep(0.02)
        await pool.probe()
        assert first in pool.replicas  # still one in flight
        first.in_flight = 0
        await asyncio.sleep(0.02)
        await pool.probe()
        assert first not in pool.replicas  # idle: closed and gone
        assert f"127.0.0.1:{port}" not in addresses()

        dns.fail = True  # a failed lookup keeps the last answer
        await pool.refresh()
        assert addresses() == sorted([static, f"127.0.0.2:{port}", f"127.0.0.3:{port}"])
        assert not any(r.draining for r in pool.replicas)

        dns.fail, dns.records = False, []  # the name empties: its engines drain, the static one stays
        await pool.refresh()
        assert {r.address for r in pool.replicas if not r.draining} == {static}
        await pool.close()

    asyncio.run(run())


def test_a_returning_address_stops_draining() -> None:
    port = closed_port()

    async def run() -> None:
        dns = FakeDns(["127.0.0.1"])
        pool = EnginePool([f"dns:///engines.test:{port}"], resolve=dns)
        await pool.refresh()
        dns.records = []
        await pool.refresh()
        (replica,) = pool.replicas
        assert replica.draining
        dns.records = ["127.0.0.1"]
        await pool.refresh()
        assert pool.replicas == [replica] and not replica.draining
        await pool.close()

    asyncio.run(run())


def test_a_replica_closed_under_a_stats_round_answers_unavailable() -> None:
    """A replica the pool drops (and closes) while a caller still holds it from its list: its
    Utility call is UNAVAILABLE naming it, which STATS and GetLoads report per replica, not
    grpc's UsageError, which ended a whole STATS call with UNKNOWN (seen in CI)."""

    async def run() -> None:
        pool = EnginePool([f"127.0.0.1:{closed_port()}"])
        replica = pool.replicas[0]
        await replica.channel.close()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await replica.utility(common_pb2.UTILITY_COMMAND_STATS)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and replica.address in err.value.details()
        await pool.close()

    asyncio.run(run())
