"""The seeded request stream of one run: warmup requests, measured requests, send times (pure).

The seed is split into independent streams (``SeedSequence.spawn``) for the measured prompts, their send
times and the warmup prompts: changing ``warmup`` or the rate leaves the measured prompts as they were,
and two shapes benchmarked with one seed receive the same requests at the same offsets.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdserve.bench.arrivals import ArrivalConfig, arrival_times
from pdserve.bench.datasets import SampleRequest, TokenSpace, WorkloadConfig, sample_requests


@dataclass(frozen=True)
class RunPlan:
    warmup: tuple[SampleRequest, ...]
    requests: tuple[SampleRequest, ...]
    send_times: tuple[float, ...]  # seconds from the benchmark start, one per measured request


def plan_run(
    workload: WorkloadConfig,
    arrivals: ArrivalConfig,
    num_prompts: int,
    warmup: int,
    seed: int,
    token_space: TokenSpace | None,
) -> RunPlan:
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    data_seq, arrival_seq, warmup_seq = np.random.SeedSequence(seed).spawn(3)
    requests = sample_requests(workload, num_prompts, np.random.default_rng(data_seq), token_space)
    times = arrival_times(num_prompts, arrivals, np.random.default_rng(arrival_seq))
    warm = sample_requests(workload, warmup, np.random.default_rng(warmup_seq), token_space)
    return RunPlan(warmup=tuple(warm), requests=tuple(requests), send_times=tuple(times))
