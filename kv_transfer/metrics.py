"""Prometheus metrics of the KV transfer. Pure: prometheus_client only. Senders and receivers given the
same registry (a colocated worker's) share one set of families, told apart by the ``role`` label.
"""

from __future__ import annotations

import threading
import weakref
from enum import StrEnum

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.kv_transfer.errors import FailureReason

_TRANSFER_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
_LAYER_BUCKETS = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5,
)  # fmt: skip
_WRITE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)


# How a transfer's KV moves (pdserve_kv_transfer_opened_total's path label; the sender knows it at open).
TRANSFER_PATHS = ("puts", "cross_memory", "shared_memory", "cuda_ipc", "tagged")


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


class _Families:
    """The metric families of one registry, shared by every sender and receiver on it."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.bytes = Counter(
            "pdserve_kv_transfer_bytes_total",
            "KV bytes moved: by the prefill side as it sends them (partial transfers included); by the "
            "decode side as they land for tagged pushes, and at completion for one-sided writes, whose "
            "bytes of an aborted transfer it never counts.",
            ["role"],
            registry=registry,
        )
        self.skipped = Counter(
            "pdserve_kv_transfer_bytes_not_sent_total",
            "KV bytes of completed transfers that did not move because the decode worker already held "
            "them (its prefix cache), counted by the decode side.",
            ["role"],
            registry=registry,
        )
        self.seconds = Histogram(
            "pdserve_kv_transfer_seconds",
            "Duration of successful transfers (prefill: open to acknowledged completion; "
            "decode: Open message to last byte and completion message).",
            ["role"],
            buckets=_TRANSFER_BUCKETS,
            registry=registry,
        )
        self.failures = Counter(
            "pdserve_kv_transfer_failures_total",
            "Failed transfers by reason.",
            ["role", "reason"],
            registry=registry,
        )
        self.layer = Histogram(
            "pdserve_kv_transfer_layer_seconds",
            "Per layer message latency on the prefill side: push_layer call to every message of "
            "that layer completed (for rendezvous-sized messages: landed in the decode worker).",
            ["role"],
            buckets=_LAYER_BUCKETS,
            registry=registry,
        )
        self.paths = Counter(
            "pdserve_kv_transfer_opened_total",
            "Transfers opened, by how their KV moves: puts (one-sided UCX puts into the decode worker's "
            "KV cache), cross_memory (one-sided writes on one host, process_vm_writev), shared_memory "
            "(copies into a KV cache both processes map, --kv-shared-memory), cuda_ipc (device copies "
            "into the decode GPU's KV cache through CUDA IPC), tagged (messages).",
            ["role", "path"],
            registry=registry,
        )
        self.settle_timeouts = Counter(
            "pdserve_kv_transfer_settle_timeouts_total",
            "Failed transfers whose in-flight messages did not settle within the settle timeout and were "
            "cancelled (a stalled link or peer), counted by the side that gave up waiting.",
            ["role"],
            registry=registry,
        )
        self.writes = Histogram(
            "pdserve_kv_transfer_writes_per_layer",
            "Writes one layer of a completed transfer took on the prefill side (a write: one tagged "
            "message, UCX put or scatter-gather entry): one per run of blocks consecutive on both sides, "
            "and between tensor-parallel groups of different sizes one per rank pair and run.",
            ["role"],
            buckets=_WRITE_BUCKETS,
            registry=registry,
        )
        self.inflight = Gauge(
            "pdserve_kv_transfer_inflight",
            "Transfers currently reserved or open.",
            ["role"],
            registry=registry,
        )


_families: weakref.WeakKeyDictionary[CollectorRegistry, _Families] = weakref.WeakKeyDictionary()
_families_lock = threading.Lock()


class TransferMetrics:
    """One role's view. Receivers count bytes landed; senders count bytes sent."""

    def __init__(self, role: Role, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.role = role
        with _families_lock:
            fam = _families.get(self.registry)
            if fam is None:
                fam = _families[self.registry] = _Families(self.registry)
        self._bytes = fam.bytes.labels(role=role.value)
        self._skipped = fam.skipped.labels(role=role.value)
        self._seconds = fam.seconds.labels(role=role.value)
        self._failures = fam.failures
        self._layer = fam.layer.labels(role=role.value)
        self._inflight = fam.inflight.labels(role=role.value)
        self._settle_timeouts = fam.settle_timeouts.labels(role=role.value)
        self._writes = fam.writes.labels(role=role.value)
        # Create every reason's series up front so dashboards see zeros, not gaps.
        for reason in FailureReason:
            self._failures.labels(role=role.value, reason=reason.value)
        self._paths = {path: fam.paths.labels(role=role.value, path=path) for path in TRANSFER_PATHS}

    def add_bytes(self, n: int) -> None:
        self._bytes.inc(n)

    def add_not_sent(self, n: int) -> None:
        self._skipped.inc(n)

    def transfer_done(self, seconds: float) -> None:
        self._seconds.observe(seconds)

    def transfer_failed(self, reason: FailureReason) -> None:
        self._failures.labels(role=self.role.value, reason=reason.value).inc()

    def settle_timed_out(self) -> None:
        self._settle_timeouts.inc()

    def writes_per_layer(self, n: int) -> None:
        self._writes.observe(n)

    def layer_done(self, seconds: float) -> None:
        self._layer.observe(seconds)

    def opened(self, path: str | None = None) -> None:
        """A transfer opened; ``path`` (one of ``TRANSFER_PATHS``) where this side knows how it moves."""
        self._inflight.inc()
        if path is not None:
            self._paths[path].inc()

    def closed(self) -> None:
        self._inflight.dec()
