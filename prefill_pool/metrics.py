"""A prefill worker's Prometheus metrics: prefill forward time, tokens prefilled, queued tokens.

The worker creates one ``PrefillMetrics`` on its process registry
(``telemetry.exporter.process_registry``) and calls:

- ``observe_prefill(seconds, tokens)`` after every batched prefill forward
  (its wall time and the prompt tokens it covered);
- ``set_queue_tokens(n)`` whenever it computes its queued prefill tokens
  (every heartbeat's load report).

The KV transfer's own metrics (bytes, seconds, failures) are made by
``kv_transfer`` on the same registry. Series carry ``role="prefill"``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.telemetry.slo import STEP_BUCKETS

PREFILL_TIME = "pdserve_prefill_time_seconds"
PREFILL_QUEUE_TOKENS = "pdserve_prefill_queue_tokens"
PREFILL_TOKENS = "pdserve_prefill_tokens_total"
ROLE = "prefill"


class PrefillMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.prefill_time = Histogram(
            PREFILL_TIME,
            "Wall time of one batched prefill forward.",
            ["role"],
            buckets=STEP_BUCKETS,
            registry=registry,
        ).labels(ROLE)
        self.tokens = Counter(PREFILL_TOKENS, "Prompt tokens prefilled.", ["role"], registry=registry).labels(
            ROLE
        )
        self.queue_tokens = Gauge(
            PREFILL_QUEUE_TOKENS,
            "Prompt tokens queued or being prefilled on this worker.",
            ["role"],
            registry=registry,
        ).labels(ROLE)

    def observe_prefill(self, seconds: float, tokens: int) -> None:
        self.prefill_time.observe(seconds)
        self.tokens.inc(tokens)

    def set_queue_tokens(self, n: int) -> None:
        self.queue_tokens.set(n)
