"""Router configuration: one frozen dataclass built once (by the CLI) and passed in."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pdserve.router.policy import RoutingConfig, RoutingPolicy
from pdserve.router.registry import RegistryConfig
from pdserve.worker.address import host_port
from pdserve.worker.tls import NO_TLS, TLSConfig

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50051


@dataclass(frozen=True)
class RouterConfig:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT  # 0 picks a free port (tests)
    model: str = DEFAULT_MODEL  # a registry name or an HF-style directory
    cache_dir: Path | None = None  # where model names resolve to directories (None: engine default)
    # Requests waiting at the router for a worker with room; more are rejected (RESOURCE_EXHAUSTED).
    max_waiting: int = 256
    # Prompt tokens the router lets queue on one prefill worker (dispatched, not yet answered); a request
    # that would queue behind more is refused at once (RESOURCE_EXHAUSTED) rather than time out later.
    # 0: no bound.
    max_prefill_queue_tokens: int = 65536
    # How long a request may wait for room before it fails with UNAVAILABLE.
    queue_timeout_s: float = 30.0
    # Prompts shorter than this are prefilled by the decode worker itself.
    local_prefill_threshold: int = 256
    # Refuse at once (RESOURCE_EXHAUSTED, HTTP 429) a request whose predicted time to first token is over
    # this many seconds (router/budget.py); a request's own deadline tightens it. 0: off (no prediction).
    admission_ttft_s: float = 0.0
    # kv-aware: both legs scored by the prefix each worker caches (the KV index) against load; load: least
    # loaded only.
    routing_policy: str = "kv-aware"
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 2.5
    # Deadline given to requests whose client set none (0: none). Bounds every worker RPC.
    request_timeout_s: float = 600.0
    # A stream whose worker fails (dies, drops the call, loses its KV transfer) moves to a healthy worker
    # this many times at most, continuing from the tokens already sent (0: never; the request fails).
    max_migrations: int = 3
    # A stream on a draining decode worker moves live, with its KV, to another decode worker (router/moves.py)
    # rather than holding the drain until it ends. Off: the drain waits for it.
    live_migration: bool = True
    # ... and streams move live, one at a time, off a decode worker running far more of this router's streams
    # than the pool's mean (router/moves.py, RebalanceConfig). Needs live_migration.
    rebalance: bool = True
    # On SIGTERM: how long in-flight requests may run before the server cancels them.
    shutdown_grace_s: float = 10.0
    # Prometheus /metrics on host:metrics_port (0: a free port, shown by `pdserve status`).
    metrics_port: int = 0
    # The OpenAI-compatible HTTP API on host:http_port (None: off; 0: a free port, shown by `pdserve status`).
    http_port: int | None = None
    # The cluster token (``worker.auth``) every caller of the Registry service must present; "": open.
    cluster_token: str = field(default="", repr=False)
    # TLS on the gRPC port (and HTTPS on the OpenAI front), mutual with a CA; the workers are called with
    # the same certificate (``worker.tls``). NO_TLS: plain.
    tls: TLSConfig = NO_TLS

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
        if not self.host:
            raise ValueError("host must not be empty")
        if not self.model:
            raise ValueError("model must not be empty")
        self.tls.check_server()
        if self.queue_timeout_s <= 0:
            raise ValueError(f"queue_timeout_s must be > 0, got {self.queue_timeout_s}")
        if self.request_timeout_s < 0:
            raise ValueError(f"request_timeout_s must be >= 0, got {self.request_timeout_s}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        # The nested configs check their own fields; build them once here so a bad value fails at startup.
        self.registry_config()
        self.routing_config()
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.max_prefill_queue_tokens < 0:
            raise ValueError(f"max_prefill_queue_tokens must be >= 0, got {self.max_prefill_queue_tokens}")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")
        self.registry_config()  # its own checks (the heartbeat interval against the timeout), up front

    @property
    def bind_address(self) -> str:
        return host_port(self.host, self.port)

    def registry_config(self) -> RegistryConfig:
        return RegistryConfig(
            heartbeat_interval_s=self.heartbeat_interval_s, heartbeat_timeout_s=self.heartbeat_timeout_s
        )

    def routing_config(self) -> RoutingConfig:
        return RoutingConfig(
            local_prefill_threshold=self.local_prefill_threshold, policy=RoutingPolicy(self.routing_policy)
        )
