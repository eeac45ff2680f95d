"""A decode (or colocated) worker's Prometheus metrics, labelled with its role (``decode`` or ``both``): KV
cache usage, decode batch size and step time, preemptions, its local prefills' forward time and tokens, and
its prefix cache."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.engine.scheduler import Batch, BatchKind
from pdserve.telemetry.prefill import PrefillForwardMetrics
from pdserve.telemetry.prefix_cache import PrefixCacheMetrics
from pdserve.telemetry.slo import BATCH_SIZE_BUCKETS, STEP_BUCKETS

KV_CACHE_USAGE = "pdserve_kv_cache_usage_ratio"
DECODE_BATCH_SIZE = "pdserve_decode_batch_size"
DECODE_STEP = "pdserve_decode_step_seconds"
DECODE_PREEMPTIONS = "pdserve_decode_preemptions_total"
DECODE_ROLES = ("decode", "both")


class DecodeMetrics:
    """One per worker, on its process registry (``telemetry.exporter.process_registry``)."""

    def __init__(self, registry: CollectorRegistry, role: str = "decode") -> None:
        if role not in DECODE_ROLES:
            raise ValueError(f"role must be one of {DECODE_ROLES}, got {role!r}")
        self.registry = registry
        self.kv_usage = Gauge(
            KV_CACHE_USAGE,
            "Fraction of this worker's KV cache blocks in use (0-1).",
            ["role"],
            registry=registry,
        ).labels(role)
        self.batch_size = Histogram(
            DECODE_BATCH_SIZE,
            "Requests in one engine step.",
            ["role"],
            buckets=BATCH_SIZE_BUCKETS,
            registry=registry,
        ).labels(role)
        self.step_seconds = Histogram(
            DECODE_STEP,
            "Wall time of one engine step that decodes (one forward of the running batch).",
            ["role"],
            buckets=STEP_BUCKETS,
            registry=registry,
        ).labels(role)
        self.preemptions = Counter(
            DECODE_PREEMPTIONS,
            "Sequences preempted for want of KV blocks (their work is recomputed).",
            ["role"],
            registry=registry,
        ).labels(role)
        self._preemptions_seen = 0
        self.refused_full = Counter(
            "pdserve_worker_requests_refused_full",
            "Requests this worker refused because it held --max-running plus --max-queued already "
            "(the router routes them again).",
            ["role"],
            registry=registry,
        ).labels(role)
        self.prefill = PrefillForwardMetrics(registry, role)
        self.prefix_cache = PrefixCacheMetrics(registry, role)

    def observe_step(self, seconds: float, batch_size: int) -> None:
        self.step_seconds.observe(seconds)
        self.batch_size.observe(batch_size)

    def observe_batch(self, seconds: float, batch: Batch) -> None:
        """One engine step that ran ``batch``, called on the engine thread (prometheus_client's metrics are
        thread-safe). A step that decodes, alone or mixed with prefill chunks, counts at its decode batch
        size; one that only prefills goes to the prefill forward metrics."""
        if batch.kind is BatchKind.PREFILL:
            self.prefill.observe_prefill(seconds, batch.num_tokens)
            return
        decodes = len(batch.items) if batch.kind is BatchKind.DECODE else batch.decodes
        self.observe_step(seconds, decodes)
        if decodes < len(batch.items):  # a mixed step's prefill chunks: their tokens, not its time
            self.prefill.tokens.inc(batch.num_tokens - decodes)

    def set_kv_usage(self, used_blocks: int, total_blocks: int) -> None:
        """Set at every load report: that also covers an idle worker whose blocks an abort freed after its
        last step."""
        self.kv_usage.set(used_blocks / total_blocks if total_blocks > 0 else 0.0)

    def set_preemptions(self, total: int) -> None:
        """Advance the counter to the scheduler's running total (which only grows), at every load report."""
        if total > self._preemptions_seen:
            self.preemptions.inc(total - self._preemptions_seen)
            self._preemptions_seen = total
