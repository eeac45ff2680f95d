"""The gRPC server every worker process runs: health and reflection, the cluster token, in-flight
Generate/Prefill calls counted by an interceptor (so a pool's servicer keeps no count), and the drain."""

from __future__ import annotations

import asyncio
import enum
import inspect
import logging
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from pdserve.proto import worker_pb2
from pdserve.worker.address import dial_host, host_port
from pdserve.worker.auth import RequireToken
from pdserve.worker.tls import NO_TLS, TLSConfig, add_port

log = logging.getLogger(__name__)

WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
# A health service name that is SERVING only while the worker is registered with the router and serving:
# what a readiness probe asks (the overall "" service is SERVING from the model load on, before the
# router knows the worker). Until registration it is NOT_SERVING; draining makes it NOT_SERVING again.
REGISTERED_SERVICE = "pdserve.worker.registered"
# Trailing metadata of a call rejected because the worker is not SERVING (e.g. draining): the router
# then does not take the worker for dead, as it would for a bare UNAVAILABLE.
REJECT_METADATA_KEY = "pdserve-rejected"
# Trailing metadata of a call that failed on this worker for a reason of the worker's, not the request's (a
# failed engine step or prefill forward): the router moves the request to another worker.
RETRY_ELSEWHERE_KEY = "pdserve-retry-elsewhere"
# gRPC enables SO_REUSEPORT by default; a fixed port already taken must fail to bind instead.
SERVER_OPTIONS = (("grpc.so_reuseport", 0),)
_TRACKED = frozenset({f"/{WORKER_SERVICE}/Generate", f"/{WORKER_SERVICE}/Prefill"})


class ShellState(enum.Enum):
    """STARTING (health NOT_SERVING, calls rejected) -> SERVING (model loaded) -> DRAINING (new calls
    rejected, in-flight ones run to their end within ``drain_timeout_s``) -> STOPPED."""

    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"

    @property
    def proto(self) -> int:
        """The WorkerState a heartbeat reports."""
        return _STATE_TO_PROTO[self]


_STATE_TO_PROTO = {
    ShellState.STARTING: worker_pb2.WORKER_STATE_LOADING,
    ShellState.SERVING: worker_pb2.WORKER_STATE_READY,
    ShellState.DRAINING: worker_pb2.WORKER_STATE_DRAINING,
    ShellState.STOPPED: worker_pb2.WORKER_STATE_STOPPED,
}


@dataclass(frozen=True)
class ShellConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: the OS picks a free port
    # In-flight requests get this long to finish once a drain starts; then they are cancelled.
    drain_timeout_s: float = 300.0
    stop_grace_s: float = 1.0
    # Callers of the Worker service (the router) must present it (``worker.auth``); "": open.
    cluster_token: str = field(default="", repr=False)
    # TLS on the gRPC port, mutual with a CA (``worker.tls``); NO_TLS: plain.
    tls: TLSConfig = NO_TLS

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.drain_timeout_s < 0 or self.stop_grace_s < 0:
            raise ValueError("drain_timeout_s and stop_grace_s must be >= 0")


