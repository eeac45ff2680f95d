"""The router's Prometheus metrics: latency as the client sees it, request outcomes, cluster state."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Protocol, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pdserve.router.policy import Route, RouteReason
from pdserve.telemetry.exporter import process_registry
from pdserve.telemetry.slo import (
    DEFAULT_SLO,
    SloThresholds,
    e2e_buckets,
    itl_buckets,
    queue_buckets,
    ttft_buckets,
)
from pdserve.worker.auth import refusal_counter

# Every series carries role="router", as the workers' carry their own role, except ``pdserve_workers``,
# whose role is the counted worker's.
ROLE = "router"
REFUSAL_REASONS = ("ttft_budget", "queue_full", "prefill_queue_full")
# Latencies count on the router's monotonic clock from the request's arrival (``Job.arrival``): queue time
# is the wait in ``Router.admit``, TTFT ends at the first token handed to the client, ITL is the gap between
# token messages, e2e ends at the finish. Their buckets include the SLO thresholds (``telemetry.slo``).
TTFT = "pdserve_time_to_first_token_seconds"
ITL = "pdserve_inter_token_latency_seconds"
E2E = "pdserve_e2e_request_latency_seconds"
QUEUE_TIME = "pdserve_request_queue_time_seconds"
REQUESTS = "pdserve_requests_total"
# Requests refused before admission, by gRPC status code (INVALID_ARGUMENT is the client's fault;
# RESOURCE_EXHAUSTED and UNAVAILABLE mean the cluster turned work away, which the alerts watch).
REJECTED = "pdserve_requests_rejected_total"
REJECT_CODES = ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAVAILABLE")
MIGRATIONS = "pdserve_router_migrations_total"
# What failed under a migrated stream: the decode worker's call broke (it died or dropped the call), the
# prefill worker's call broke before token 0, a KV transfer was aborted, the worker missed heartbeats, or
# the decode worker had no room for the KV its last heartbeat promised (the request is routed again), or an
# engine step or prefill forward failed on a worker that lives on.
MIGRATION_REASONS = (
    "decode_failed",
    "prefill_failed",
    "transfer_aborted",
    "heartbeat_lost",
    "decode_full",
    "step_failed",
)
# Heartbeat sweeps that found the router's own event loop had stood still past a heartbeat interval
# (the workers' deadlines were moved by as long; ``Membership.sweep_forever``).
LOOP_STALLS = "pdserve_router_event_loop_stalls_total"
PROMPT_TOKENS = "pdserve_prompt_tokens_total"
GENERATION_TOKENS = "pdserve_generation_tokens_total"
RUNNING = "pdserve_requests_running"
WAITING = "pdserve_requests_waiting"
WORKERS = "pdserve_workers"

# The worker finish reasons ("stop", "length", "abort"), "error" for a request that ended
# with an error status, and "rejected" for one refused before admission (invalid input, queue
# full, no worker, router starting or stopping). Client cancels and deadlines count as "abort".
FINISH_REASONS = ("stop", "length", "abort", "error", "rejected")
WORKER_ROLES = ("prefill", "decode", "both")
WORKER_STATES = ("loading", "ready", "draining", "stopped", "standby")
_ABORT_CODES = frozenset({"CANCELLED", "DEADLINE_EXCEEDED"})


class _Message(Protocol):
    """What the recorder reads of a ``GenerateResponse``."""

    @property
    def token_ids(self) -> Iterable[int]: ...

    @property
    def finish_reason(self) -> str: ...


def outcome_of(exc: BaseException) -> str:
    """The ``finish_reason`` label of a request that ended with ``exc`` before a finish was sent."""
    if isinstance(exc, (asyncio.CancelledError, ConnectionResetError)):  # the client went away
        return "abort"
    code = getattr(exc, "code", None)  # RelayError and grpc errors carry a StatusCode
    code = code() if callable(code) else code
    return "abort" if getattr(code, "name", "") in _ABORT_CODES else "error"


class _StateCollector(Collector):
    """Gauges read from the router's own state at scrape time (no bookkeeping on the request path).

    Runs on the scrape thread: the callables must only read, and copy containers in one C call
    (``list(dict.values())``), which the GIL makes atomic.
    """

    def __init__(
        self,
        running: Callable[[], int],
        waiting: Callable[[], int],
        workers: Callable[[], Iterable[tuple[str, str]]],
    ) -> None:
        self._running, self._waiting, self._workers = running, waiting, workers

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(self._families())

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily(
                RUNNING,
                "Requests routed to workers and not yet done there (a slow client may still be reading "
                "one whose worker is done).",
                labels=["role"],
            ),
            GaugeMetricFamily(WAITING, "Requests waiting in the router's queue for room.", labels=["role"]),
            GaugeMetricFamily(WORKERS, "Registered workers by role and state.", labels=["role", "state"]),
        )

    def collect(self) -> Iterator[GaugeMetricFamily]:
        running, waiting, workers = self._families()
        running.add_metric([ROLE], self._running())
        waiting.add_metric([ROLE], self._waiting())
        # Every (role, state) pair, zeros included, so a pool scaled to nothing reads 0, not "no data".
        counts = {(r, s): 0 for r in WORKER_ROLES for s in WORKER_STATES}
        for key in self._workers():
            counts[key] = counts.get(key, 0) + 1
        for (role, state), n in counts.items():
            workers.add_metric([role, state], n)
        return iter((running, waiting, workers))


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, slo: SloThresholds = DEFAULT_SLO) -> None:
        self.registry = registry if registry is not None else process_registry(ROLE)
        reg = self.registry
        self.ttft = Histogram(
            TTFT,
            "Time from arrival at the router to the first token sent.",
            ["role"],
            buckets=ttft_buckets(slo),
            registry=reg,
        ).labels(ROLE)
        self.itl = Histogram(
            ITL,
            "Time between consecutive token messages of a request.",
            ["role"],
            buckets=itl_buckets(slo),
            registry=reg,
        ).labels(ROLE)
        self.e2e = Histogram(
            E2E, "Time from arrival to the finish message.", ["role"], buckets=e2e_buckets(slo), registry=reg
        ).labels(ROLE)
        self.queue_time = Histogram(
            QUEUE_TIME,
            "Time a request waited in admission for a worker with room.",
            ["role"],
            buckets=queue_buckets(slo),
            registry=reg,
        ).labels(ROLE)
        self._requests = Counter(
            REQUESTS, "Requests ended, by finish reason.", ["role", "finish_reason"], registry=reg
        )
        for reason in FINISH_REASONS:
            self._requests.labels(ROLE, reason)  # exported at 0 before the first of each
        self._rejected = Counter(
            REJECTED,
            "Requests refused before admission, by gRPC status code.",
            ["role", "code"],
            registry=reg,
        )
        for code in REJECT_CODES:
            self._rejected.labels(ROLE, code)
        self.prompt_tokens = Counter(
            PROMPT_TOKENS, "Prompt tokens of admitted requests.", ["role"], registry=reg
        ).labels(ROLE)
        self.generation_tokens = Counter(
            GENERATION_TOKENS, "Tokens streamed to clients.", ["role"], registry=reg
        ).labels(ROLE)
        self.auth_refused = refusal_counter(reg, ROLE)  # pdserve_auth_refused_total{role,method}
        self._migrations = Counter(
            MIGRATIONS,
            "Streams moved to another worker after theirs failed, by what failed.",
            ["role", "reason"],
            registry=reg,
        )
        for reason in MIGRATION_REASONS:
            self._migrations.labels(ROLE, reason)
        self._live_moves = Counter(
            "pdserve_router_live_moves_total",
            "Live moves of decoding streams with their KV to another decode worker, by cause (drain, "
            "rebalance) and "
            "outcome (moved; declined: not now, e.g. no worker with room; failed: the stream stayed).",
            ["role", "cause", "outcome"],
            registry=reg,
        )
        for cause in ("drain", "rebalance"):
            for outcome in ("moved", "declined", "failed"):
                self._live_moves.labels(ROLE, cause, outcome)
        self._live_move_bytes = Counter(
            "pdserve_router_live_move_kv_bytes",
            "KV bytes written moving streams live (the workers' transfer sizes).",
            ["role"],
            registry=reg,
        ).labels(ROLE)
        self._live_move_pause = Histogram(
            "pdserve_router_live_move_pause_seconds",
            "Per moved stream: from its pause on the worker it left to its KV landing on the other (no token "
            "comes meanwhile).",
            ["role"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=reg,
        ).labels(ROLE)
        self._routes = Counter(
            "pdserve_router_routes_total",
            "Routing decisions, by where the prompt is prefilled and why (policy.RouteReason).",
            ["role", "reason"],
            registry=reg,
        )
        for why in RouteReason:
            self._routes.labels(ROLE, why.value)
        self._predicted_cached = Counter(
            "pdserve_router_predicted_cached_tokens_total",
            "Prompt tokens the KV index said the chosen worker held, by leg (decode, prefill).",
            ["role", "leg"],
            registry=reg,
        )
        self._refused = Counter(
            "pdserve_router_admission_refused_total",
            "Requests refused at admission for load, by reason: ttft_budget (its predicted time to first "
            "token was over --admission-ttft-s or its deadline), queue_full (the router's queue), "
            "prefill_queue_full (--max-prefill-queue-tokens).",
            ["role", "reason"],
            registry=reg,
        )
        for refusal in REFUSAL_REASONS:
            self._refused.labels(ROLE, refusal)
        self.ttft_prediction = Histogram(
            "pdserve_router_ttft_prediction_ratio",
            "Actual over predicted time to first token of requests admitted under --admission-ttft-s (1: "
            "exact; above 1: the prediction was low).",
            ["role"],
            buckets=(0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0),
            registry=reg,
        ).labels(ROLE)
        self.kv_index_blocks = Gauge(
            "pdserve_router_kv_index_blocks",
            "Prefix-cache blocks the router's KV index holds for each worker (from the worker's events).",
            ["role", "worker"],
            registry=reg,
        )
        self.kv_index_gaps = Counter(
            "pdserve_router_kv_index_gaps_total",
            "Worker event batches the KV index could not apply (a gap or an unknown epoch): it dropped "
            "that worker's entries and asked for a snapshot.",
            ["role"],
            registry=reg,
        ).labels(ROLE)
        self.loop_stalls = Counter(
            LOOP_STALLS,
            "Times the router's event loop stood still past a heartbeat interval (deadlines moved).",
            ["role"],
            registry=reg,
        ).labels(ROLE)

    def watch(
        self,
        running: Callable[[], int],
        waiting: Callable[[], int],
        workers: Callable[[], Iterable[tuple[str, str]]],
    ) -> None:
        """Export the running/waiting/workers gauges from these readers (called once, at startup)."""
        self.registry.register(_StateCollector(running, waiting, workers))

    def refused(self, reason: str) -> None:
        """One request refused at admission for load (``reason``: one of ``REFUSAL_REASONS``)."""
        self._refused.labels(ROLE, reason).inc()

    def kv_index_size(self, worker_id: str, blocks: int | None) -> None:
        """The index's block count for a worker (None: it left; its series goes)."""
        if blocks is not None:
            self.kv_index_blocks.labels(ROLE, worker_id).set(blocks)
        else:
            try:
                self.kv_index_blocks.remove(ROLE, worker_id)
            except KeyError:
                pass

    def routed(self, route: Route) -> None:
        self._routes.labels(ROLE, route.reason.value).inc()
        if route.decode_cached_tokens and not route.decode_unused:
            self._predicted_cached.labels(ROLE, "decode").inc(route.decode_cached_tokens)
        if route.prefill_cached_tokens and route.prefill is not None:
            self._predicted_cached.labels(ROLE, "prefill").inc(route.prefill_cached_tokens)

    def finished(self, reason: str) -> None:
        self._requests.labels(ROLE, reason).inc()

    def migrated(self, reason: str) -> None:
        """One stream moved to another worker (``reason``: one of ``MIGRATION_REASONS``)."""
        self._migrations.labels(ROLE, reason).inc()

    def live_move(self, cause: str, outcome: str, seconds: float, kv_bytes: int) -> None:
        """One live move tried (``moves.LiveMove``): how it ended, how long it took, the KV it moved."""
        self._live_moves.labels(ROLE, cause, outcome).inc()
        if outcome == "moved":
            self._live_move_pause.observe(seconds)
            self._live_move_bytes.inc(kv_bytes)

    def rejected(self, code_name: str) -> None:
        """One request refused before admission with this gRPC status (``StatusCode.name``)."""
        self.finished("rejected")
        self._rejected.labels(ROLE, code_name).inc()

    @contextmanager
    def request(
        self, arrival: float, prompt_tokens: int, predicted_ttft_s: float = 0.0
    ) -> Iterator[RequestRecord]:
        """Record one admitted request from here to its end; exactly one ``requests_total`` count.
        ``predicted_ttft_s``: admission's prediction, checked against the TTFT it gets (0: none)."""
        rec = RequestRecord(self, arrival, predicted_ttft_s)
        self.prompt_tokens.inc(prompt_tokens)
        try:
            yield rec
        except BaseException as e:
            if not rec.finish_reason and getattr(e, "rejected", False):  # (no room within the queue's wait)
                rec.finish_reason = "rejected"
                self._rejected.labels(ROLE, e.code.name).inc()  # type: ignore[attr-defined]
            elif not rec.finish_reason:
                rec.finish_reason = outcome_of(e)
            raise
        finally:
            self.finished(rec.finish_reason or "error")


