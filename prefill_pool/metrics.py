"""A prefill worker's Prometheus metrics (``role="prefill"``): forward time and prompt tokens
(``telemetry.prefill``'s, shared with decode workers' local prefills) and queued prompt tokens. The KV
transfer's own metrics come from ``kv_transfer``, on the same registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from pdserve.telemetry.prefill import PREFILL_TIME, PREFILL_TOKENS, PrefillForwardMetrics
from pdserve.telemetry.prefix_cache import PrefixCacheMetrics

__all__ = ["PREFILL_QUEUE_TOKENS", "PREFILL_TIME", "PREFILL_TOKENS", "PrefillMetrics"]

PREFILL_QUEUE_TOKENS = "pdserve_prefill_queue_tokens"
ROLE = "prefill"


class PrefillMetrics(PrefillForwardMetrics):
    """One per worker, on its process registry (``telemetry.exporter.process_registry``); the loop calls
    ``observe_prefill`` after every batched forward."""

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(registry, ROLE)
        self.queue_tokens = Gauge(
            PREFILL_QUEUE_TOKENS,
            "Prompt tokens queued or being prefilled on this worker.",
            ["role"],
            registry=registry,
        ).labels(ROLE)
        self.prefix_cache = PrefixCacheMetrics(registry, ROLE)

    def set_queue_tokens(self, n: int) -> None:
        """Set at every load report (each heartbeat), when the worker counts its queued tokens."""
        self.queue_tokens.set(n)
