"""Session affinity over worker replicas: consistent hashing, static or DNS discovery.

Each session is routed to one draft replica and one target replica (independent rings), so its KV
cache is reused round after round. Adding or removing a replica moves only the sessions whose
ring segment changed (about 1/N of them); a moved session's new replica answers NOT_FOUND and the
orchestrator re-prefills it from the canonical tokens. A replica whose calls keep failing UNAVAILABLE
is passed over (its sessions go to the next replica on the ring) for a cool-down, also with a static
list, where no discovery would ever drop it.

Over 300 lines: the ring, the pass-over rule, discovery and the routed backends are one policy
(which replica a session's call goes to), each small and used only through ReplicaPool.
"""
from __future__ import annotations

import asyncio
import bisect
import hashlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from specdec.errors import DeadlineExceeded, WorkerUnavailable

log = logging.getLogger(__name__)
B = TypeVar("B")
R = TypeVar("R")
V = TypeVar("V")
MAX_REPLICA_ENTRIES = 1024  # per-replica state is bounded: replicas come and go with scaling


def bounded_entry(entries: dict[str, V], key: str, make: Callable[[], V]) -> V:
    """entries[key] of a map keyed by replica (or replica pair), created on first use; the least
    recently used entry goes when the map holds MAX_REPLICA_ENTRIES (the oldest one went: a pair in
    use on every request lost its guard and prior once per 1,024 new pairs)."""
    value = entries.pop(key, None)
    if value is None:
        if len(entries) >= MAX_REPLICA_ENTRIES:
            entries.pop(next(iter(entries)))
        value = make()
    entries[key] = value  # (re)inserted last: dicts keep insertion order
    return value


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

    def node_for(self, key: str, passed_over: Callable[[str], bool] = lambda node: False) -> str:
        """The key's node: the owner of the next point on the ring, or the first one after it that is
        not passed over (the owner itself if all are)."""
        if not self._points:
            raise WorkerUnavailable("no worker replicas discovered")
        start = bisect.bisect(self._points, _point(key))
        for step in range(len(self._points)):
            node = self._owners[(start + step) % len(self._points)]
            if not passed_over(node):
                return node
        return self._owners[start % len(self._points)]


@dataclass
class _FailingReplica:
    """A replica whose calls fail: since when (this streak), the latest failure, and its pass-over."""
    since: float
    last: float
    cooldown: float = 0.0  # length of its latest pass-over in this streak (0: none yet)
    until: float = 0.0     # passed over until then


class ReplicaEjection:
    """Which replicas to pass over (pure): one whose calls have failed UNAVAILABLE for EJECT_AFTER_S
    with no success between is passed over for a cool-down, doubled each time it fails again after
    coming back (up to MAX_COOLDOWN_S); one success clears it. Measured in time, not in failed calls:
    the calls of every session in flight at a blip fail together, and a blip should not move them."""

    EJECT_AFTER_S = 1.0
    COOLDOWN_S = 5.0
    MAX_COOLDOWN_S = 60.0
    STREAK_GAP_S = 10.0  # failures further apart than this (no calls between) are separate blips

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._failing: dict[str, _FailingReplica] = {}

    def failed(self, node: str, lasted_s: float = 0.0) -> None:
        """lasted_s: how long the failed call had been failing before it ended (a hung call that timed
        out failed all along: hung calls of a quiet replica end minutes apart, each a new streak, and
        the replica was never passed over)."""
        now = self._clock()
        state = self._failing.get(node)
        # A new blip where this failure began well after the last one ended: a hung call began
        # before it (lasted_s), so consecutive hung calls are one streak and its pass-over doubles.
        if state is None or (now - lasted_s) - max(state.last, state.until) > self.STREAK_GAP_S:
            state = self._failing[node] = _FailingReplica(since=now, last=now)
        state.since = min(state.since, now - lasted_s)
        state.last = now
        if now - state.since >= self.EJECT_AFTER_S and not self.passed_over(node):
            state.cooldown = min(self.MAX_COOLDOWN_S, 2 * state.cooldown if state.cooldown else self.COOLDOWN_S)
            state.until = now + state.cooldown
            log.warning("replica %s has failed for %.1f s: its sessions go to other replicas for %.0f s",
                        node, now - state.since, state.cooldown)

    def succeeded(self, node: str) -> None:
        self._failing.pop(node, None)

    def passed_over(self, node: str) -> bool:
        state = self._failing.get(node)
        return state is not None and self._clock() < state.until

    def forget(self, node: str) -> None:
        """The replica left discovery."""
        self._failing.pop(node, None)


def parse_targets(spec: str) -> tuple[list[str], str | None]:
    """'h1:p1,h2:p2' -> static list; 'dns:///name:port' -> (empty list, 'name:port') for discovery."""
    spec = spec.strip()  # a ConfigMap or env value often ends in a newline
    if spec.startswith("dns:///"):
        name_port = spec[len("dns:///"):]
        if _host_of(name_port) is None:
            raise ValueError(f"{spec!r}: discovery needs dns:///NAME:PORT")
        return [], name_port
    addresses = [s.strip() for s in spec.split(",") if s.strip()]
    if not addresses:
        raise ValueError(f"{spec!r}: no worker address (HOST:PORT[,HOST:PORT...] or dns:///NAME:PORT)")
    for address in addresses:
        # Refused here, not after --connect-timeout-s of failing to connect to a typo.
        host = _host_of(address)
        if host is None or (":" in host and not (host.startswith("[") and host.endswith("]"))):
            raise ValueError(f"{address!r} in {spec!r}: a worker address is HOST:PORT with a port in 1..65535 "
                             "(an IPv6 host in brackets: [::1]:50051)")
    return addresses, None