M = TypeVar("M", bound=_Message)


class RequestRecord:
    """One request's timing state; ``wrap`` observes what is written to the client, so the figures are the
    client's view whichever route the request took."""

    __slots__ = ("_m", "arrival", "last_token", "finish_reason", "predicted_ttft_s")

    def __init__(self, metrics: RouterMetrics, arrival: float, predicted_ttft_s: float = 0.0) -> None:
        self._m = metrics
        self.arrival = arrival
        self.predicted_ttft_s = predicted_ttft_s
        self.last_token: float | None = None
        self.finish_reason = ""

    def on_message(self, n_tokens: int, finish_reason: str, now: float) -> None:
        m = self._m
        if n_tokens:
            if self.last_token is None:
                m.ttft.observe(now - self.arrival)
                if self.predicted_ttft_s > 0:
                    m.ttft_prediction.observe((now - self.arrival) / self.predicted_ttft_s)
            else:
                m.itl.observe(now - self.last_token)
            self.last_token = now
        if finish_reason:
            self.finish_reason = finish_reason
            m.e2e.observe(now - self.arrival)

    def wrap(self, write: Callable[[M], Awaitable[bool | None]]) -> Callable[[M], Awaitable[None]]:
        """``write`` that also records each message (tokens, finish) once it went to the client: a write
        that fails records nothing. A ``write`` that returns False delivered nothing of the message
        (the HTTP front holds back text that may begin a stop string): its tokens are not a first token
        or an inter-token gap the client saw, so only the finish is recorded."""

        async def observed(resp: M) -> None:
            n = len(resp.token_ids)  # type: ignore[arg-type]
            now = time.monotonic()  # handed to the transport now
            try:
                delivered = await write(resp)
            except asyncio.CancelledError:
                # A client that cancels as the last message goes (it has what it needs: a loop that
                # breaks on finish_reason cancels at once) cut a finished request, not an aborted one.
                if resp.finish_reason:  # type: ignore[attr-defined]
                    self.on_message(n, resp.finish_reason, now)  # type: ignore[attr-defined]
                    self._m.generation_tokens.inc(n)
                raise
            self.on_message(n if delivered is not False else 0, resp.finish_reason, now)
            if n:
                # Counted once written: the counter is what clients actually received.
                self._m.generation_tokens.inc(n)

        return observed
