"""Session affinity over worker replicas: consistent hashing, static or DNS discovery.

Each session is routed to one draft replica and one target replica (independent rings), so its KV
cache is reused round after round. Adding or removing a replica moves only the sessions whose
ring segment changed (about 1/N of them); a moved session's new replica answers NOT_FOUND and the
orchestrator re-prefills it from the canonical tokens.
"""
from __future__ import annotations

import asyncio
import bisect
import hashlib
import logging
import socket
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from specdec.errors import WorkerUnavailable

log = logging.getLogger(__name__)
B = TypeVar("B")


def _point(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class HashRing:
    """Consistent hash ring with virtual nodes (pure)."""

    def __init__(self, nodes: Sequence[str] = (), vnodes: int = 160) -> None:
        self.vnodes = vnodes
        self._points: list[int] = []
        self._owners: list[str] = []
        self.nodes: tuple[str, ...] = ()
        self.set_nodes(nodes)

    def set_nodes(self, nodes: Sequence[str]) -> None:
        ring = sorted((_point(f"{node}#{i}"), node) for node in set(nodes) for i in range(self.vnodes))
        self._points = [p for p, _ in ring]
        self._owners = [n for _, n in ring]
        self.nodes = tuple(sorted(set(nodes)))

    def node_for(self, key: str) -> str:
        if not self._points:
            raise WorkerUnavailable("no worker replicas discovered")
        i = bisect.bisect(self._points, _point(key)) % len(self._points)
        return self._owners[i]


def parse_targets(spec: str) -> tuple[list[str], str | None]:
    """'h1:p1,h2:p2' -> static list; 'dns:///name:port' -> (empty list, 'name:port') for discovery."""
    if spec.startswith("dns:///"):
        return [], spec[len("dns:///"):]
    return [s.strip() for s in spec.split(",") if s.strip()], None


async def resolve(name_port: str) -> list[str]:
    host, _, port = name_port.rpartition(":")
    infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    addresses = set()
    for family, _, _, _, sockaddr in infos:
        ip = sockaddr[0]
        addresses.add(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return sorted(addresses)


async def _close(backend: Any) -> None:
    closer = getattr(backend, "close", None)
    if closer is not None:
        await closer()


class ReplicaPool(Generic[B]):
    """Backends for one role, one per discovered replica, chosen per session by the ring."""

    def __init__(self, role: str, spec: str, make_backend: Callable[[str], B], refresh_s: float = 5.0) -> None:
        self.role = role
        self.spec = spec
        self._make = make_backend
        self.refresh_s = refresh_s
        static, self.dns_name = parse_targets(spec)
        self.ring = HashRing()
        self.backends: dict[str, B] = {}
        self._task: asyncio.Task[None] | None = None
        if static:
            self.set_addresses(static)

    def set_addresses(self, addresses: Sequence[str]) -> None:
        addresses = sorted(set(addresses))
        if tuple(addresses) == self.ring.nodes:
            return
        for address in addresses:
            if address not in self.backends:
                self.backends[address] = self._make(address)
        removed = [a for a in self.backends if a not in addresses]
        for address in removed:
            asyncio.get_running_loop().create_task(_close(self.backends.pop(address)))
        log.info("%s replicas: %s", self.role, ", ".join(addresses) or "none")
        self.ring.set_nodes(addresses)

    async def refresh(self) -> None:
        if self.dns_name is None:
            return
        try:
            addresses = await resolve(self.dns_name)
        except OSError as exc:
            log.warning("resolving %s failed: %s (keeping %d replicas)", self.dns_name, exc, len(self.backends))
            return
        if addresses:
            self.set_addresses(addresses)

    async def start(self) -> None:
        await self.refresh()
        if self.dns_name is not None:
            self._task = asyncio.get_running_loop().create_task(self._refresh_loop())

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()

    def backend_for(self, session_id: str) -> B:
        return self.backends[self.ring.node_for(session_id)]

    def any_backend(self) -> B:
        if not self.backends:
            raise WorkerUnavailable(f"no {self.role} replicas discovered from {self.spec}")
        return self.backends[self.ring.nodes[0]]

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for backend in self.backends.values():
            await _close(backend)


class _Routed:
    """Forwards each call to the session's replica in a pool (shared by both roles)."""

    def __init__(self, pool: ReplicaPool[Any]) -> None:
        self.pool = pool

    def node_for(self, session_id: str) -> str:
        return self.pool.ring.node_for(session_id)

    async def end_session(self, session_id: str) -> bool:
        return await self.pool.backend_for(session_id).end_session(session_id)

    async def describe(self, timeout_s: float | None = None) -> Any:
        return await self.pool.any_backend().describe(timeout_s)

    async def close(self) -> None:
        await self.pool.close()


class RoutedDraft(_Routed):
    """DraftBackend over a pool of draft replicas."""

    async def propose(self, session_id: str, *args: Any, **kwargs: Any) -> Any:
        return await self.pool.backend_for(session_id).propose(session_id, *args, **kwargs)


class RoutedTarget(_Routed):
    """TargetBackend over a pool of target replicas."""

    async def verify(self, session_id: str, *args: Any, **kwargs: Any) -> Any:
        return await self.pool.backend_for(session_id).verify(session_id, *args, **kwargs)
