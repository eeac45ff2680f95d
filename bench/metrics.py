"""Per-request timings and the aggregate figures of a run (pure: numpy only).

Times are seconds on one monotonic clock from the benchmark start (t = 0: when the first measured request
was due). Definitions and key names follow ``vllm bench serve``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_NAMES = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class RequestRecord:
    index: int  # position in the measured request stream
    scheduled_time: float  # when the arrival schedule released it
    start_time: float  # when it was sent (later than scheduled while waiting for a concurrency slot)
    end_time: float  # when its stream ended, successfully or not
    token_times: tuple[float, ...] = ()  # arrival of each token-bearing message
    token_counts: tuple[int, ...] = ()  # tokens in each of those messages
    prompt_tokens: int = 0
    error: str | None = None
    finish_reason: str = ""
    request_id: str = ""

    def __post_init__(self) -> None:
        if len(self.token_times) != len(self.token_counts):
            raise ValueError("token_times and token_counts must have the same length")
        if any(k < 1 for k in self.token_counts):
            raise ValueError("a token-bearing message carries at least one token")

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def output_tokens(self) -> int:
        return sum(self.token_counts)

    @property
    def ttft(self) -> float | None:
        """Sending to the first message carrying a token id (text-only messages do not count)."""
        return self.token_times[0] - self.start_time if self.token_times else None

    @property
    def e2el(self) -> float:
        return self.end_time - self.start_time

    @property
    def itl(self) -> list[float]:
        """Gaps between token-bearing messages; a message of k tokens gives k gaps of its gap / k, so a
        server batching tokens is not credited with zero-latency ones. Tokens of the first message after
        its first have no gap: the values sum to the last token's time minus the first's."""
        out: list[float] = []
        for i in range(1, len(self.token_times)):
            k = self.token_counts[i]
            out.extend([(self.token_times[i] - self.token_times[i - 1]) / k] * k)
        return out

    @property
    def tpot(self) -> float | None:
        """``(e2el - ttft) / (output_tokens - 1)``; None with one token."""
        ttft = self.ttft
        if ttft is None or self.output_tokens < 2:
            return None
        return (self.e2el - ttft) / (self.output_tokens - 1)

    def as_dict(self) -> dict[str, Any]:
        """The saved per-request record: raw timestamps plus the figures derived from them."""
        ttft, tpot = self.ttft, self.tpot
        return {
            "index": self.index,
            "request_id": self.request_id,
            "scheduled_time": self.scheduled_time,
            "start_time": self.start_time,
            "end_time": self.end_time,
            "token_times": list(self.token_times),
            "token_counts": list(self.token_counts),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "ttft_ms": None if ttft is None else ttft * 1000.0,
            "tpot_ms": None if tpot is None else tpot * 1000.0,
            "itl_ms": [x * 1000.0 for x in self.itl],
            "e2el_ms": self.e2el * 1000.0,
            "finish_reason": self.finish_reason,
            "error": self.error,
        }


@dataclass(frozen=True)
class Slo:
    """Service-level objectives in milliseconds; None: not constrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def __post_init__(self) -> None:
        for name in SLO_NAMES:
            v = getattr(self, f"{name}_ms")
            if v is not None and not v >= 0:
                raise ValueError(f"SLO {name} must be >= 0 ms, got {v}")

    @property
    def any(self) -> bool:
        return any(getattr(self, f"{n}_ms") is not None for n in SLO_NAMES)

    def as_dict(self) -> dict[str, float]:
        return {n: v for n in SLO_NAMES if (v := getattr(self, f"{n}_ms")) is not None}

    def met_by(self, r: RequestRecord) -> bool:
        """True when a successful request meets every objective (a missing TPOT counts as 0)."""
        if not r.ok or r.ttft is None:
            return False
        values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2el}
        return all(values[n] * 1000.0 <= limit for n, limit in self.as_dict().items())


def parse_slo(pairs: Sequence[str]) -> Slo:
    """``["ttft:500", "tpot:50"]`` -> Slo; ValueError naming a bad pair."""
    values: dict[str, float] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        if not sep or name not in SLO_NAMES:
            raise ValueError(f"bad SLO {pair!r}: expected NAME:MS with NAME one of {', '.join(SLO_NAMES)}")
        try:
            values[f"{name}_ms"] = float(value)
        except ValueError:
            raise ValueError(f"bad SLO {pair!r}: {value!r} is not a number of milliseconds") from None
    return Slo(**values)


def percentile_key(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def summarize(values_s: Sequence[float], name: str, percentiles: Sequence[float] = PERCENTILES) -> dict:
    """``mean_/median_/std_/pNN_{name}_ms`` of values given in seconds; None for an empty set."""
    keys = ["mean", "median", "std", *(percentile_key(p) for p in percentiles)]
    if not values_s:
        return {f"{k}_{name}_ms": None for k in keys}
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    stats = [float(np.mean(ms)), float(np.median(ms)), float(np.std(ms))]
    stats += [float(np.percentile(ms, p)) for p in percentiles]
    return {f"{k}_{name}_ms": v for k, v in zip(keys, stats, strict=True)}


def compute_metrics(
    records: Sequence[RequestRecord], slo: Slo | None = None, percentiles: Sequence[float] = PERCENTILES
) -> dict[str, Any]:
    """The aggregate figures, under ``vllm bench serve``'s key names.

    Only successful requests enter token totals and latencies; ``duration`` runs from t = 0 to the end of
    the last stream, failed or not; ``std`` is the population's; an empty set's statistic is None, never a
    misleading 0. Goodput: successful requests meeting every SLO per second; ``slo_attainment``: their
    share of all measured requests, failed ones counting as misses.
    """
    ok = [r for r in records if r.ok]
    duration = max((r.end_time for r in records), default=0.0)
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)

    def per_s(count: float) -> float | None:
        return count / duration if duration > 0 else None

    out: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "duration": duration,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
        "request_goodput": None,
        "slo_attainment": None,
    }
    if slo is not None and slo.any:
        good = sum(slo.met_by(r) for r in records)
        out["request_goodput"] = per_s(good)
        out["slo_attainment"] = good / len(records) if records else None
    series = {
        "ttft": [t for r in ok if (t := r.ttft) is not None],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.e2el for r in ok],
    }
    for name in LATENCY_METRICS:
        out.update(summarize(series[name], name, percentiles))
    return out