def _host_of(host_port: str) -> str | None:
    """The host of 'HOST:PORT', None where either part is missing or the port is not in 1..65535."""
    host, _, port = host_port.rpartition(":")
    return host if host and port.isdigit() and 0 < int(port) < 65536 else None


async def resolve(name_port: str) -> list[str]:
    from specdec.grpc_util import bare_host
    host, _, port = name_port.rpartition(":")
    infos = await asyncio.get_running_loop().getaddrinfo(bare_host(host), int(port), type=socket.SOCK_STREAM)
    addresses = set()
    for family, _, _, _, sockaddr in infos:
        ip = sockaddr[0]
        addresses.add(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return sorted(addresses)


# A replica that leaves the ring (scale-in, rollout) keeps its channel open this long for the calls
# still in flight on it: closed at once, grpc.aio cancelled them and the requests failed, where a
# finished call (or the worker's own drain answering UNAVAILABLE) costs at most a re-prefill.
REMOVED_REPLICA_GRACE_S = 600.0


async def _close(backend: Any, grace_s: float | None = None) -> None:
    closer = getattr(backend, "close", None)
    if closer is not None:
        await closer(grace_s)


class ReplicaPool(Generic[B]):
    """Backends for one role, one per discovered replica, chosen per session by the ring."""

    def __init__(self, role: str, spec: str, make_backend: Callable[[str], B], refresh_s: float = 5.0) -> None:
        self.role = role
        self.spec = spec
        self._make = make_backend
        self.refresh_s = refresh_s
        static, self.dns_name = parse_targets(spec)
        self.ring = HashRing()
        self.ejection = ReplicaEjection()
        self.backends: dict[str, B] = {}
        self._task: asyncio.Task[None] | None = None
        self._closing: dict[asyncio.Task[None], B] = {}  # removed replicas, their channels closing gracefully
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
            self.ejection.forget(address)
            backend = self.backends.pop(address)
            task = asyncio.get_running_loop().create_task(_close(backend, REMOVED_REPLICA_GRACE_S))
            self._closing[task] = backend  # held until done: a task only the loop references can be collected
            task.add_done_callback(lambda done: self._closing.pop(done, None))
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

    def node_for(self, session_id: str) -> str:
        return self.ring.node_for(session_id, self.ejection.passed_over)

    def in_use(self) -> set[str]:
        """The replicas sessions are routed to: all but those passed over for failing, or all of them
        where every one is passed over (node_for then keeps each session on its owner)."""
        return {node for node in self.ring.nodes if not self.ejection.passed_over(node)} or set(self.ring.nodes)

    async def call(self, node: str, run: Callable[[B], Awaitable[R]]) -> R:
        """run(the node's backend), with its outcome told to the ejection rule."""
        backend = self.backends.get(node)
        if backend is None:  # it left the ring since the caller chose it (first_answer awaits between nodes)
            raise WorkerUnavailable(f"{self.role} replica {node} is no longer discovered")
        try:
            result = await run(backend)
        except WorkerUnavailable:
            if node in self.backends:  # one that left the ring meanwhile is forgotten, not passed over
                self.ejection.failed(node)
            raise
        self.ejection.succeeded(node)
        return result

    async def first_answer(self, run: Callable[[B], Awaitable[R]]) -> R:
        """run() on each replica in turn (those not passed over first) until one answers: startup
        and GetInfo must not depend on one replica, the first of a static list, being up."""
        if not self.backends:
            raise WorkerUnavailable(f"no {self.role} replicas discovered from {self.spec}")
        error: Exception | None = None
        for node in sorted(self.ring.nodes, key=self.ejection.passed_over):
            try:
                return await self.call(node, run)
            except (WorkerUnavailable, DeadlineExceeded) as exc:
                error = exc
        assert error is not None
        raise error

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        closing = list(self._closing.items())
        for task, _ in closing:  # shutting down: no more grace for removed replicas' calls
            task.cancel()
        for backend in [b for _, b in closing] + list(self.backends.values()):
            await _close(backend)


class _Routed:
    """Forwards each call to the session's replica in a pool (shared by both roles)."""

    def __init__(self, pool: ReplicaPool[Any]) -> None:
        self.pool = pool

    def node_for(self, session_id: str) -> str:
        return self.pool.node_for(session_id)

    async def _call(self, session_id: str, method: str, *args: Any, **kwargs: Any) -> Any:
        return await self.pool.call(self.pool.node_for(session_id),
                                    lambda backend: getattr(backend, method)(session_id, *args, **kwargs))

    async def end_session(self, session_id: str) -> bool:
        return await self._call(session_id, "end_session")

    def call_timed_out(self, node: str, after_s: float) -> None:
        """A call on this replica (taken before the call: by its end the session may map elsewhere)
        ran past the orchestrator's own timeout (after_s), not the client's deadline: a replica that
        hangs is failing too, for that long, and its sessions go elsewhere as for one that is down."""
        self.pool.ejection.failed(node, lasted_s=after_s)

    async def describe(self, timeout_s: float | None = None) -> Any:
        return await self.pool.first_answer(lambda backend: backend.describe(timeout_s))

    async def close(self) -> None:
        await self.pool.close()


class RoutedDraft(_Routed):
    """DraftBackend over a pool of draft replicas."""

    async def propose(self, session_id: str, *args: Any, **kwargs: Any) -> Any:
        return await self._call(session_id, "propose", *args, **kwargs)


class RoutedTarget(_Routed):
    """TargetBackend over a pool of target replicas."""

    async def verify(self, session_id: str, *args: Any, **kwargs: Any) -> Any:
        return await self._call(session_id, "verify", *args, **kwargs)
