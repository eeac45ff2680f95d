"""The local cluster's autoscaler: ``pdserve autoscale`` (``up --autoscale`` runs it in the background).

Every ``interval_s`` (one ``Driver.tick``):
    read the state file (the cluster's processes), the router's GetClusterStatus (READY, STANDBY,
        DRAINING workers; queued prefill tokens, running, KV blocks) and its /metrics (TTFT and ITL
        histograms: the quantile of what arrived since the last tick)
    -> signals per pool -> ``router.autoscale.Autoscaler.decide`` (the pure policy) -> each decision:
        UP:   promote a warm (standby) worker: routed to at once; else start a cold one
        DOWN: drain one serving worker through the router: it takes no new request, finishes what
              it has, deregisters and exits (no request fails because of a scale-down)
    -> keep ``warm`` standby workers per pool: a promoted one is replaced in the background
    -> forget workers that exited; SIGTERM one whose drain outlived ``drain_timeout_s``
    -> metrics (decisions by pool, direction and reason; target, serving and standby sizes;
       seconds from an UP decision to serving, by source warm|cold) and ``<state-dir>/autoscaler.json``
       for ``pdserve status``

While it runs it owns the state file's ``workers`` (``pdserve scale`` refuses, ``down`` stops it
first). SIGTERM/SIGINT end it between ticks; the workers stay.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from pdserve.deploy.local import cluster, prometheus
from pdserve.proto import worker_pb2
from pdserve.router.autoscale import (
    AutoscaleConfig,
    Autoscaler,
    Decision,
    Direction,
    Pool,
    PoolSignals,
    possible_decisions,
    window_quantile,
)
from pdserve.worker.role import Role

log = logging.getLogger(__name__)
_STANDBY_OR_LOADING = (worker_pb2.WORKER_STATE_STANDBY, worker_pb2.WORKER_STATE_LOADING)

STATUS_FILE = "autoscaler.json"
ROLES = {Pool.PREFILL: Role.PREFILL, Pool.DECODE: Role.DECODE}
TTFT = "pdserve_time_to_first_token_seconds"
ITL = "pdserve_inter_token_latency_seconds"
_SCALE_UP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)


@dataclass(frozen=True)
class DriverConfig:
    state_dir: Path
    policy: AutoscaleConfig
    drain_timeout_s: float = 300.0  # a draining worker still alive after this is stopped by signal

    def __post_init__(self) -> None:
        if self.drain_timeout_s <= 0:
            raise ValueError("drain_timeout_s must be > 0")


class PoolStatus(msgspec.Struct, frozen=True):
    target: int
    serving: int
    starting: int
    standby: int
    draining: tuple[str, ...]


class DecisionRecord(msgspec.Struct, frozen=True):
    time_unix: float
    pool: str
    direction: str
    reason: str
    target: int
    worker_id: str  # promoted, started or drained
    detail: str


class AutoscalerStatus(msgspec.Struct, frozen=True):
    """``<state-dir>/autoscaler.json``: what ``pdserve status`` shows of the autoscaler."""

    pid: int
    metrics_url: str
    updated_unix: float
    pools: dict[str, PoolStatus]
    decisions: tuple[DecisionRecord, ...] = ()  # the latest, oldest first


def load_status(state_dir: Path) -> AutoscalerStatus | None:
    path = state_dir / STATUS_FILE
    try:
        return msgspec.json.decode(path.read_bytes(), type=AutoscalerStatus)
    except (OSError, msgspec.DecodeError):
        return None


class Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter(
            "pdserve_autoscaler_decisions_total",
            "Scaling decisions by pool, direction and reason.",
            ["pool", "direction", "reason"],
            registry=registry,
        )
        for pool, direction, reason in possible_decisions():  # series exist (at 0) before any decision
            self.decisions.labels(pool.value, direction.value, reason.value)
        self.target = Gauge(
            "pdserve_autoscaler_target_workers",
            "Workers the autoscaler wants per pool.",
            ["pool"],
            registry=registry,
        )
        self.current = Gauge(
            "pdserve_autoscaler_current_workers", "Workers serving per pool.", ["pool"], registry=registry
        )
        self.standby = Gauge(
            "pdserve_autoscaler_standby_workers",
            "Warm-pool workers loaded and ready to be promoted, per pool.",
            ["pool"],
            registry=registry,
        )
        self.scale_up = Histogram(
            "pdserve_autoscaler_scale_up_seconds",
            "Seconds from a scale-up decision until the new worker is routed to (source: warm | cold).",
            ["pool", "source"],
            buckets=_SCALE_UP_BUCKETS,
            registry=registry,
        )


@dataclass
class _Pending:
    """A scale-up not serving yet."""

    pool: Pool
    decided: float  # monotonic
    source: str  # warm | cold


class Driver:
    """One autoscaler: the policy plus what it has set in motion (scale-ups starting, drains)."""

    def __init__(self, config: DriverConfig, metrics: Metrics, metrics_url: str = "") -> None:
        self.config = config
        self.policy = Autoscaler(config.policy)
        self.metrics = metrics
        self.metrics_url = metrics_url
        self.pending: dict[str, _Pending] = {}
        self.draining: dict[str, float] = {}  # worker id -> when its drain was asked (monotonic)
        self.targets: dict[Pool, int] = {}
        self.history: list[DecisionRecord] = []
        self._hist: dict[str, dict[float, float]] = {}

    # ---- one tick -------------------------------------------------------------------------------

    def tick(self, now: float) -> list[Decision]:
        state = cluster.load_state(self.config.state_dir)
        if state is None:
            raise cluster.ClusterError(f"no cluster in {self.config.state_dir}")
        state = self._reap(state, now)
        status = cluster.cluster_status(
            state.router_address, token=cluster.state_token(state), tls=cluster.state_tls(state)
        )
        state = self._adopt_promotions(state, status)
        latency = self._latencies(status.metrics_url)
        signals = self.signals(state, status, latency)
        self._observe_serving(status, now)
        decisions = self.policy.decide(now, signals)
        for d in decisions:
            state = self._apply(state, status, d, now)
        state = self._keep_warm(state, status)
        if decisions:  # what is starting or draining now: the targets reported follow the decisions
            signals = self.signals(state, status, latency)
        self._report(state, status, signals)
        return decisions

    def signals(
        self,
        state: cluster.ClusterState,
        status: worker_pb2.ClusterStatus,
        latency: Mapping[Pool, float | None],
    ) -> dict[Pool, PoolSignals]:
        entries = {e.info.worker_id: e for e in status.workers}
        out = {}
        for pool, role in ROLES.items():
            procs = [w for w in state.workers if w.role is role and cluster.alive(w)]
            serving = [
                entries[w.id]
                for w in procs
                if w.id in entries
                and entries[w.id].load.state == worker_pb2.WORKER_STATE_READY
                and w.id not in self.draining
            ]
            # Standby workers loaded (registered as standby) or still loading: a replacement standby
            # counts from its spawn, as a starting worker does.
            standby = [
                w
                for w in procs
                if w.standby and (w.id not in entries or entries[w.id].load.state in _STANDBY_OR_LOADING)
            ]
            # Loading, not registered yet, or promoted out of the warm pool but not READY yet.
            coming = (worker_pb2.WORKER_STATE_LOADING, worker_pb2.WORKER_STATE_STANDBY)
            starting = [
                w
                for w in procs
                if not w.standby
                and w.id not in self.draining
                and (w.id not in entries or entries[w.id].load.state in coming)
            ]
            draining = tuple(w.id for w in procs if w.id in self.draining)
            loads = [e.load for e in serving]
            kv_total = sum(ld.kv_blocks_total for ld in loads)
            max_running = sum(e.info.max_running for e in serving)
            out[pool] = PoolSignals(
                serving=len(serving),
                starting=len(starting),
                draining=draining,
                standby=len(standby),
                queued_prefill_tokens=sum(ld.queued_prefill_tokens for ld in loads),
                kv_usage=sum(ld.kv_blocks_used for ld in loads) / kv_total if kv_total else 0.0,
                running_ratio=sum(ld.running + ld.queued for ld in loads) / max_running
                if max_running
                else 0.0,
                router_waiting=status.requests_waiting if pool is Pool.DECODE else 0,
                latency_s=latency.get(pool),
            )
        return out

    # ---- actions --------------------------------------------------------------------------------

    def _apply(
        self, state: cluster.ClusterState, status: worker_pb2.ClusterStatus, d: Decision, now: float
    ) -> cluster.ClusterState:
        role = ROLES[d.pool]
        self.targets[d.pool] = d.target
        wid = ""
        if d.direction is Direction.UP:
            state, wid = self._scale_up(state, status, d.pool, role, now)
        else:
            wid = self._scale_down(state, status, role, now)
        self.metrics.decisions.labels(d.pool.value, d.direction.value, d.reason.value).inc()
        record = DecisionRecord(
            time.time(), d.pool.value, d.direction.value, d.reason.value, d.target, wid, d.detail
        )
        self.history = [*self.history[-19:], record]
        log.info(
            "%s %s to %d (%s: %s): %s",
            d.pool.value,
            d.direction.value,
            d.target,
            d.reason.value,
            d.detail,
            wid or "-",
        )
        return state

    def _scale_up(
        self,
        state: cluster.ClusterState,
        status: worker_pb2.ClusterStatus,
        pool: Pool,
        role: Role,
        now: float,
    ) -> tuple[cluster.ClusterState, str]:
        entries = {e.info.worker_id: e for e in status.workers}
        warm = [w for w in state.workers if w.role is role and w.standby and cluster.alive(w)]
        # A loaded standby first; one still loading is still closer to serving than a cold start.
        warm.sort(
            key=lambda w: w.id not in entries or entries[w.id].load.state != worker_pb2.WORKER_STATE_STANDBY
        )
        token, tls = cluster.state_token(state), cluster.state_tls(state)
        for w in warm:
            try:
                resp = cluster.promote_worker(state.router_address, w.id, token, tls)
            except grpc.RpcError as e:
                log.warning("could not promote %s: %s", w.id, e.code().name)
                continue
            if not resp.found and w.id in entries:
                continue
            state = cluster.replace_worker(state, msgspec.structs.replace(w, standby=False))
            cluster.save_state(self.config.state_dir, state)
            if resp.serving:
                self.metrics.scale_up.labels(pool.value, "warm").observe(time.monotonic() - now)
            else:
                self.pending[w.id] = _Pending(pool, now, "warm")
            return state, w.id
        before = {w.id for w in state.workers}
        state = cluster.spawn_workers(self.config.state_dir, state, role, 1)
        cluster.save_state(self.config.state_dir, state)
        wid = next(w.id for w in state.workers if w.id not in before)
        self.pending[wid] = _Pending(pool, now, "cold")
        return state, wid

    def _scale_down(
        self, state: cluster.ClusterState, status: worker_pb2.ClusterStatus, role: Role, now: float
    ) -> str:
        live = {w.id for w in state.workers if w.role is role and not w.standby and cluster.alive(w)}
        ready = [
            e
            for e in status.workers
            if e.info.worker_id in live
            and e.info.worker_id not in self.draining
            and e.load.state == worker_pb2.WORKER_STATE_READY
        ]
        if not ready:
            return ""
        # The least loaded, then the newest (ids end in a counter that only grows).
        victim = min(ready, key=lambda e: (e.load.running + e.load.queued, -_index(e.info.worker_id)))
        wid = victim.info.worker_id
        try:
            found = cluster.drain_worker(
                state.router_address, wid, cluster.state_token(state), cluster.state_tls(state)
            )
        except grpc.RpcError as e:
            log.warning("could not drain %s: %s", wid, e.code().name)
            return ""
        if found:
            self.draining[wid] = now
        return wid

    def _keep_warm(
        self, state: cluster.ClusterState, status: worker_pb2.ClusterStatus
    ) -> cluster.ClusterState:
        for pool, role in ROLES.items():
            want = self.config.policy.bounds(pool).warm
            have = sum(1 for w in state.workers if w.role is role and w.standby and cluster.alive(w))
            if have < want:
                state = cluster.spawn_workers(self.config.state_dir, state, role, want - have, standby=True)
                cluster.save_state(self.config.state_dir, state)
                log.info("%s warm pool: starting %d standby worker(s)", pool.value, want - have)
        return state

    def _reap(self, state: cluster.ClusterState, now: float) -> cluster.ClusterState:
        """Forget exited workers; stop drains that outlived their timeout."""
        state, gone = cluster.live_workers(state)
        for w in gone:
            self.draining.pop(w.id, None)
            self.pending.pop(w.id, None)
            log.info("%s (pid %d) exited", w.id, w.pid)
        stuck = [
            w
            for w in state.workers
            if w.id in self.draining and now - self.draining[w.id] > self.config.drain_timeout_s
        ]
        if stuck:
            log.warning("drain timed out: stopping %s by signal", ", ".join(w.id for w in stuck))
            cluster.cut_drains(stuck)
            state, _ = cluster.live_workers(state)
        if gone or stuck:
            cluster.save_state(self.config.state_dir, state)
        return state

    def _adopt_promotions(
        self, state: cluster.ClusterState, status: worker_pb2.ClusterStatus
    ) -> cluster.ClusterState:
        """Standby workers the router promoted serve now: so recorded, the warm pool gets a replacement
        and they can be scaled down like any other (``cluster.adopt_promotions``)."""
        state, adopted = cluster.adopt_promotions(state, status)
        for w in adopted:
            log.info("%s was promoted by the router (its pool had no serving worker left)", w.id)
        if adopted:
            cluster.save_state(self.config.state_dir, state)
        return state

    def _observe_serving(self, status: worker_pb2.ClusterStatus, now: float) -> None:
        """Scale-ups that became READY since the last tick (their time is known to a tick)."""
        ready = {e.info.worker_id for e in status.workers if e.load.state == worker_pb2.WORKER_STATE_READY}
        for wid in [w for w in self.pending if w in ready]:
            p = self.pending.pop(wid)
            self.metrics.scale_up.labels(p.pool.value, p.source).observe(now - p.decided)
            log.info("%s serving %.2fs after the scale-up (%s)", wid, now - p.decided, p.source)

    # ---- signals from the router's /metrics -------------------------------------------------------

    def _latencies(self, url: str) -> dict[Pool, float | None]:
        """The TTFT (prefill) and ITL (decode) quantile over what the router observed since last tick."""
        if not url:
            return {}
        try:
            with urllib.request.urlopen(url, timeout=2.0) as resp:
                text = resp.read().decode()
            now = _buckets(text, (TTFT, ITL))
        except (OSError, http.client.HTTPException, ValueError) as e:  # (a body cut short: no sample)
            log.warning("router metrics at %s: %r", url, e)
            return {}
        q = self.config.policy.latency_quantile
        out = {
            Pool.PREFILL: window_quantile(self._hist.get(TTFT, {}), now.get(TTFT, {}), q)
            if self._hist
            else None,
            Pool.DECODE: window_quantile(self._hist.get(ITL, {}), now.get(ITL, {}), q)
            if self._hist
            else None,
        }
        self._hist = now
        return out

    # ---- what it shows ----------------------------------------------------------------------------

    def _report(
        self,
        state: cluster.ClusterState,
        status: worker_pb2.ClusterStatus,
        signals: Mapping[Pool, PoolSignals],
    ) -> None:
        pools = {}
        for pool, s in signals.items():
            target = self.targets.setdefault(pool, s.size)
            if not s.starting and not s.draining:
                target = self.targets[pool] = s.size  # settled (or a worker died): the target follows
            self.metrics.target.labels(pool.value).set(target)
            self.metrics.current.labels(pool.value).set(s.serving)
            self.metrics.standby.labels(pool.value).set(s.standby)
            pools[pool.value] = PoolStatus(target, s.serving, s.starting, s.standby, s.draining)
        doc = AutoscalerStatus(os.getpid(), self.metrics_url, time.time(), pools, tuple(self.history))
        path = self.config.state_dir / STATUS_FILE
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(msgspec.json.encode(doc))
        os.replace(tmp, path)


def _index(worker_id: str) -> int:
    tail = worker_id.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def _buckets(text: str, names: tuple[str, ...]) -> dict[str, dict[float, float]]:
    """Cumulative bucket counts (upper bound -> count) of the named histograms, summed over labels."""
    out: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in names:
            continue
        buckets = out.setdefault(family.name, {})
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                ub = float(sample.labels["le"])
                buckets[ub] = buckets.get(ub, 0.0) + sample.value
    return out


@contextlib.contextmanager
def _scraped(state_dir: Path, url: str) -> Iterator[None]:
    """Listed in the cluster's Prometheus targets while the block runs."""
    prometheus.write_autoscaler_target(state_dir, url)
    try:
        yield
    finally:
        prometheus.write_autoscaler_target(state_dir, "")


