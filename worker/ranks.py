"""A worker's KV as its transfers see it: a tensor-parallel group's rank caches, each with the KV heads
its rank holds (``engine.tensor_parallel.ShardLayout``), and the compatibility record of the model's whole
KV shape."""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry

from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.tensor_parallel import ShardLayout
from pdserve.kv_transfer import KVCompat, compat_for
from pdserve.kv_transfer.split import RankCaches
from pdserve.telemetry.ranks import RankCollector


def rank_caches(runner: ModelRunner) -> RankCaches | None:
    """Every rank's cache as rank 0 maps it; None for one process."""
    tp = runner.tp
    if tp is None:
        return None
    heads = tuple(ShardLayout.of(runner.config, r, tp.size).kv_heads for r in range(tp.size))
    return RankCaches(tuple(runner.rank_kv), heads, runner.rank_shared_fds)


def kv_compat(runner: ModelRunner, model_id: str) -> KVCompat:
    """The record of the model's KV (all its heads, whichever of them this process caches)."""
    return compat_for(runner.kv, model_id, num_kv_heads=runner.config.num_kv_heads)


def rank_pids(runner: ModelRunner) -> tuple[int, ...]:
    """A tensor-parallel group's processes by rank (rank 0: this one); () for one process."""
    tp = runner.tp
    return () if tp is None else (os.getpid(), *(p.pid for p in tp.processes))


def add_rank_metrics(runner: ModelRunner, registry: CollectorRegistry, role: str) -> None:
    """A tensor-parallel worker's per-rank process metrics (``telemetry.ranks``); nothing for one process."""
    tp = runner.tp
    if tp is not None:
        registry.register(RankCollector([os.getpid(), *(p.pid for p in tp.processes)], role))
