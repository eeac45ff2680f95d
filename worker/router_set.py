"""A worker's membership in every router of its cluster: ``--router`` names one or more routers (a comma
list; a name that resolves to several addresses, a Kubernetes headless Service, is one router per address,
re-resolved every ``resolve_interval_s``), and ``RouterSet`` keeps one ``RouterAgent`` per router, each
with its own view of the prefix cache's events. Routers never talk to each other: the worker is the one
source of its own state (serving, standby, draining) and tells each of them."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import threading
from collections.abc import Awaitable, Callable

import grpc

from pdserve.engine.prefix_hash import BlockHash, KVEvent
from pdserve.proto import worker_pb2
from pdserve.worker.agent import AgentConfig, RegistrationError, RouterAgent
from pdserve.worker.kv_events import EventSource, KvEventPublisher

log = logging.getLogger(__name__)

RESOLVE_INTERVAL_S = 10.0  # how often router names are looked up again (routers added or gone)
# Events one router's view holds before it gives them up for a snapshot (a router that stopped answering).
_VIEW_LIMIT = 1 << 16


def split_routers(spec: str) -> list[str]:
    """The ``host:port`` entries of a ``--router`` value (a comma list), each checked."""
    entries = [e.strip() for e in spec.split(",") if e.strip()]
    if not entries:
        raise ValueError("router must name at least one router, host:port")
    for e in entries:
        host, sep, port = e.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"router entry {e!r} is not host:port")
    return entries


def resolve_routers(spec: str) -> dict[str, str]:
    """Every router ``spec`` names now: address -> the host it was named by (for TLS, whose certificate
    names the host, not its addresses). A name that resolves to one address stays as given; one that
    resolves to several is one router per address (IPv4 where it has any: ``localhost`` is one router,
    not two). A name that does not resolve (yet) stays as given: the agent retries it."""
    out: dict[str, str] = {}
    for entry in split_routers(spec):
        host, _, port = entry.rpartition(":")
        name = host.strip("[]")
        try:
            infos = socket.getaddrinfo(name, int(port), type=socket.SOCK_STREAM)
        except OSError:
            out[entry] = name
            continue
        by_family: dict[int, list[str]] = {}
        for family, _, _, _, sockaddr in infos:
            ip = str(sockaddr[0])
            if ip not in by_family.setdefault(family, []):
                by_family[family].append(ip)
        ips = by_family.get(socket.AF_INET) or by_family.get(socket.AF_INET6) or []
        if len(ips) <= 1:
            out[entry] = name
            continue
        for ip in sorted(ips):
            out[f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"] = name
    return out


class EventFanout:
    """One prefix cache's events, read once from the block manager and handed to each router's view:
    every router's KV index gets every event, whichever router asks first."""

    def __init__(self, source: EventSource, limit: int = _VIEW_LIMIT) -> None:
        self._source = source
        self._limit = limit
        self._views: list[_EventView] = []
        self._lock = threading.Lock()

    def view(self) -> _EventView:
        v = _EventView(self)
        with self._lock:
            self._views.append(v)
        return v

    def close(self, view: _EventView) -> None:
        with self._lock:
            if view in self._views:
                self._views.remove(view)

    def _pull(self) -> None:
        with self._lock:
            events, overflowed = self._source.drain_events()
            for v in self._views:
                v._add(events, overflowed, self._limit)


class _EventView:
    """One router's share of an ``EventFanout`` (an ``EventSource`` for its ``KvEventPublisher``)."""

    def __init__(self, fanout: EventFanout) -> None:
        self._fanout = fanout
        self._events: list[KVEvent] = []
        self._overflowed = False

    def _add(self, events: list[KVEvent], overflowed: bool, limit: int) -> None:
        self._events.extend(events)
        if overflowed or len(self._events) > limit:
            self._events, self._overflowed = [], True  # a snapshot replaces them

    def drain_events(self) -> tuple[list[KVEvent], bool]:
        self._fanout._pull()
        with self._fanout._lock:
            out, overflowed = self._events, self._overflowed
            self._events, self._overflowed = [], False
        return out, overflowed

    def has_events(self) -> bool:
        return bool(self._events) or self._fanout._source.has_events()

    def cached_hashes(self) -> list[tuple[BlockHash, BlockHash | None]]:
        return self._fanout._source.cached_hashes()


@dataclasses.dataclass(frozen=True)
class RouterSetConfig:
    routers: str  # the --router value: host:port[,host:port...]
    agent: AgentConfig  # each router's agent (its router_address is filled in per router)
    resolve_interval_s: float = RESOLVE_INTERVAL_S

    def __post_init__(self) -> None:
        split_routers(self.routers)
        if self.resolve_interval_s <= 0:
            raise ValueError("resolve_interval_s must be > 0")