class _Undecodable:
    """What a request that did not parse deserializes to, so its handler can refuse it by name."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


class RejectUndecodable(grpc.aio.ServerInterceptor):
    """A request whose bytes do not parse as its message type gets INVALID_ARGUMENT.

    Left to grpc, a failed deserialization ends the call with a status that says nothing of the cause
    (UNKNOWN or INTERNAL): to a client that is a server fault, not its own bad input. ``on_refuse``
    (the method's full name) runs for each refusal, for the server's metrics.
    """

    def __init__(self, on_refuse: Callable[[str], None] | None = None) -> None:
        self._on_refuse = on_refuse

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        decode, method = handler.request_deserializer, handler_call_details.method

        def safe_decode(data: bytes):
            try:
                return decode(data)
            except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and whatever a parser raises
                return _Undecodable(e)

        async def refuse(request, context) -> None:
            if self._on_refuse is not None:
                self._on_refuse(method)
            text = f"the request is not a valid {method} message: {request.error}"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, text)

        kw = dict(request_deserializer=safe_decode, response_serializer=handler.response_serializer)
        if handler.unary_unary is not None:
            unary = handler.unary_unary

            async def checked_unary(request, context):
                if isinstance(request, _Undecodable):
                    return await refuse(request, context)
                return await unary(request, context)

            return grpc.unary_unary_rpc_method_handler(checked_unary, **kw)
        if handler.unary_stream is None:
            return handler
        stream = handler.unary_stream
        if inspect.isasyncgenfunction(stream):

            async def checked_gen(request, context):
                if isinstance(request, _Undecodable):
                    await refuse(request, context)
                    return
                async for m in stream(request, context):
                    yield m

            return grpc.unary_stream_rpc_method_handler(checked_gen, **kw)

        async def checked_stream(request, context):
            if isinstance(request, _Undecodable):
                return await refuse(request, context)
            return await stream(request, context)

        return grpc.unary_stream_rpc_method_handler(checked_stream, **kw)


class _Tracker(grpc.aio.ServerInterceptor):
    """Counts in-flight Generate/Prefill calls and rejects new ones unless the shell is SERVING."""

    def __init__(self, shell: WorkerShell) -> None:
        self._shell = shell

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method not in _TRACKED:
            return handler
        shell = self._shell
        kw = dict(
            request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )
        if handler.unary_unary is not None:
            behavior = handler.unary_unary

            async def unary(request, context):
                if not shell._enter():
                    return await shell._reject(context)
                try:
                    return await behavior(request, context)
                finally:
                    shell._exit()

            return grpc.unary_unary_rpc_method_handler(unary, **kw)
        if handler.unary_stream is None:
            return handler
        stream_behavior = handler.unary_stream
        if inspect.isasyncgenfunction(stream_behavior):

            async def stream_gen(request, context):
                if not shell._enter():
                    await shell._reject(context)
                    return
                try:
                    async for m in stream_behavior(request, context):
                        yield m
                finally:
                    shell._exit()

            return grpc.unary_stream_rpc_method_handler(stream_gen, **kw)

        async def stream_writer(request, context):
            if not shell._enter():
                return await shell._reject(context)
            try:
                return await stream_behavior(request, context)
            finally:
                shell._exit()

        return grpc.unary_stream_rpc_method_handler(stream_writer, **kw)


class WorkerShell:
    def __init__(
        self, config: ShellConfig, on_auth_refused: Callable[[str], None] = lambda method: None
    ) -> None:
        self.config = config
        self._on_auth_refused = on_auth_refused
        self.state = ShellState.STARTING
        self.inflight = 0
        self.port = 0
        self.address = ""
        self.health = HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._services: tuple[str, ...] = ()
        self._idle = asyncio.Event()
        self._idle.set()
        self._stopped = asyncio.Event()
        self._drain_task: asyncio.Task | None = None
        self._stop_now = asyncio.Event()  # a second SIGTERM: the drain stops waiting for in-flight calls
        self._signalled = False

    async def start(
        self,
        add_servicers: Callable[[grpc.aio.Server], None],
        service_names: Sequence[str] = (WORKER_SERVICE,),
    ) -> str:
        """Bind and start serving health and reflection (NOT_SERVING) plus the given servicers.

        Returns the address to register (host:bound_port).
        """
        interceptors: list[grpc.aio.ServerInterceptor] = [RejectUndecodable(), _Tracker(self)]
        if self.config.cluster_token:
            guard = RequireToken(self.config.cluster_token, {WORKER_SERVICE}, self._on_auth_refused)
            interceptors.insert(0, guard)
        server = grpc.aio.server(interceptors=interceptors, options=SERVER_OPTIONS)
        add_servicers(server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        self._services = tuple(service_names)
        names = (
            *self._services,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, server)
        for name in ("", *self._services, REGISTERED_SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.port = add_port(server, host_port(self.config.host, self.config.port), self.config.tls)
        await server.start()
        self._server = server
        self.address = host_port(dial_host(self.config.host), self.port)
        return self.address

    async def set_serving(self) -> None:
        if self.state is not ShellState.STARTING:
            return
        self.state = ShellState.SERVING
        for name in ("", *self._services):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def set_registered(self, registered: bool = True) -> None:
        """Whether the router knows this serving worker: ``REGISTERED_SERVICE`` reads SERVING or
        NOT_SERVING (readiness). A draining worker's reads NOT_SERVING whatever this says."""
        if self.state is ShellState.SERVING:
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if registered
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            await self.health.set(REGISTERED_SERVICE, status)

    def begin_drain(self) -> None:
        """Stop taking requests, let in-flight ones finish, then stop. Idempotent; signal-handler safe."""
        if self.state in (ShellState.DRAINING, ShellState.STOPPED) or self._drain_task is not None:
            return
        log.info("worker at %s draining (%d in flight)", self.address, self.inflight)
        self.state = ShellState.DRAINING
        self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def stop(self) -> None:
        """Drain and wait for the server to stop."""
        self.begin_drain()
        if self._drain_task is not None:
            await self._drain_task
        else:
            await self._stopped.wait()

    def install_signal_handlers(self) -> None:
        """SIGTERM or SIGINT: drain (also when a drain the router asked for runs already). A second
        signal: stop now, cutting what is in flight (the router moves those requests), as ``pdserve down``
        / ``scale`` and the autoscaler ask once their drain time passed (``cluster.cut_drains``)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)

    def _on_signal(self) -> None:
        # Only a second signal cuts: a drain the router asked for (pdserve drain, a preStop hook, a
        # scale-down) still lets the first SIGTERM after it wait for the requests in flight.
        if self._signalled and not self._stop_now.is_set():
            log.warning("asked again to stop: cutting %d requests in flight", self.inflight)
            self._stop_now.set()
        self._signalled = True
        self.begin_drain()

    async def _drain(self) -> None:
        try:
            await self.health.enter_graceful_shutdown()
            idle = asyncio.ensure_future(self._idle.wait())
            now = asyncio.ensure_future(self._stop_now.wait())
            try:
                await asyncio.wait(
                    (idle, now), timeout=self.config.drain_timeout_s, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                idle.cancel()
                now.cancel()
            if self.inflight and not self._stop_now.is_set():
                log.warning("drain timed out with %d requests in flight; cancelling them", self.inflight)
            if self._server is not None:
                await self._server.stop(self.config.stop_grace_s)
        except Exception:
            # Stopped all the same: a worker that began its drain must end (``run_worker`` waits for it).
            log.exception("the drain failed; stopping anyway")
            raise
        finally:
            self.state = ShellState.STOPPED
            self._stopped.set()

    def _enter(self) -> bool:
        if self.state is not ShellState.SERVING:
            return False
        self.inflight += 1
        self._idle.clear()
        return True

    def _exit(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()

    async def _reject(self, context: grpc.aio.ServicerContext) -> None:
        state = self.state.value
        await context.abort(
            grpc.StatusCode.UNAVAILABLE,
            f"worker is {state}",
            trailing_metadata=((REJECT_METADATA_KEY, state),),
        )


class PoolServicer:
    """``Worker.GetLoad`` and ``Worker.Drain``, the same on every pool; the pool provides ``load()``
    (reporting ``shell.state.proto``).

    Put it before ``worker_pb2_grpc.WorkerServicer`` in the bases so these win over the defaults.
    What the router expects of a pool's Generate: the message carrying ``finish_reason`` also carries the
    last token, and a remote-mode call's first message holds only ``transfer_ticket``. A cancelled call
    frees the request's blocks. UNAVAILABLE means the worker is gone, so a prefill whose KV push fails
    answers ABORTED.
    """

    shell: WorkerShell

    def load(self) -> worker_pb2.WorkerLoad:
        raise NotImplementedError

    async def GetLoad(self, request, context) -> worker_pb2.WorkerLoad:  # noqa: N802 - gRPC method name
        return self.load()

    async def Drain(self, request, context) -> worker_pb2.WorkerLoad:  # noqa: N802
        self.shell.begin_drain()
        return self.load()