def run(config: DriverConfig, host: str = "127.0.0.1", metrics_port: int = 0) -> int:
    """Tick until SIGTERM/SIGINT; the workers stay as they are."""
    from pdserve.telemetry.exporter import process_registry, serve_metrics

    registry = process_registry("autoscaler", gpu=False)  # pdserve_info and process_* like every process
    metrics = Metrics(registry)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with serve_metrics(registry, host, metrics_port) as endpoint, _scraped(config.state_dir, endpoint.url):
        driver = Driver(config, metrics, endpoint.url)
        log.info("autoscaler: %s; metrics at %s", config.policy, endpoint.url)
        while not stop.is_set():
            started = time.monotonic()
            try:
                # Held for the tick: a `scale`, `drain` or `down` changing the state file meanwhile would
                # lose its change to this tick's, or this tick's to its.
                with cluster.state_lock(config.state_dir):
                    driver.tick(started)
            except cluster.StateBusy:
                log.info("another pdserve command is changing the cluster; next tick")
            except grpc.RpcError as e:
                log.warning("router unreachable (%s); next tick", e.code().name)
            except cluster.ClusterError as e:
                log.error("%s; stopping", e)
                return 1
            except Exception:  # noqa: BLE001 - one bad tick must not end the autoscaling
                log.exception("autoscaler tick failed; next tick")
            stop.wait(max(config.policy.interval_s - (time.monotonic() - started), 0.0))
    log.info("autoscaler stopped")
    return 0
