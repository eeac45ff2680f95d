"""The decode pool's composition root: builds the engine loop, the KV receiver and the metrics, wires them
to the servicer, and is ``pdserve worker``'s entry point (``serve``) for roles ``decode`` and ``both``."""

from __future__ import annotations

import logging
from pathlib import Path

from prometheus_client import CollectorRegistry

from pdserve.decode_pool.engine_loop import EngineDied, EngineLoop
from pdserve.decode_pool.metrics import DecodeMetrics
from pdserve.decode_pool.migration import StreamExport
from pdserve.decode_pool.remote import RemotePrefill
from pdserve.decode_pool.servicer import DecodeServicer
from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.engine.quant import kv_model_id
from pdserve.engine.tensor_parallel import RankLost
from pdserve.engine.tokenizer import Tokenizer
from pdserve.worker.args import WorkerArgs
from pdserve.worker.bringup import Capacity, run_pool
from pdserve.worker.ranks import add_rank_metrics, kv_compat, rank_caches, rank_pids
from pdserve.worker.role import Role
from pdserve.worker.shell import WorkerShell

log = logging.getLogger(__name__)

# The KV cache's size on a CPU; on a GPU, --gpu-memory-utilization sizes it.
DEFAULT_DECODE_KV_BYTES = 1 << 30


def engine_config(args: WorkerArgs) -> EngineConfig:
    return EngineConfig(
        max_num_seqs=args.max_running,
        max_num_batched_tokens=args.max_batched_tokens,
        mixed_steps=args.mixed_steps,
        enable_prefix_caching=args.enable_prefix_caching,
        block_size=args.block_size,
        num_blocks=args.kv_blocks or None,
        kv_cache_bytes=args.kv_cache_bytes_or(DEFAULT_DECODE_KV_BYTES),
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        gpu_memory_utilization=args.gpu_memory_utilization,
        threads=args.threads,
        detokenize=False,  # the router applies stop strings; a worker stops on token ids and lengths
        kv_shared_memory=args.kv_shared_memory,
        speculative_config=args.speculative_config(),
        tensor_parallel_size=args.tensor_parallel_size,
    )


class DecodePool:
    """The decode pool's part of ``worker.bringup``: the engine on its thread and, for role ``decode``,
    the KV receiver that remote prefills push into."""

    def __init__(self, args: WorkerArgs, shell: WorkerShell, registry: CollectorRegistry) -> None:
        self.args, self.registry = args, registry
        self.metrics = DecodeMetrics(registry, args.role.value)
        self.transfer_config = args.transfer_config()
        self.servicer = DecodeServicer(
            shell, self.transfer_config, self.metrics, admit_limit=args.max_running + args.max_queued
        )
        self.shell = shell
        self.loop: EngineLoop | None = None
        self.remote: RemotePrefill | None = None
        self.export: StreamExport | None = None
        self.failure: BaseException | None = None  # the engine died: the worker drains and exits with it

    def _fatal(self, err: EngineDied) -> None:
        self.failure = err
        log.critical("worker draining: %s", err)
        self.shell.begin_drain()

    async def load(self, model_dir: Path) -> Capacity:
        try:
            tokenizer = Tokenizer.from_dir(model_dir)
        except FileNotFoundError:
            tokenizer = None
        # Built on its own stepping thread: that one thread makes every CPU-kernel call of this process.
        self.loop = await EngineLoop.build(
            lambda: LLMEngine(model_dir, tokenizer, engine_config(self.args)),
            on_fatal=self._fatal,
            step_delay_s=self.args.fault_step_delay_s,
        )
        self.loop.on_step(self.metrics.observe_batch)
        self.loop.on_step_failed(self.metrics.prefill.failed_steps.inc)
        engine = self.loop.engine
        # A colocated worker moves no KV, but it registers the record too: one cluster, one model setup.
        # A tensor-parallel group's record is the model's whole KV shape; its transfers move every rank's
        # heads (``ranks``).
        compat = kv_compat(engine.runner, kv_model_id(model_dir.name, self.args.quantization))
        ranks = rank_caches(engine.runner)
        tp = engine.runner.tp
        if tp is not None:
            loop = self.loop
            tp.watch(lambda why: loop.fail(RankLost(why)))
            add_rank_metrics(engine.runner, self.registry, self.args.role.value)
        # Every decode-capable worker receives KV: a remote prefill's (role decode) and a stream moved here
        # live (either role); and it exports its own streams' KV when they move away.
        self.remote = RemotePrefill(
            self.loop, compat, self.transfer_config, self.registry, self.args.kv_stall_timeout_s, ranks
        )
        if self.args.role is Role.DECODE:  # (a colocated worker's starts with its first stream moved in)
            await self.remote.start()
        self.export = StreamExport(self.loop, compat, self.transfer_config, self.registry)
        self.servicer.attach(
            self.loop, self.remote, self.export, remote_prefill=self.args.role is Role.DECODE
        )
        return Capacity(
            engine.block_manager.num_blocks,
            engine.max_model_len,
            engine.dtype,
            engine.device,
            engine.runner.startup_seconds,
            compat.describe(),
            engine.block_manager if engine.block_manager.enable_prefix_caching else None,
            engine.cache_salt,
            rank_pids(engine.runner),
        )

    async def close(self) -> None:
        if self.export is not None:
            await self.export.close()
        if self.remote is not None:
            await self.remote.close()
        if self.loop is not None:
            await self.loop.stop()


async def serve(args: WorkerArgs) -> None:
    """Run a decode (or colocated) worker until it has drained."""
    await run_pool(args, lambda shell, registry: DecodePool(args, shell, registry))
