"""The one start-up every worker process runs, whatever its pool (``run_pool``): a pool provides only
what differs (``Pool``: its servicer, how it loads, how it closes) and calls ``run_pool`` from its
``serve(args)``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Gauge

from pdserve.engine.device import cuda_uuid, device_index
from pdserve.engine.registry import resolve_model
from pdserve.proto import worker_pb2_grpc
from pdserve.telemetry.exporter import model_load_gauge, process_registry, serve_metrics
from pdserve.telemetry.gpu import add_gpu_metrics
from pdserve.worker.agent import run_worker
from pdserve.worker.args import WorkerArgs
from pdserve.worker.auth import refusal_counter
from pdserve.worker.kv_events import EventSource
from pdserve.worker.router_set import RouterSet
from pdserve.worker.shell import PoolServicer, ShellState, WorkerShell

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Capacity:
    """What a loaded pool registers with the router."""

    kv_blocks_total: int
    context_length: int
    dtype: str  # what the engine runs in (``--dtype auto`` resolved)
    device: str  # cpu | cuda:N
    # Seconds of the engine's start-up phases (``ModelRunner.startup_seconds``); empty: not measured.
    startup_seconds: Mapping[str, float] = field(default_factory=dict)
    # The KV cache's compatibility record in words (``KVCompat.describe``): every worker of a cluster
    # must register the same one.
    kv_layout: str = ""
    # The block pool whose prefix-cache changes the router's KV index follows, and the salt of its block
    # hashes (``engine.prefix_hash``); None: no prefix cache.
    prefix_cache: EventSource | None = None
    prefix_cache_salt: str = ""
    rank_pids: tuple[int, ...] = ()  # a tensor-parallel group's processes by rank (rank 0: this one)


class WorkerFailed(RuntimeError):
    """The worker drained and stopped because its pool could serve nothing more."""


class Pool(Protocol):
    """One pool's part of a worker process."""

    @property
    def servicer(self) -> PoolServicer:
        """Registered on the shell before the model loads (the shell rejects requests until SERVING)."""

    async def load(self, model_dir: Path) -> Capacity:
        """Load the model and attach it to the servicer; runs on the event loop (offload heavy work)."""

    async def close(self) -> None:
        """Stop the pool's loops and transfers; called once, after the shell has drained."""

    @property
    def failure(self) -> BaseException | None:
        """Set once the pool's engine or loop died (it began the shell's drain): the process then exits
        with this error, to be replaced, rather than serve nothing while it looks healthy."""


async def run_pool(args: WorkerArgs, build: Callable[[WorkerShell, CollectorRegistry], Pool]) -> None:
    """Run one worker process of ``args.role`` until it has drained: metrics, the shell (NOT_SERVING),
    the pool's model, SERVING, the agent (register, heartbeat, obey drain), then close the pool."""
    registry = process_registry(args.role.value, gpu=False)
    load_failed = model_load_gauge(registry, args.role.value)
    startup = startup_gauge(registry, args.role.value)
    startup.labels(args.role.value, "process").set(process_age_s())
    # Served before anything loads, so a slow or failed load is visible.
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
                t0 = time.perf_counter()
                model_dir = await asyncio.to_thread(resolve_model, args.model, args.cache_dir)
                t1 = time.perf_counter()
                capacity = await pool.load(model_dir)
                digest = await asyncio.to_thread(vocab_digest, model_dir)
                t2 = time.perf_counter()
            except Exception:
                log.exception(
                    "%s worker %s could not load model %r", args.role.value, args.worker_id, args.model
                )
                # The gRPC server stops; /metrics lingers (``load_failure_linger_s``) so Prometheus
                # scrapes pdserve_model_load_failed before the error ends the process.
                # The linger's handlers replace the shell's before the gauge shows the failure: a
                # SIGTERM sent once the failure is scraped must end the linger, not a spent drain.
                stop = _linger_stop()
                await shell.stop()
                load_failed.set(1)
                await _linger(stop, args.load_failure_linger_s)
                raise
            log.info(
                "%s worker %s: model %s on %s in %s (--dtype %s, --quantization %s), %d KV blocks of %d "
                "tokens, context %d",
                args.role.value,
                args.worker_id,
                model_dir.name,
                capacity.device,
                capacity.dtype,
                args.dtype,
                args.quantization,
                capacity.kv_blocks_total,
                args.block_size,
                capacity.context_length,
            )
            phases = {"model_resolve": t1 - t0, **capacity.startup_seconds, "load": t2 - t1}
            for phase, seconds in phases.items():
                startup.labels(args.role.value, phase).set(seconds)
            if shell.state is not ShellState.STARTING and pool.failure is None:  # a SIGTERM while it loaded
                role, wid = args.role.value, args.worker_id
                log.info("%s worker %s: asked to stop while loading: not joining", role, wid)
                await shell.stop()
                return
            await shell.set_serving()
            info = args.worker_info(
                address,
                kv_blocks_total=capacity.kv_blocks_total,
                context_length=capacity.context_length,
                pid=os.getpid(),
                dtype=capacity.dtype,
                device=capacity.device,
                metrics_url=endpoint.url,
                kv_layout=capacity.kv_layout,
                tokenizer_digest=digest,
            )
            if capacity.prefix_cache is not None:
                info.prefix_cache_salt = capacity.prefix_cache_salt
            info.rank_pids.extend(capacity.rank_pids)
            agent = RouterSet(
                args.router_set_config(),
                info,
                load=pool.servicer.load,
                on_drain=shell.begin_drain,
                events=capacity.prefix_cache,
            )
            await run_worker(shell, agent, on_registered=lambda: _ready(startup, args, phases))
            failure = pool.failure
            if failure is not None:
                raise WorkerFailed(f"{args.role.value} worker {args.worker_id}: {failure}") from failure
        finally:
            await pool.close()
    finally:
        endpoint.close()
        log.info("%s worker %s stopped", args.role.value, args.worker_id)


