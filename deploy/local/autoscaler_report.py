"""What the local autoscaler shows: its Prometheus metrics and ``<state-dir>/autoscaler.json``, the status
file ``pdserve status`` reads."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.router.autoscale import possible_decisions

STATUS_FILE = "autoscaler.json"
_SCALE_UP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)


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


def save_status(state_dir: Path, doc: AutoscalerStatus) -> None:
    """Atomic: ``pdserve status`` reads the old file or the new one."""
    path = state_dir / STATUS_FILE
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(msgspec.json.encode(doc))
    os.replace(tmp, path)


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
