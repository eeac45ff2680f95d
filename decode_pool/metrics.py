"""A decode (or colocated) worker's Prometheus metrics, labelled with its role (``decode`` or ``both``): KV
cache usage, decode batch size and step time, preemptions, its local prefills' forward time and tokens, and
its prefix cache, and its speculative decoding (proposed and accepted tokens, verify forwards)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.engine.scheduler import Batch, BatchKind
from pdserve.engine.speculative import SpeculationStats
from pdserve.telemetry.prefill import PrefillForwardMetrics
from pdserve.telemetry.prefix_cache import PrefixCacheMetrics
from pdserve.telemetry.slo import BATCH_SIZE_BUCKETS, STEP_BUCKETS

KV_CACHE_USAGE = "pdserve_kv_cache_usage_ratio"
DECODE_BATCH_SIZE = "pdserve_decode_batch_size"
DECODE_STEP = "pdserve_decode_step_seconds"
DECODE_PREEMPTIONS = "pdserve_decode_preemptions_total"
DECODE_ROLES = ("decode", "both")
SPEC_VERIFY_STEPS = "pdserve_spec_decode_verify_steps"
SPEC_DRAFT_TOKENS = "pdserve_spec_decode_num_draft_tokens"
SPEC_ACCEPTED_TOKENS = "pdserve_spec_decode_num_accepted_tokens"
SPEC_EMITTED_TOKENS = "pdserve_spec_decode_num_emitted_tokens"
SPEC_DRAFTS = "pdserve_spec_decode_num_drafts"


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
        self.streams_moved_out = Counter(
            "pdserve_worker_streams_moved_out",
            "Decoding streams this worker moved live to another worker (their KV exported).",
            ["role"],
            registry=registry,
        ).labels(role)
        self.moved_out_bytes = Counter(
            "pdserve_worker_streams_moved_out_kv_bytes",
            "KV bytes this worker wrote to other workers moving its streams live.",
            ["role"],
            registry=registry,
        ).labels(role)
        self.prefill = PrefillForwardMetrics(registry, role)
        self.prefix_cache = PrefixCacheMetrics(registry, role)
        # Speculative decoding (vLLM's spec_decode counters in spirit): the acceptance rate is
        # accepted / proposed, the mean accepted length emitted / streams verified.
        spec = {
            "verify_steps": (SPEC_VERIFY_STEPS, "Decode steps that verified proposals."),
            "proposed_tokens": (SPEC_DRAFT_TOKENS, "Tokens proposed for verification."),
            "accepted_tokens": (SPEC_ACCEPTED_TOKENS, "Proposed tokens accepted."),
            "emitted_tokens": (
                SPEC_EMITTED_TOKENS,
                "Tokens streams got from verify forwards: accepted proposals plus one sampled each.",
            ),
            "streams_verified": (
                SPEC_DRAFTS,
                "Proposals verified (one per stream per verify forward it proposed in).",
            ),
        }
        self.spec = {
            field: Counter(name, doc, ["role"], registry=registry).labels(role)
            for field, (name, doc) in spec.items()
        }
        self._spec_seen = SpeculationStats()

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

    def set_speculation(self, stats: SpeculationStats) -> None:
        """Advance the speculative decoding counters to the engine's running totals, at every load
        report."""
        seen = self._spec_seen
        for field, counter in self.spec.items():
            total, before = getattr(stats, field), getattr(seen, field)
            if total > before:
                counter.inc(total - before)
                setattr(seen, field, total)

    def migrated_out(self, kv_bytes: int) -> None:
        self.streams_moved_out.inc()
        self.moved_out_bytes.inc(kv_bytes)

    def set_kv_usage(self, used_blocks: int, total_blocks: int) -> None:
        """Set at every load report: that also covers an idle worker whose blocks an abort freed after its
        last step."""
        self.kv_usage.set(used_blocks / total_blocks if total_blocks > 0 else 0.0)

    def set_preemptions(self, total: int) -> None:
        """Advance the counter to the scheduler's running total (which only grows), at every load report."""
        if total > self._preemptions_seen:
            self.preemptions.inc(total - self._preemptions_seen)
            self._preemptions_seen = total
