"""`Discovery`: the attention replicas behind each configured HOST:PORT, found by DNS and kept current.

A literal IP (`10.0.0.5:50052`, `[fd00::5]:50052`) is one replica, as configured. A name
(`attention:50052`, e.g. a Kubernetes headless Service) is resolved to all its A/AAAA records, one
replica per address; when a name has IPv4 records only those are used (services bind 0.0.0.0, and a
dual-stack pod would otherwise count twice), else its IPv6 ones. A name that fails to resolve keeps
the addresses it had, so a DNS hiccup never empties the router; replicas that are really gone fail
their load polls and get no new sequences.

The resolver is injectable: `resolver(host, port) -> [ip, ...]` (awaitable).
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]


async def dns_resolve(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (A and AAAA), in the resolver's order."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [info[4][0] for info in infos]


@dataclass(frozen=True)
class Target:
    """One configured HOST:PORT."""

    host: str
    port: int

    @property
    def literal(self) -> bool:
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            return False
        return True

    def __str__(self) -> str:
        return join_address(self.host, self.port)


def parse_target(text: str) -> Target:
    """`host:port` or `[v6]:port` -> Target; ValueError naming `attention` otherwise."""
    host, sep, port = text.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"attention: {text!r} is not HOST:PORT")
    return Target(host, int(port))


def join_address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def preferred(ips: list[str]) -> list[str]:
    """Distinct addresses in order: the IPv4 ones when there are any, else the IPv6 ones."""
    seen = list(dict.fromkeys(ips))
    v4 = [ip for ip in seen if ":" not in ip]
    return v4 or seen


class Discovery:
    def __init__(self, targets: list[str], resolver: Resolver = dns_resolve) -> None:
        if not targets:
            raise ValueError("attention: at least one attention replica address is required (--attention HOST:PORT,...)")
        self.targets = [parse_target(t) for t in targets]
        self.resolver = resolver
        self._known: dict[Target, list[str]] = {}  # a name's addresses at its last successful resolution

    @property
    def has_names(self) -> bool:
        """Whether any target is a name (only those change over time)."""
        return any(not t.literal for t in self.targets)

    async def addresses(self) -> list[str]:
        """The replica addresses of every target now, in target order, without duplicates."""
        out: dict[str, None] = {}
        for target in self.targets:
            for address in await self._expand(target):
                out.setdefault(address)
        return list(out)

    async def _expand(self, target: Target) -> list[str]:
        if target.literal:
            return [str(target)]
        try:
            ips = preferred(await self.resolver(target.host, target.port))
        except (OSError, UnicodeError) as exc:  # socket.gaierror is an OSError
            log.warning("attention: cannot resolve %s (%s); keeping %s", target, exc, self._known.get(target, []))
            return self._known.get(target, [])
        if not ips:
            return self._known.get(target, [])
        self._known[target] = [join_address(ip, target.port) for ip in ips]
        return self._known[target]

    async def wait_for_addresses(self, timeout_s: float, retry_s: float = 1.0) -> list[str]:
        """The first non-empty answer; ValueError naming `attention` after `timeout_s` without one."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = await self.addresses()
            if found:
                return found
            if time.monotonic() >= deadline:
                names = ", ".join(str(t) for t in self.targets)
                raise ValueError(f"attention: no address found for {names} within {timeout_s:g} s")
            await asyncio.sleep(min(retry_s, max(0.0, deadline - time.monotonic())))

    async def refresh(self, replicas, make_client: Callable[[str], object], poll_timeout: float) -> None:
        """Re-resolve; new addresses join `replicas` (available after their first load report),
        vanished ones are retired (drained: their in-flight sequences finish)."""
        added, retired = replicas.reconcile(await self.addresses(), make_client)
        for r in added:
            log.info("attention replica %s discovered", r.address)
        for r in retired:
            log.info("attention replica %s gone from DNS: draining (%d in flight)", r.address, r.inflight)
        if added:
            await replicas.refresh(poll_timeout, added)
        await replicas.sweep()

    async def run_forever(self, replicas, make_client: Callable[[str], object], interval_s: float, poll_timeout: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.refresh(replicas, make_client, poll_timeout)
            except Exception:  # keep discovering; the next round may succeed
                log.exception("attention replica discovery failed")
