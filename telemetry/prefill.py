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

        self.rate = PrefillRate()

    def observe_prefill(self, seconds: float, tokens: int) -> None:
        self.prefill_time.observe(seconds)
        self.tokens.inc(tokens)
        self.rate.observe(seconds, tokens)


class PrefillRate:
    """Prompt tokens per second of recent prefill forwards: decayed sums of tokens and seconds, so a
    forward counts by its length and old ones fade (each forward keeps ``DECAY`` of the past). Reported in
    every heartbeat (``WorkerLoad.prefill_tokens_per_s``); the router predicts queue waits with it."""

    DECAY = 0.8

    def __init__(self) -> None:
        self._tokens = 0.0
        self._seconds = 0.0

    def observe(self, seconds: float, tokens: int) -> None:
        if seconds <= 0 or tokens <= 0:
            return
        self._tokens = self._tokens * self.DECAY + tokens
        self._seconds = self._seconds * self.DECAY + seconds

    @property
    def tokens_per_s(self) -> float:
        """0 until a forward was measured."""
        return self._tokens / self._seconds if self._seconds > 0 else 0.0
