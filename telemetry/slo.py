"""Service-level objectives and the histogram buckets built around them. Pure: imports nothing of ours.

The router's latency histograms put a bucket boundary exactly on each threshold, so "fraction within the
SLO" is an exact ratio of two bucket counters in PromQL; the benchmark scores goodput against the same
numbers. The defaults suit a CPU deployment of the default model; a GPU one tightens them here only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class SloThresholds:
    ttft_s: float = 2.0  # time to first token, measured at the router from arrival
    itl_s: float = 0.1  # inter-token latency (the benchmark's TPOT objective)
    e2e_s: float = 30.0  # end-to-end request latency

    def __post_init__(self) -> None:
        for name in ("ttft_s", "itl_s", "e2e_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    def goodput_args(self) -> list[str]:
        """The thresholds as ``pdserve bench --goodput`` pairs (milliseconds, vLLM's names)."""
        return [f"ttft:{self.ttft_s * 1e3:g}", f"tpot:{self.itl_s * 1e3:g}", f"e2el:{self.e2e_s * 1e3:g}"]


DEFAULT_SLO = SloThresholds()


def with_thresholds(base: Iterable[float], *thresholds: float) -> tuple[float, ...]:
    """``base`` bucket bounds plus the thresholds, sorted, without duplicates."""
    return tuple(sorted({float(b) for b in base} | {float(t) for t in thresholds}))


# Latencies from sub-millisecond (the router's relay) to minutes (long generations on a CPU).
_FINE = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75)
_COARSE = (1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)


def ttft_buckets(slo: SloThresholds = DEFAULT_SLO) -> tuple[float, ...]:
    return with_thresholds(_FINE[2:] + _COARSE, slo.ttft_s)


def itl_buckets(slo: SloThresholds = DEFAULT_SLO) -> tuple[float, ...]:
    return with_thresholds(_FINE + _COARSE[:6], slo.itl_s)


def e2e_buckets(slo: SloThresholds = DEFAULT_SLO) -> tuple[float, ...]:
    return with_thresholds(_FINE[3::2] + _COARSE, slo.e2e_s)


def queue_buckets(slo: SloThresholds = DEFAULT_SLO) -> tuple[float, ...]:
    # Waiting in the router's queue eats into the TTFT budget: its threshold is a boundary here too.
    return with_thresholds(_FINE[1:] + _COARSE, slo.ttft_s)


# Engine-side timings (a prefill forward, a decode step, one KV transfer).
STEP_BUCKETS = with_thresholds(_FINE + _COARSE[:8])
# Requests in one decode step.
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
