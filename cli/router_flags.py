"""The router's tuning flags, each defined once (``RouterConfig`` gives the defaults): ``pdserve router`` and
``pdserve up`` add them, ``up`` hands them to the router it starts, and ``router_config`` reads them."""

from __future__ import annotations

import dataclasses

from pdserve.router.config import RouterConfig
from pdserve.router.policy import RoutingPolicy
from pdserve.worker.flagspec import Flag, Switch, int_in, nonneg, seconds

_D = RouterConfig()

ROUTER_FLAGS = (
    Flag("--max-waiting", "router queue bound", default=_D.max_waiting, type=nonneg, field="max_waiting"),
    Flag(
        "--max-migrations",
        "times a stream moves to a healthy worker when its worker fails (0: never; default %(default)s)",
        default=_D.max_migrations,
        type=nonneg,
        field="max_migrations",
    ),
    Flag(
        "--no-live-migration",
        "leave streams on a draining decode worker until they end (default: each moves live, with its KV, to "
        "another decode worker with room, so the drain takes as long as the transfers)",
        default=_D.live_migration,
        switch=Switch.OFF,
        dest="live_migration",
        field="live_migration",
    ),
    Flag(
        "--no-rebalance",
        "never move streams to even the decode batches (default: a stream moves live off a decode worker "
        "running at least 1.5x the pool's mean of this router's streams and 4 more than the least busy, "
        "one at a time, until it is within 1.2x)",
        default=_D.rebalance,
        switch=Switch.OFF,
        dest="rebalance",
        field="rebalance",
    ),
    Flag(
        "--max-prefill-queue-tokens",
        "prompt tokens queued on one prefill worker beyond which new requests are refused at once "
        "(RESOURCE_EXHAUSTED; 0: no bound; default %(default)s)",
        default=_D.max_prefill_queue_tokens,
        type=nonneg,
        field="max_prefill_queue_tokens",
    ),
    Flag(
        "--queue-timeout",
        "seconds a request may wait in the router's queue for a decode worker with room, then UNAVAILABLE "
        "(HTTP 503)",
        default=_D.queue_timeout_s,
        type=seconds(True),
        field="queue_timeout_s",
    ),
    Flag(
        "--admission-ttft-s",
        "refuse at once (RESOURCE_EXHAUSTED, HTTP 429, with a retry hint) a request whose predicted time to "
        "first token is over this many seconds: the prefill tokens queued ahead of it on the worker that "
        "would prefill it, plus its own, over that worker's measured rate; a request's deadline tightens "
        "it (0: off, every request waits its turn; default %(default)s)",
        default=_D.admission_ttft_s,
        type=seconds(False),
        field="admission_ttft_s",
    ),
    Flag(
        "--local-prefill-threshold",
        "prompts shorter than this many tokens prefill on the decode worker",
        default=_D.local_prefill_threshold,
        type=nonneg,
        field="local_prefill_threshold",
    ),
    Flag(
        "--routing-policy",
        "kv-aware: score workers by the prompt prefix each caches (from their KV events) against load; "
        "load: least loaded only (default %(default)s)",
        default=_D.routing_policy,
        choices=tuple(p.value for p in RoutingPolicy),
        field="routing_policy",
    ),
    Flag(
        "--heartbeat-interval",
        "seconds between workers' heartbeats",
        default=_D.heartbeat_interval_s,
        type=seconds(True),
        field="heartbeat_interval_s",
    ),
    Flag(
        "--heartbeat-timeout",
        "seconds without a heartbeat after which a worker is dropped and its requests move",
        default=_D.heartbeat_timeout_s,
        type=seconds(True),
        field="heartbeat_timeout_s",
    ),
    Flag(
        "--request-timeout",
        "deadline for requests that set none (0: none)",
        default=_D.request_timeout_s,
        type=seconds(False),
        field="request_timeout_s",
    ),
    Flag(
        "--shutdown-grace",
        "seconds a stopping router (SIGTERM) gives its streams in flight to finish; it admits nothing new",
        default=_D.shutdown_grace_s,
        type=seconds(False),
        field="shutdown_grace_s",
    ),
    Flag(
        "--metrics-port",
        "the router's /metrics port (0: any)",
        default=_D.metrics_port,
        type=int_in(0, 65535),
        field="metrics_port",
    ),
    Flag(
        "--http-port",
        "serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions) on this port "
        "(0: a free one; default: off)",
        default=_D.http_port,
        type=int_in(0, 65535),
        field="http_port",
    ),
)

# Where ``pdserve up`` serves the OpenAI-compatible API unless told otherwise (vLLM's port): an
# OpenAI-compatible server answers on HTTP out of the box. ``pdserve router`` serves it only when given
# ``--http-port``.
DEFAULT_UP_HTTP_PORT = 8000
_HTTP_PORT = next(f for f in ROUTER_FLAGS if f.option == "--http-port")
UP_HTTP_PORT = dataclasses.replace(
    _HTTP_PORT,
    help="serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions) on this port "
    "(default %(default)s; 0: a free one, shown by `pdserve status`)",
    default=DEFAULT_UP_HTTP_PORT,
)
# ``up`` adds these, then UP_HTTP_PORT or --no-http; it hands the router every ROUTER_FLAGS value.
UP_ROUTER_FLAGS = tuple(f for f in ROUTER_FLAGS if f is not _HTTP_PORT)
