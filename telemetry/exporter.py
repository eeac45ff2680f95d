"""Every process's Prometheus side: its registry, and ``/metrics`` on a port of its own.

A registry per process, never prometheus_client's global one: tests run several routers and workers in
one interpreter, and the global registry refuses a second metric of the same name. Scrapes run on the
threaded WSGI server's own thread, not on the event loop that relays tokens.
"""

from __future__ import annotations

import socket
import threading
from importlib import metadata
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Gauge, ProcessCollector, start_http_server

from pdserve.telemetry.gpu import add_gpu_metrics

INFO_METRIC = "pdserve_info"
# 1 once a worker failed to load its model (0 before and after a good load): ``model_load_gauge``.
MODEL_LOAD_FAILED = "pdserve_model_load_failed"
# Roles as the ``role`` label spells them: the router, and a worker's ``Role.value``.
ROLES = ("router", "prefill", "decode", "both", "autoscaler")
_JOIN_TIMEOUT_S = 5.0


def pdserve_version() -> str:
    try:
        return metadata.version("pdserve")
    except metadata.PackageNotFoundError:
        return "unknown"


def process_registry(role: str, *, gpu: bool = True) -> CollectorRegistry:
    """A new registry holding what every pdserve process exports, whatever its role:
    ``pdserve_info{role,version}`` (always 1: the dashboards list instances from it), prometheus_client's
    ``process_*``, and ``pdserve_gpu_*`` where a GPU is present (``telemetry.gpu``)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    registry = CollectorRegistry()
    Gauge(INFO_METRIC, "A pdserve process (always 1).", ["role", "version"], registry=registry).labels(
        role, pdserve_version()
    ).set(1)
    ProcessCollector(registry=registry)
    if gpu:
        add_gpu_metrics(registry, role)
    return registry


def model_load_gauge(registry: CollectorRegistry, role: str) -> Gauge:
    """``pdserve_model_load_failed{role}`` at 0; a worker sets it to 1 when its model does not load.

    A worker whose load failed exits, so the worker keeps only its /metrics up for a while first
    (``worker.bringup``): otherwise no scrape would ever see the 1.
    """
    gauge = Gauge(
        MODEL_LOAD_FAILED,
        "1 when this worker failed to load its model (it exits after a linger), else 0.",
        ["role"],
        registry=registry,
    ).labels(role)
    gauge.set(0)
    return gauge


def metrics_url(host: str, port: int) -> str:
    """The scrape URL others dial; a wildcard bind is not an address, so it becomes the host name."""
    if host in ("0.0.0.0", "::", "[::]", ""):
        host = socket.gethostname()
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}/metrics"


class MetricsEndpoint:
    """``/metrics`` of one registry on ``host:port`` (port 0: the OS picks one; see ``port``/``url``)."""

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0) -> None:
        if not 0 <= port < 65536:
            raise ValueError(f"metrics port must be in [0, 65535], got {port}")
        self.registry = registry
        self._server: WSGIServer | None
        self._thread: threading.Thread | None
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.port: int = self._server.server_port
        self.url = metrics_url(host, self.port)

    def close(self) -> None:
        """Stop serving and release the port. Idempotent."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(_JOIN_TIMEOUT_S)

    def __enter__(self) -> MetricsEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_metrics(registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0) -> MetricsEndpoint:
    """Serve ``registry`` at ``http://host:port/metrics`` until ``close()``."""
    return MetricsEndpoint(registry, host, port)
