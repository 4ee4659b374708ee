"""Engine addresses given as DNS names (`dns:///name:port`), resolved into one address per record.

A `--engine` value is either an address (`host:port`, one engine) or `dns:///name:port`: every
A/AAAA record of `name` is one engine on `port` (a Kubernetes headless Service lists its ready
pods this way). `EnginePool` resolves the names again every `--engine-resolve-interval` seconds
(`resolve_name` by default, or the resolver it is given).

`$TANDEM_HOSTS_FILE` names an /etc/hosts-style file (`address name [alias ...]` per line, `#`
comments) consulted before DNS and read at every lookup: a name it lists resolves to exactly its
lines' addresses there. It pins names without a resolver (tests, a static cluster).
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

DNS_SCHEME = "dns:///"
HOSTS_FILE_ENV = "TANDEM_HOSTS_FILE"

# (name, port) -> the addresses (IP literals) the name has now; raises OSError when the lookup fails.
Resolver = Callable[[str, int], Awaitable[list[str]]]


@dataclass(frozen=True)
class EngineName:
    """A `dns:///host:port` target."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{DNS_SCHEME}{self.host}:{self.port}"


def parse_engine_name(target: str) -> EngineName | None:
    """The name of a `dns:///host:port` target; None for a plain address. Raises ValueError for
    a `dns:///` target without a port."""
    if not target.startswith(DNS_SCHEME):
        return None
    host, sep, port = target[len(DNS_SCHEME):].rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"expected dns:///NAME:PORT, got {target!r}")
    return EngineName(host.strip("[]"), int(port))


def engine_address(ip: str, port: int) -> str:
    """`ip:port`, an IPv6 literal in brackets (the form gRPC targets and `--engine` use)."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def hosts_file_addresses(path: str, name: str) -> list[str] | None:
    """The addresses `path` (/etc/hosts format) lists for `name`, in file order; None when it
    does not list the name (DNS answers then)."""
    found: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            fields = line.split("#", 1)[0].split()
            if len(fields) >= 2 and name.lower() in (n.lower() for n in fields[1:]):
                ipaddress.ip_address(fields[0])  # a malformed line is an error, not a silent skip
                if fields[0] not in found:
                    found.append(fields[0])
    return found or None


async def resolve_name(host: str, port: int) -> list[str]:
    """Every address `host` has now: from `$TANDEM_HOSTS_FILE` when that lists it, else the
    system resolver's A and AAAA records (each address once, in the resolver's order)."""
    path = os.environ.get(HOSTS_FILE_ENV)
    if path:
        pinned = hosts_file_addresses(path, host)
        if pinned is not None:
            return pinned
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses: list[str] = []
    for _family, _type, _proto, _canon, sockaddr in infos:
        if sockaddr[0] not in addresses:
            addresses.append(sockaddr[0])
    return addresses
