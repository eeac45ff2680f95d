"""The local cluster's autoscaler (``pdserve autoscale``; ``up --autoscale`` runs it in the background):
each tick reads the pools' signals, asks the policy (``router.autoscale``) and applies its decisions
through a ``ClusterControl``."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc
import msgspec

from pdserve.deploy.local import cluster, prometheus
from pdserve.deploy.local.autoscaler_report import (
    AutoscalerStatus,
    DecisionRecord,
    Metrics,
    PoolStatus,
    load_status,
    save_status,
)
from pdserve.deploy.local.autoscaler_signals import ROLES, LatencyWindow, pool_signals
from pdserve.proto import worker_pb2
from pdserve.router.autoscale import AutoscaleConfig, Autoscaler, Decision, Direction, Pool, PoolSignals
from pdserve.worker.role import Role

# (``pdserve status`` and the tests find the status file's reader and the metrics here too.)
__all__ = ["ClusterControl", "Driver", "DriverConfig", "Metrics", "load_status", "run"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DriverConfig:
    state_dir: Path
    policy: AutoscaleConfig
    drain_timeout_s: float = 300.0  # a draining worker still alive after this is stopped by signal

    def __post_init__(self) -> None:
        if self.drain_timeout_s <= 0:
            raise ValueError("drain_timeout_s must be > 0")


class ClusterControl(Protocol):
    """What the autoscaler does to its cluster (``cluster.LocalControl`` is the real one)."""

    def load(self) -> cluster.ClusterState:
        """The state file (ClusterError: there is no cluster)."""
        ...

    def save(self, state: cluster.ClusterState) -> None: ...

    def alive(self, worker: cluster.ProcessEntry) -> bool: ...

    def status(self, state: cluster.ClusterState) -> worker_pb2.ClusterStatus:
        """The router's GetClusterStatus."""
        ...

    def start(
        self, state: cluster.ClusterState, role: Role, count: int, *, standby: bool = False
    ) -> cluster.ClusterState:
        """Start ``count`` workers of ``role`` (into the warm pool when ``standby``); returns the state
        listing them."""
        ...

    def promote(self, state: cluster.ClusterState, worker_id: str) -> worker_pb2.PromoteWorkerResponse:
        """The router's PromoteWorker: a warm-pool worker taken into routing."""
        ...

    def drain(self, state: cluster.ClusterState, worker_id: str) -> bool:
        """The router's DrainWorker; False: the router does not know the worker."""
        ...

    def cut(self, workers: Sequence[cluster.ProcessEntry]) -> None:
        """Stop workers whose drain outlived its time, cutting what they still run."""
        ...


@dataclass
class _Pending:
    """A scale-up not serving yet."""

    pool: Pool
    decided: float  # monotonic
    source: str  # warm | cold


class Driver:
    """One autoscaler: the policy plus what it has set in motion (scale-ups starting, drains)."""

    def __init__(
        self, config: DriverConfig, metrics: Metrics, control: ClusterControl, metrics_url: str = ""
    ) -> None:
        self.config = config
        self.control = control
        self.policy = Autoscaler(config.policy)
        self.metrics = metrics
        self.metrics_url = metrics_url
        self.pending: dict[str, _Pending] = {}
        self.draining: dict[str, float] = {}  # worker id -> when its drain was asked (monotonic)
        self.targets: dict[Pool, int] = {}
        self.history: list[DecisionRecord] = []
        self.latency = LatencyWindow(config.policy.latency_quantile)

    # ---- one tick -------------------------------------------------------------------------------

    def tick(self, now: float) -> list[Decision]:
        """Read the cluster (state file, the router's status and latency histograms), decide, act, keep
        the warm pools full, and write what it shows (metrics, ``autoscaler.json``)."""
        state = self._reap(self.control.load(), now)
        status = self.control.status(state)
        state = self._adopt_promotions(state, status)
        latency = self.latency.read(status.metrics_url)
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
        live = [w for w in state.workers if self.control.alive(w)]
        return pool_signals(live, status, latency, self.draining)

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
        warm = [w for w in state.workers if w.role is role and w.standby and self.control.alive(w)]
        # A loaded standby first; one still loading is still closer to serving than a cold start.
        warm.sort(
            key=lambda w: w.id not in entries or entries[w.id].load.state != worker_pb2.WORKER_STATE_STANDBY
        )
        for w in warm:
            try:
                resp = self.control.promote(state, w.id)
            except grpc.RpcError as e:
                log.warning("could not promote %s: %s", w.id, e.code().name)
                continue
            if not resp.found and w.id in entries:
                continue
            state = cluster.replace_worker(state, msgspec.structs.replace(w, standby=False))
            self.control.save(state)
            if resp.serving:
                self.metrics.scale_up.labels(pool.value, "warm").observe(time.monotonic() - now)
            else:
                self.pending[w.id] = _Pending(pool, now, "warm")
            return state, w.id
        before = {w.id for w in state.workers}
        state = self.control.start(state, role, 1)
        self.control.save(state)
        wid = next(w.id for w in state.workers if w.id not in before)
        self.pending[wid] = _Pending(pool, now, "cold")
        return state, wid

    def _scale_down(
        self, state: cluster.ClusterState, status: worker_pb2.ClusterStatus, role: Role, now: float
    ) -> str:
        """Drain one serving worker (its id; "" for none): it takes no new request and finishes what it
        has, so no request fails because of a scale-down."""
        live = {w.id for w in state.workers if w.role is role and not w.standby and self.control.alive(w)}
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
            found = self.control.drain(state, wid)
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
            have = sum(1 for w in state.workers if w.role is role and w.standby and self.control.alive(w))
            if have < want:
                state = self.control.start(state, role, want - have, standby=True)
                self.control.save(state)
                log.info("%s warm pool: starting %d standby worker(s)", pool.value, want - have)
        return state

    def _reap(self, state: cluster.ClusterState, now: float) -> cluster.ClusterState:
        """Forget exited workers; stop drains that outlived their timeout."""
        gone = [w for w in state.workers if not self.control.alive(w)]
        state = cluster.without_workers(state, gone)
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
            self.control.cut(stuck)
            state = cluster.without_workers(state, [w for w in state.workers if not self.control.alive(w)])
        if gone or stuck:
            self.control.save(state)
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
            self.control.save(state)
        return state

    def _observe_serving(self, status: worker_pb2.ClusterStatus, now: float) -> None:
        """Scale-ups that became READY since the last tick (their time is known to a tick)."""
        ready = {e.info.worker_id for e in status.workers if e.load.state == worker_pb2.WORKER_STATE_READY}
        for wid in [w for w in self.pending if w in ready]:
            p = self.pending.pop(wid)
            self.metrics.scale_up.labels(p.pool.value, p.source).observe(now - p.decided)
            log.info("%s serving %.2fs after the scale-up (%s)", wid, now - p.decided, p.source)

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
        save_status(self.config.state_dir, doc)


def _index(worker_id: str) -> int:
    tail = worker_id.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0


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
        driver = Driver(config, metrics, cluster.LocalControl(config.state_dir), endpoint.url)
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