def vocab_digest(model_dir: Path) -> str:
    """The model's vocabulary digest (``Tokenizer.vocab_digest``) the router checks at registration; ""
    (not checked) for a model without a tokenizer, which only token-id prompts can use, or one whose
    tokenizer files do not load here (the worker itself needs only the weights: it serves, unchecked)."""
    from pdserve.engine.tokenizer import Tokenizer

    try:
        return Tokenizer.from_dir(model_dir).vocab_digest
    except FileNotFoundError:
        return ""
    except Exception as exc:  # a broken tokenizer.json must not stop a worker that never reads it
        log.warning(
            "no vocabulary digest for %s (%s): the router cannot check this worker's model", model_dir, exc
        )
        return ""


def startup_gauge(registry: CollectorRegistry, role: str) -> Gauge:
    """Cold start by phase: ``process`` (exec to start-up: interpreter and imports), ``model_resolve``
    (finding the model, converting a GGUF file on first use), the engine's own
    (``ModelRunner.startup_seconds``), ``load`` (the pool's whole load), ``ready`` (exec to registered)."""
    return Gauge(
        "pdserve_worker_startup_seconds",
        "Seconds each phase of this worker's start-up took (ready: from exec until registered).",
        ["role", "phase"],
        registry=registry,
    )


def _ready(startup: Gauge, args: WorkerArgs, phases: Mapping[str, float]) -> None:
    """Registered with the router: the cold start is over."""
    ready = process_age_s()
    startup.labels(args.role.value, "ready").set(ready)
    log.info(
        "%s worker %s ready %.2fs after exec (%s)%s",
        args.role.value,
        args.worker_id,
        ready,
        ", ".join(f"{k} {v:.2f}s" for k, v in phases.items()),
        " as standby" if args.standby else "",
    )


def process_age_s() -> float:
    """Seconds since this process was exec'd (Linux: /proc; elsewhere 0)."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[-1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)


def add_device_metrics(registry: CollectorRegistry, args: WorkerArgs, nvml: Any = None) -> bool:
    """NVML metrics of the GPU a ``cuda``/``cuda:N`` worker runs on (none for a CPU worker, and none,
    quietly, without a driver or nvidia-ml-py). True when they were added. ``nvml``: for tests."""
    index = device_index(args.device)
    if index is None:
        return False
    return add_gpu_metrics(registry, args.role.value, nvml, index=index, uuid=cuda_uuid(args.device))


def _linger_stop() -> asyncio.Event:
    """An event SIGTERM/SIGINT set from now on (replacing the shell's drain handlers, which are spent
    once its server stops)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _linger(stop: asyncio.Event, seconds: float) -> None:
    """Wait ``seconds`` or until ``stop`` is set (a signal), whichever comes first."""
    if seconds <= 0 or stop.is_set():
        return
    log.error("keeping /metrics up for %.0fs so the failed load is scraped", seconds)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
