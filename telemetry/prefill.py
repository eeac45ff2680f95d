"""Prefill forward time and prompt tokens prefilled, for every worker that prefills.

Decode and colocated workers observe their local prefills here under their own role, so that their
decode step time (``decode_pool.metrics``) times only steps that decode.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from pdserve.telemetry.slo import STEP_BUCKETS

PREFILL_TIME = "pdserve_prefill_time_seconds"
PREFILL_TOKENS = "pdserve_prefill_tokens_total"
FAILED_STEPS = "pdserve_failed_steps_total"
PREFILL_ROLES = ("prefill", "decode", "both")


class PrefillForwardMetrics:
    def __init__(self, registry: CollectorRegistry, role: str) -> None:
        if role not in PREFILL_ROLES:
            raise ValueError(f"role must be one of {PREFILL_ROLES}, got {role!r}")
        self.registry = registry
        self.prefill_time = Histogram(
            PREFILL_TIME,
            "Wall time of one batched prefill forward.",
            ["role"],
            buckets=STEP_BUCKETS,
            registry=registry,
        ).labels(role)
        self.tokens = Counter(PREFILL_TOKENS, "Prompt tokens prefilled.", ["role"], registry=registry).labels(
            role
        )
        self.failed_steps = Counter(
            FAILED_STEPS,
            "Engine steps (decode, colocated) or prefill forwards that raised: their requests moved to "
            "another worker; 3 in a row and the worker drains and exits (worker.failures).",
            ["role"],
            registry=registry,
        ).labels(role)

    def observe_prefill(self, seconds: float, tokens: int) -> None:
        self.prefill_time.observe(seconds)
        self.tokens.inc(tokens)
