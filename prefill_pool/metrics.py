"""A prefill worker's Prometheus metrics: prefill forward time, tokens prefilled, queued tokens.

The worker creates one ``PrefillMetrics`` on its process registry
(``telemetry.exporter.process_registry``) and calls:

- ``observe_prefill(seconds, tokens)`` after every batched prefill forward
  (its wall time and the prompt tokens it covered);
- ``set_queue_tokens(n)`` whenever it computes its queued prefill tokens
  (every heartbeat's load report).

The KV transfer's own metrics (bytes, seconds, failures) are made by
``kv_transfer`` on the same registry. Series carry ``role="prefill"``. The forward time and tokens
are ``telemetry.prefill``'s, which decode and colocated workers use for their local prefills.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from pdserve.telemetry.prefill import PREFILL_TIME, PREFILL_TOKENS, PrefillForwardMetrics

__all__ = ["PREFILL_QUEUE_TOKENS", "PREFILL_TIME", "PREFILL_TOKENS", "PrefillMetrics"]

PREFILL_QUEUE_TOKENS = "pdserve_prefill_queue_tokens"
ROLE = "prefill"


class PrefillMetrics(PrefillForwardMetrics):
    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(registry, ROLE)
        self.queue_tokens = Gauge(
            PREFILL_QUEUE_TOKENS,
            "Prompt tokens queued or being prefilled on this worker.",
            ["role"],
            registry=registry,
        ).labels(ROLE)

    def set_queue_tokens(self, n: int) -> None:
        self.queue_tokens.set(n)
