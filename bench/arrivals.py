"""When each benchmark request is sent: a seeded arrival schedule (pure: numpy only).

Gamma-distributed gaps of shape ``burstiness`` (1: Poisson; below 1: bursts) and mean ``1 / request_rate``,
as ``vllm bench serve``; the first request goes at t = 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ArrivalConfig:
    request_rate: float = math.inf  # requests per second; inf: all at once
    burstiness: float = 1.0  # gamma shape; 1: Poisson; inf: constant gaps

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf: all at once), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0 (1: Poisson), got {self.burstiness}")


def arrival_times(n: int, config: ArrivalConfig, rng: np.random.Generator) -> list[float]:
    """Send offsets in seconds from the benchmark start, one per request, non-decreasing."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if n == 0:
        return []
    if math.isinf(config.request_rate):
        return [0.0] * n
    mean_gap = 1.0 / config.request_rate
    if math.isinf(config.burstiness):
        gaps = np.full(n - 1, mean_gap)
    else:
        # Gamma(shape k, scale theta) has mean k * theta; theta = mean_gap / k keeps the rate.
        gaps = rng.gamma(shape=config.burstiness, scale=mean_gap / config.burstiness, size=n - 1)
    times = np.concatenate(([0.0], np.cumsum(gaps)))
    # The last request at exactly (n - 1) / rate: the offered load is the nominal rate whatever the seed, so a
    # sweep compares rates, not sampling noise (vLLM normalizes the same way).
    if times[-1] > 0:
        times *= (n - 1) * mean_gap / times[-1]
    return [float(t) for t in times]
