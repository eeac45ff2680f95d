"""The one start-up every worker process runs, whatever its pool.

    metrics endpoint (the process registry, served at once so a slow load is visible; a worker on
        cuda:N adds NVML metrics of that GPU)
    -> shell started: gRPC bound, health and reflection NOT_SERVING, signals drain
    -> model resolved and loaded by the pool (``Pool.load``), which attaches it to its servicer
    -> SERVING
    -> agent: register with the router, heartbeat, obey drain (``agent.run_worker``)
    -> drained: the pool closes (its loops, its KV transfer), the metrics endpoint closes

A model that does not load sets ``pdserve_model_load_failed`` to 1; the gRPC server stops, and with
``load_failure_linger_s`` the metrics endpoint stays up that long (or until SIGTERM) before the error
ends the process, so that Prometheus scrapes the failure (the ``PdserveModelLoadFailed`` alert).

A pool provides only what differs: its servicer, how it loads, and how it closes. The pools call
``run_pool`` from their ``serve(args)``; ``pdserve worker`` picks the pool by role.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from pdserve.engine.device import cuda_uuid, device_index
from pdserve.engine.registry import resolve_model
from pdserve.proto import worker_pb2_grpc
from pdserve.telemetry.exporter import model_load_gauge, process_registry, serve_metrics
from pdserve.telemetry.gpu import add_gpu_metrics
from pdserve.worker.agent import RouterAgent, run_worker
from pdserve.worker.args import WorkerArgs
from pdserve.worker.auth import refusal_counter
from pdserve.worker.shell import PoolServicer, WorkerShell

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Capacity:
    """What a loaded pool registers with the router."""

    kv_blocks_total: int
    context_length: int
    dtype: str  # what the engine runs in (``--dtype auto`` resolved)
    device: str  # cpu | cuda:N


class Pool(Protocol):
    """One pool's part of a worker process."""

    @property
    def servicer(self) -> PoolServicer:
        """Registered on the shell before the model loads (the shell rejects requests until SERVING)."""

    async def load(self, model_dir: Path) -> Capacity:
        """Load the model and attach it to the servicer; runs on the event loop (offload heavy work)."""

    async def close(self) -> None:
        """Stop the pool's loops and transfers; called once, after the shell has drained."""


async def run_pool(args: WorkerArgs, build: Callable[[WorkerShell, CollectorRegistry], Pool]) -> None:
    """Run one worker process of ``args.role`` until it has drained."""
    registry = process_registry(args.role.value, gpu=False)
    load_failed = model_load_gauge(registry, args.role.value)
    endpoint = serve_metrics(registry, args.host, args.metrics_port)
    try:
        await asyncio.to_thread(add_device_metrics, registry, args)
        shell = WorkerShell(args.shell_config(), refusal_counter(registry, args.role.value))
        pool = build(shell, registry)
        address = await shell.start(
            lambda server: worker_pb2_grpc.add_WorkerServicer_to_server(pool.servicer, server)
        )
        shell.install_signal_handlers()
        try:
            try:
                model_dir = await asyncio.to_thread(resolve_model, args.model, args.cache_dir)
                capacity = await pool.load(model_dir)
            except Exception:
                load_failed.set(1)
                log.exception(
                    "%s worker %s could not load model %r", args.role.value, args.worker_id, args.model
                )
                await shell.stop()
                await _linger(args.load_failure_linger_s)
                raise
            log.info(
                "%s worker %s: model %s on %s in %s (--dtype %s), %d KV blocks of %d tokens, context %d",
                args.role.value,
                args.worker_id,
                model_dir.name,
                capacity.device,
                capacity.dtype,
                args.dtype,
                capacity.kv_blocks_total,
                args.block_size,
                capacity.context_length,
            )
            await shell.set_serving()
            agent = RouterAgent(
                args.agent_config(),
                args.worker_info(
                    address,
                    kv_blocks_total=capacity.kv_blocks_total,
                    context_length=capacity.context_length,
                    pid=os.getpid(),
                    dtype=capacity.dtype,
                    device=capacity.device,
                    metrics_url=endpoint.url,
                ),
                load=pool.servicer.load,
                on_drain=shell.begin_drain,
            )
            await run_worker(shell, agent)
        finally:
            await pool.close()
    finally:
        endpoint.close()
        log.info("%s worker %s stopped", args.role.value, args.worker_id)


def add_device_metrics(registry: CollectorRegistry, args: WorkerArgs, nvml: Any = None) -> bool:
    """NVML metrics of the GPU a ``cuda``/``cuda:N`` worker runs on (none for a CPU worker, and none,
    quietly, without a driver or nvidia-ml-py). True when they were added. ``nvml``: for tests."""
    index = device_index(args.device)
    if index is None:
        return False
    return add_gpu_metrics(registry, args.role.value, nvml, index=index, uuid=cuda_uuid(args.device))


async def _linger(seconds: float) -> None:
    """Wait ``seconds`` or until SIGTERM/SIGINT, whichever comes first (the shell's drain handlers are
    spent: its server has stopped)."""
    if seconds <= 0:
        return
    log.error("keeping /metrics up for %.0fs so the failed load is scraped", seconds)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
