"""The worker side of the control plane: register with the router, heartbeat, obey drain
(``RouterAgent``), and ``run_worker``, which joins a serving shell to the cluster until it has drained."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.worker.auth import token_metadata
from pdserve.worker.kv_events import KvEventPublisher
from pdserve.worker.shell import WorkerShell
from pdserve.worker.tls import NO_TLS, TLSConfig, aio_channel

log = logging.getLogger(__name__)

# gRPC's default reconnect backoff starts at 1 s: a worker started together with the router
# would idle that long after the router came up. Retry the connection sooner.
_CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


@dataclass(frozen=True)
class AgentConfig:
    router_address: str
    # Registration retries for this long (the router may still be starting), then fails.
    register_timeout_s: float = 60.0
    retry_interval_s: float = 0.2
    rpc_timeout_s: float = 2.0
    cluster_token: str = field(default="", repr=False)  # presented on every call (``worker.auth``)
    tls: TLSConfig = (
        NO_TLS  # the router's gRPC over TLS, this worker's certificate presented (``worker.tls``)
    )
    # The name the router's TLS certificate carries when ``router_address`` is one of the addresses a
    # name resolved to (``worker.router_set``); "": the address's own host.
    tls_target_name: str = ""

    def __post_init__(self) -> None:
        if not self.router_address:
            raise ValueError("router_address must not be empty")
        if self.register_timeout_s <= 0 or self.retry_interval_s <= 0 or self.rpc_timeout_s <= 0:
            raise ValueError("register_timeout_s, retry_interval_s and rpc_timeout_s must be > 0")


# A heartbeat goes this soon after the last while the prefix cache has events to publish (not later than
# the interval): the routers' KV index lags a worker's cache by about this much.
EVENTS_BEAT_S = 0.05
LEAVING_BEAT_S = 2.0  # how often a router that said it is shutting down is beaten (to see it gone)
_FAILED_BEATS = 3  # heartbeats failing in a row before the worker counts itself unknown to the router


class RegistrationError(RuntimeError):
    pass


class RouterLink(Protocol):
    """How a worker joins its cluster: one router (``RouterAgent``) or all of them (``RouterSet``)."""

    on_known: Callable[[bool], Awaitable[None]] | None

    async def register(self) -> None: ...

    def start(self) -> None: ...

    async def close(self, deregister: bool = True) -> None: ...


class RouterAgent:
    """Registers, then heartbeats with a load snapshot at the interval the router asked for: registers
    again when the router no longer knows the worker, calls ``on_drain`` once when it asks for a drain,
    and keeps beating while it is unreachable (it may be restarting); ``close`` deregisters."""

    def __init__(
        self,
        config: AgentConfig,
        info: worker_pb2.WorkerInfo,
        load: Callable[[], worker_pb2.WorkerLoad],
        on_drain: Callable[[], object],
    ) -> None:
        """``load`` returns the worker's current load (worker_id is filled in here); ``on_drain``
        may return an awaitable."""
        self.config = config
        self.info = info
        self._load = load
        self._on_drain = on_drain
        self.interval_s = 0.5
        self.drain_requested = False
        self.leaving = False  # the router said it is shutting down: it is beaten only now and then
        self.registrations = 0
        self._channel: grpc.aio.Channel | None = None
        self._stub: worker_pb2_grpc.RegistryStub | None = None
        self._task: asyncio.Task | None = None
        self._meta = token_metadata(config.cluster_token)
        # ``on_known(known)``: whether the router knows this worker changed (it stopped answering
        # ``_FAILED_BEATS`` beats in a row, or forgot it; or it answers again after registering again).
        self.on_known: Callable[[bool], Awaitable[None]] | None = None
        self._known = True
        # This worker's prefix-cache changes ride on each heartbeat (None: it has no prefix cache).
        self.kv_events: KvEventPublisher | None = None

    def _registry(self) -> worker_pb2_grpc.RegistryStub:
        if self._stub is None:
            options: tuple[tuple[str, object], ...] = _CHANNEL_OPTIONS
            if self.config.tls_target_name and self.config.tls.enabled:
                options += (("grpc.ssl_target_name_override", self.config.tls_target_name),)
            self._channel = aio_channel(self.config.router_address, self.config.tls, options)
            self._stub = worker_pb2_grpc.RegistryStub(self._channel)
        return self._stub

    async def register(self) -> None:
        """Register, retrying while the router is unreachable; then send the first heartbeat.

        Raises RegistrationError when the router rejects the worker or does not answer in time.
        """
        cfg = self.config
        give_up = time.monotonic() + cfg.register_timeout_s
        while True:
            try:
                await self._register_once()
                break
            except grpc.aio.AioRpcError as e:
                # ALREADY_EXISTS: the id is another live process's; retried in case that one is this
                # worker's own predecessor, about to expire.
                retry = (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.ALREADY_EXISTS,
                )
                if e.code() not in retry:
                    raise RegistrationError(
                        f"router {cfg.router_address} rejected {self.info.worker_id}: "
                        f"{e.code().name}: {e.details()}"
                    ) from e
                if time.monotonic() + cfg.retry_interval_s > give_up:
                    if e.code() is grpc.StatusCode.ALREADY_EXISTS:
                        raise RegistrationError(
                            f"router {cfg.router_address} refused {self.info.worker_id} for "
                            f"{cfg.register_timeout_s}s: {e.details()}"
                        ) from e
                    # The last error says why: the router is not up, or it refused the TLS handshake.
                    raise RegistrationError(
                        f"router {cfg.router_address} did not answer within {cfg.register_timeout_s}s "
                        f"(last: {e.code().name}: {e.details()})"
                    ) from e
                await asyncio.sleep(cfg.retry_interval_s)
        # At once: the router marks a worker READY on its first heartbeat.
        await self._heartbeat_once()

    def start(self) -> None:
        """Heartbeat in the background until ``close``."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._heartbeat_loop())

    async def close(self, deregister: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if deregister and self.registrations:
            try:
                timeout = self.config.rpc_timeout_s
                await self._registry().Deregister(self.info, timeout=timeout, metadata=self._meta)
            except grpc.aio.AioRpcError as e:
                log.warning("deregister of %s failed: %s", self.info.worker_id, e.code().name)
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None

    async def _register_once(self) -> None:
        timeout = self.config.rpc_timeout_s
        resp = await self._registry().Register(self.info, timeout=timeout, metadata=self._meta)
        if resp.heartbeat_interval_s > 0:
            self.interval_s = resp.heartbeat_interval_s
        self.registrations += 1

    async def _heartbeat_once(self) -> None:
        load = self._load()
        load.worker_id = self.info.worker_id
        load.standby = self.info.standby
        if self.kv_events is not None:
            load.kv_events.CopyFrom(self.kv_events.batch())
        resp = await self._registry().Heartbeat(load, timeout=self.config.rpc_timeout_s, metadata=self._meta)
        if self.kv_events is not None and resp.known:
            self.kv_events.answered(resp)
        if not resp.known:
            log.info("router does not know %s; registering again", self.info.worker_id)
            await self._register_once()
            self.leaving = False
            return
        if resp.leaving and not self.leaving:
            log.info(
                "router %s is shutting down: %s stops relying on it",
                self.config.router_address,
                self.info.worker_id,
            )
        self.leaving = resp.leaving
        if self.info.standby and not resp.standby:
            # Promoted out of the warm pool: a re-registration (a router restart) must not demote it.
            self.info.standby = False
            log.info("router promoted %s from standby", self.info.worker_id)
        if resp.drain and not self.drain_requested:
            self.drain_requested = True
            log.info("router asked %s to drain", self.info.worker_id)
            result = self._on_drain()
            if inspect.isawaitable(result):
                await result

    async def _known_now(self, known: bool) -> None:
        if known is not self._known:
            self._known = known
            if self.on_known is not None:
                await self.on_known(known)

    async def _next_beat(self, early: bool) -> None:
        """Until the next heartbeat is due: the interval, or (``early``: the router answers) sooner, at most
        every ``EVENTS_BEAT_S``, once the prefix cache has changes to publish, so the routers' KV index
        follows it closely."""
        if self.leaving:  # until it has gone (then a router started at its address is joined)
            await asyncio.sleep(max(self.interval_s, LEAVING_BEAT_S))
            return
        if not early or self.kv_events is None:
            await asyncio.sleep(self.interval_s)
            return
        due = time.monotonic() + self.interval_s
        while (left := due - time.monotonic()) > 0:
            await asyncio.sleep(min(left, EVENTS_BEAT_S))
            if self.kv_events.pending():
                return

    async def _heartbeat_loop(self) -> None:
        failing = False
        failed = 0
        while True:
            await self._next_beat(early=not failing)
            try:
                await self._heartbeat_once()
                failing, failed = False, 0
                await self._known_now(not self.leaving)
            except grpc.aio.AioRpcError as e:
                # Logged once per outage, not once per beat.
                if not failing:
                    log.warning("heartbeat to %s failed: %s", self.config.router_address, e.code().name)
                failing = True
                failed += 1
                if failed >= _FAILED_BEATS:  # the router is gone, or refuses this worker
                    await self._known_now(False)
            except Exception:  # noqa: BLE001 - a bad beat (its load report failed): the next one goes
                # The worker keeps beating: silent, the router would drop it while it still runs.
                if not failing:
                    log.exception("heartbeat to %s failed", self.config.router_address)
                failing = True


async def run_worker(
    shell: WorkerShell, agent: RouterLink, on_registered: Callable[[], object] = lambda: None
) -> None:
    """A started, SERVING shell joins the cluster and serves until it has drained; then it leaves.

    Drain comes from the router (heartbeat answer), a signal (``shell.install_signal_handlers``) or the
    pool's Drain RPC calling ``shell.begin_drain``. ``on_registered``: once the router knows it.
    """
    registering = asyncio.ensure_future(agent.register())
    stopped = asyncio.ensure_future(shell.wait_stopped())
    try:
        await asyncio.wait((registering, stopped), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        registering.cancel()
        raise
    finally:
        stopped.cancel()
    if not registering.done():  # told to stop (SIGTERM) before it could join: it never joins
        registering.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await registering
        await agent.close(deregister=False)
        return
    registering.result()  # (a RegistrationError: the router refused it, or never answered)
    await shell.set_registered()
    agent.on_known = shell.set_registered  # readiness follows whether the router knows it
    on_registered()
    agent.start()
    try:
        await shell.wait_stopped()
    finally:
        await agent.close()