class RouterSet:
    """Registers with every router and keeps doing so as routers come and go. ``register`` returns once
    one router knows the worker (the others join in the background); the worker counts as known
    (readiness) while any router knows it; a drain asked by any router drains it."""

    def __init__(
        self,
        config: RouterSetConfig,
        info: worker_pb2.WorkerInfo,
        load: Callable[[], worker_pb2.WorkerLoad],
        on_drain: Callable[[], object],
        events: EventSource | None = None,
    ) -> None:
        self.config = config
        self.info = info  # shared by every agent: a promotion one router makes, all the others hear
        self._load = load
        self._on_drain = on_drain
        self._fanout = EventFanout(events) if events is not None else None
        self.agents: dict[str, RouterAgent] = {}
        self._joins: dict[str, asyncio.Task[None]] = {}
        self._views: dict[str, _EventView] = {}
        self._known: dict[str, bool] = {}
        self._joined = asyncio.Event()
        self._failures: dict[str, BaseException] = {}
        self._resolver: asyncio.Task[None] | None = None
        self._leaving: set[asyncio.Task[None]] = set()
        self.on_known: Callable[[bool], Awaitable[None]] | None = None
        self._was_known = False

    @property
    def drain_requested(self) -> bool:
        return any(a.drain_requested for a in self.agents.values())

    def known_by(self) -> list[str]:
        """The routers that know this worker now."""
        return [a for a, known in self._known.items() if known]

    async def register(self) -> None:
        """Start joining every router; return once one knows this worker. Raises RegistrationError when
        every router refused it or none answered within the agent's register timeout."""
        self._update(resolve_routers(self.config.routers))
        while not self._joined.is_set():
            pending = [t for t in self._joins.values() if not t.done()]
            if not pending:
                first = next(iter(self._failures.values()), None)
                raise RegistrationError(f"no router took worker {self.info.worker_id}: {first}") from first
            waiter = asyncio.ensure_future(self._joined.wait())
            try:
                await asyncio.wait([waiter, *pending], return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()

    def start(self) -> None:
        """Look the routers up again every ``resolve_interval_s`` until ``close``."""
        if self._resolver is None:
            self._resolver = asyncio.get_running_loop().create_task(self._resolve_forever())

    async def close(self, deregister: bool = True) -> None:
        if self._resolver is not None:
            self._resolver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._resolver
            self._resolver = None
        await asyncio.gather(*(self._leave(a, deregister) for a in list(self.agents)))

    def _update(self, addresses: dict[str, str]) -> None:
        """Join routers new to ``addresses`` (and those whose joining failed: they may take it now); leave
        those no longer in it."""
        for address, host in addresses.items():
            if address not in self.agents or address in self._failures:
                self._join(address, host)
        for address in [a for a in self.agents if a not in addresses]:
            log.info("router %s no longer resolves from %s: leaving it", address, self.config.routers)
            task = asyncio.get_running_loop().create_task(self._leave(address, deregister=False))
            self._leaving.add(task)
            task.add_done_callback(self._leaving.discard)

    def _join(self, address: str, host: str) -> None:
        old = self.agents.get(address)
        if old is not None:  # (its joining failed: a fresh agent tries again)
            self._drop_view(address)
            task = asyncio.get_running_loop().create_task(old.close(deregister=False))
            self._leaving.add(task)
            task.add_done_callback(self._leaving.discard)
        cfg = dataclasses.replace(self.config.agent, router_address=address)
        if host and not address.startswith(host):
            cfg = dataclasses.replace(cfg, tls_target_name=host)
        agent = RouterAgent(cfg, self.info, self._load, self._on_drain)
        if self._fanout is not None:
            view = self._views[address] = self._fanout.view()
            agent.kv_events = KvEventPublisher(view)
        agent.on_known = lambda known, a=address: self._known_now(a, known)
        self.agents[address] = agent
        self._failures.pop(address, None)
        self._joins[address] = asyncio.get_running_loop().create_task(self._join_then_beat(address, agent))

    async def _join_then_beat(self, address: str, agent: RouterAgent) -> None:
        try:
            await agent.register()
        except RegistrationError as e:
            log.error("router %s: %s", address, e)
            self._failures[address] = e
            return
        except grpc.aio.AioRpcError as e:  # (a call that failed in a way register does not retry)
            log.error("router %s refused worker %s: %s", address, self.info.worker_id, e.code().name)
            self._failures[address] = e
            return
        log.info("worker %s registered with router %s", self.info.worker_id, address)
        await self._known_now(address, True)
        self._joined.set()
        agent.start()

    async def _leave(self, address: str, deregister: bool) -> None:
        agent = self.agents.pop(address, None)
        join = self._joins.pop(address, None)
        if join is not None and not join.done():
            join.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await join
        self._drop_view(address)
        if agent is not None:
            await agent.close(deregister=deregister)
        await self._known_now(address, False, forget=True)

    def _drop_view(self, address: str) -> None:
        view = self._views.pop(address, None)
        if view is not None and self._fanout is not None:
            self._fanout.close(view)

    async def _known_now(self, address: str, known: bool, forget: bool = False) -> None:
        if forget:
            self._known.pop(address, None)
        else:
            self._known[address] = known
        now = any(self._known.values())
        if now is not self._was_known:
            self._was_known = now
            if self.on_known is not None:
                await self.on_known(now)

    async def _resolve_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.resolve_interval_s)
            try:
                addresses = await asyncio.to_thread(resolve_routers, self.config.routers)
            except Exception:  # noqa: BLE001 - a failed lookup keeps the routers it has
                log.exception("looking up the routers (%s) failed", self.config.routers)
                continue
            if addresses:
                self._update(addresses)
