"""Per-rank process metrics of a tensor-parallel worker, read at scrape time by rank 0 (the followers export
nothing themselves): CPU time and resident memory of each rank's process, labelled ``rank``, where one
rank's imbalance or growth shows."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

RANK_CPU = "pdserve_tp_rank_cpu_seconds"
RANK_MEMORY = "pdserve_tp_rank_resident_memory_bytes"
_LABELS = ["role", "rank"]


class RankCollector(Collector):
    """``pids[r]``: rank ``r``'s process (rank 0: this one). A rank whose process is gone exports nothing."""

    def __init__(self, pids: Sequence[int], role: str) -> None:
        self._role = role
        # prometheus_client's own reader of /proc/<pid>/stat, one per rank, never registered itself.
        self._ranks = [ProcessCollector(pid=lambda p=p: p, registry=None) for p in pids]

    def _families(self) -> tuple[CounterMetricFamily, GaugeMetricFamily]:
        return (
            CounterMetricFamily(RANK_CPU, "CPU time of each tensor-parallel rank's process.", labels=_LABELS),
            GaugeMetricFamily(
                RANK_MEMORY, "Resident memory of each tensor-parallel rank's process.", labels=_LABELS
            ),
        )

    def describe(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        return iter(self._families())

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        cpu, memory = self._families()
        for rank, reader in enumerate(self._ranks):
            labels = [self._role, str(rank)]
            for family in reader.collect():
                for sample in family.samples:
                    if sample.name == "process_cpu_seconds_total":
                        cpu.add_metric(labels, sample.value)
                    elif sample.name == "process_resident_memory_bytes":
                        memory.add_metric(labels, sample.value)
        return iter((cpu, memory))
