"""The router process: a grpc.aio server on uvloop serving Generation, Registry, health and reflection,
with the metrics endpoint and the OpenAI HTTP front (``openai.server``) on the same event loop."""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from pdserve.proto import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.router.config import RouterConfig
from pdserve.router.control import RegistryService
from pdserve.router.openai.server import OpenAIFront
from pdserve.router.service import GenerationService, Router
from pdserve.router.validate import ModelLimits, RouterTokenizer
from pdserve.telemetry.exporter import MetricsEndpoint, serve_metrics
from pdserve.worker.address import host_port
from pdserve.worker.auth import RequireToken
from pdserve.worker.shell import SERVER_OPTIONS, RejectUndecodable
from pdserve.worker.tls import add_port

log = logging.getLogger(__name__)

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
REGISTRY_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Registry"].full_name
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


def load_frontend(model: str, cache_dir=None) -> tuple[RouterTokenizer, ModelLimits]:
    """The model's tokenizer and limits (blocking: run it off the event loop)."""
    from pdserve.engine.registry import resolve_model
    from pdserve.engine.tokenizer import Tokenizer

    path = resolve_model(model, cache_dir, progress=False)
    tokenizer = Tokenizer.from_dir(path)
    _ = tokenizer.vocab_digest  # computed here, off the loop: registration compares workers' digests with it
    _ = tokenizer.max_token_chars  # and this, which the first prompt would read (router/validate.py)
    return tokenizer, ModelLimits.from_model_dir(path)


class RouterServer:
    """Start (bind, serve), load (tokenizer and limits, then SERVING), run (a heartbeat sweep), and stop on
    SIGTERM/SIGINT (NOT_SERVING, new requests refused, in-flight ones get ``shutdown_grace_s``)."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.router = Router(config)
        self.health = HealthServicer()
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._sweep: asyncio.Task | None = None
        self._stop = asyncio.Event()
        self.metrics: MetricsEndpoint | None = None
        self.http: OpenAIFront | None = None

    @property
    def address(self) -> str:
        return self.router.address

    async def start(self) -> str:
        """Bind and serve (Generation NOT_SERVING until ``set_frontend``/``load``). Returns the address."""
        generate = f"/{generation_pb2.DESCRIPTOR.services_by_name['Generation'].full_name}/Generate"

        def refused(method: str) -> None:  # bad bytes are a refused request, as bad fields are
            if method == generate:
                self.router.metrics.rejected("INVALID_ARGUMENT")

        interceptors: list[grpc.aio.ServerInterceptor] = [RejectUndecodable(refused)]
        if self.config.cluster_token:
            refused = self.router.metrics.auth_refused
            interceptors.insert(0, RequireToken(self.config.cluster_token, {REGISTRY_SERVICE}, refused))
        server = grpc.aio.server(interceptors=interceptors, options=SERVER_OPTIONS)
        generation_pb2_grpc.add_GenerationServicer_to_server(GenerationService(self.router), server)
        worker_pb2_grpc.add_RegistryServicer_to_server(RegistryService(self.router), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (GENERATION_SERVICE, REGISTRY_SERVICE, HEALTH_SERVICE, reflection.SERVICE_NAME), server
        )
        for name in ("", GENERATION_SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        # Registry serves at once: workers register while the router still loads.
        await self.health.set(REGISTRY_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        try:
            self.port = add_port(server, self.config.bind_address, self.config.tls)
        except RuntimeError as e:  # grpc's "Failed to bind to address ..."
            raise ListenError(f"cannot serve gRPC on {self.config.bind_address}: {e}") from e
        await server.start()
        self._server = server
        self.router.address = host_port(self.config.host, self.port)
        try:
            await self._start_http()
        except ListenError:
            await self.stop(0.0)  # nothing of a failed start stays bound
            raise
        self._sweep = asyncio.get_running_loop().create_task(self.router.membership.sweep_forever())
        if self.config.live_migration:
            self.router.move_watch.start()
        log.info("router listening on %s", self.router.address)
        return self.router.address

    async def _start_http(self) -> None:
        """The metrics endpoint and the OpenAI API, each on its port."""
        try:
            self.metrics = serve_metrics(
                self.router.metrics.registry, self.config.host, self.config.metrics_port
            )
        except OSError as e:
            raise ListenError(f"cannot serve metrics on port {self.config.metrics_port}: {e}") from e
        self.router.metrics_url = self.metrics.url
        if self.config.http_port is not None:
            http = OpenAIFront(
                self.router, self.config.host, self.config.http_port, self.config.model, self.config.tls
            )
            try:
                self.router.http_url = await http.start()
            except OSError as e:
                raise ListenError(
                    f"cannot serve the HTTP API on port {self.config.http_port} (--http-port; 0 picks a free "
                    f"one): {e}"
                ) from e
            self.http = http

    async def set_frontend(self, tokenizer: RouterTokenizer, limits: ModelLimits) -> None:
        self.router.set_frontend(tokenizer, limits)
        for name in ("", GENERATION_SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def load(self) -> None:
        """Load the configured model's tokenizer, then serve Generation."""
        tokenizer, limits = await asyncio.to_thread(load_frontend, self.config.model, self.config.cache_dir)
        await self.set_frontend(tokenizer, limits)
        log.info("router serving model %s (context %d)", self.config.model, limits.context_length)

    def request_stop(self) -> None:
        self._stop.set()

    async def stop(self, grace_s: float | None = None) -> None:
        """NOT_SERVING, refuse new requests, let in-flight ones finish (bounded), stop."""
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        self.router.closing = True
        waiting = self.router.admission.waiting
        log.info(
            "router stopping (%d requests running, %d waiting: refused)",
            len(self.router.ledger.jobs),
            waiting,
        )
        await self.router.admission.close()  # no worker is coming for them: their clients go elsewhere now
        await self.health.enter_graceful_shutdown()
        give_up = time.monotonic() + grace
        # (inflight_ids, not the ledger: a request whose worker is done may still be read by a slow client)
        while self.router.inflight_ids and time.monotonic() < give_up:
            await asyncio.sleep(0.05)
        if self.http is not None:
            await self.http.stop()
            self.http = None
        if self._server is not None:
            await self._server.stop(1.0)
            self._server = None
        await self.router.move_watch.stop()
        if self._sweep is not None:
            self._sweep.cancel()
            try:
                await self._sweep
            except asyncio.CancelledError:
                pass
            self._sweep = None
        await self.router.channels.close()
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        log.info("router stopped")

    async def serve(self) -> None:
        """Run until SIGTERM/SIGINT."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        await self.start()
        load = loop.create_task(self.load())
        stop = loop.create_task(self._stop.wait())
        try:
            await asyncio.wait((load, stop), return_when=asyncio.FIRST_COMPLETED)
            if load.done():
                load.result()  # a model that cannot load ends the process with its error
                await stop
        finally:
            for task in (load, stop):
                task.cancel()
            await self.stop()


class ListenError(Exception):
    """A port the router was told to serve on cannot be bound (in use, not allowed)."""


def main(config: RouterConfig) -> None:
    import uvloop

    uvloop.run(RouterServer(config).serve())
