"""The prefill pool's composition root: builds the model runner, sampler, KV sender, metrics and loop, wires
them to the servicer, and is ``pdserve worker``'s entry point (``serve``) for role ``prefill``."""

from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from prometheus_client import CollectorRegistry

from pdserve.engine.device import resolve_device, resolve_dtype
from pdserve.engine.grammar import GrammarCompiler
from pdserve.engine.llm_engine import DTYPES
from pdserve.engine.model_runner import ModelRunner, build_runner
from pdserve.engine.prefix_hash import model_cache_salt
from pdserve.engine.quant import kv_model_id
from pdserve.engine.tensor_parallel import RankLost
from pdserve.engine.tokenizer import Tokenizer
from pdserve.kv_transfer import KVSender
from pdserve.prefill_pool.loop import PrefillLoop, PrefillLoopStopped
from pdserve.prefill_pool.metrics import PrefillMetrics
from pdserve.prefill_pool.servicer import PrefillServicer
from pdserve.worker.args import WorkerArgs
from pdserve.worker.bringup import Capacity, run_pool
from pdserve.worker.ranks import add_rank_metrics, kv_compat, rank_caches, rank_pids
from pdserve.worker.shell import WorkerShell

log = logging.getLogger(__name__)

DEFAULT_PREFILL_KV_BYTES = 512 << 20  # holds the prompts of the batches in flight, not whole conversations


class PrefillPool:
    """The prefill pool's part of ``worker.bringup``: a model runner, a sampler, a KV sender, the loop."""

    def __init__(self, args: WorkerArgs, shell: WorkerShell, registry: CollectorRegistry) -> None:
        self.args, self.registry = args, registry
        self.metrics = PrefillMetrics(registry)
        self.servicer = PrefillServicer(shell, self.metrics)
        self.shell = shell
        self.failure: BaseException | None = None  # the loop died: the worker drains and exits with it
        self.loop: PrefillLoop | None = None
        self.sender: KVSender | None = None
        self.runner: ModelRunner | None = None
        # Builds the runner and runs every forward: one thread makes this process's CPU-kernel calls (the
        # kernels' OpenMP pools belong to their calling thread: docs/engine.md, "One thread").
        self.forward_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefill-forward")

    async def load(self, model_dir: Path) -> Capacity:
        args = self.args
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        runner = await asyncio.get_running_loop().run_in_executor(
            self.forward_thread,
            functools.partial(
                build_runner,
                model_dir,
                args.tensor_parallel_size,
                args.threads or 1,
                dtype=DTYPES[dtype],
                device=device,
                block_size=args.block_size,
                num_blocks=args.kv_blocks or None,
                kv_cache_bytes=args.kv_cache_bytes_or(DEFAULT_PREFILL_KV_BYTES),
                gpu_memory_utilization=args.gpu_memory_utilization,
                quantization=args.quantization,
            ),
        )
        # On CUDA: prefill under CUDA graphs for chunks up to the batch budget (a no-op elsewhere).
        await asyncio.get_running_loop().run_in_executor(
            self.forward_thread, runner.prepare_prefill, args.max_batched_tokens
        )
        eos = list(runner.config.eos_token_ids)
        tokenizer: Tokenizer | None = None
        try:
            tokenizer = Tokenizer.from_dir(model_dir)
            eos += [t for t in tokenizer.eos_token_ids if t not in eos]
        except FileNotFoundError:
            pass
        sampler = runner.sampler(tuple(eos))
        self.runner = runner
        # A tensor-parallel group's record is the model's whole KV shape; its transfers move every rank's
        # heads into the decode ranks that hold them (``ranks``).
        compat = kv_compat(runner, kv_model_id(model_dir.name, args.quantization))
        self.sender = KVSender(
            runner.kv,
            compat,
            args.transfer_config(),
            self.registry,
            name=args.worker_id,
            ranks=rank_caches(runner),
        )
        salt = model_cache_salt(runner.model_dir, dtype, runner.quantization)
        self.loop = PrefillLoop(
            runner,
            sampler,
            self.sender,
            args.max_batched_tokens,
            self.metrics,
            self.forward_thread,
            prefix_caching=args.enable_prefix_caching,
            cache_salt=salt,
            grammar=GrammarCompiler(tokenizer, runner.config.vocab_size, eos),
        )
        self.loop.on_fatal(self._fatal)
        self.loop.on_forward_failed(self.metrics.failed_steps.inc)
        self.loop.start()
        if runner.tp is not None:  # a rank gone: nothing can prefill any more, the worker drains and exits
            loop = self.loop
            runner.tp.watch(lambda why: loop.fail(RankLost(why)))
            add_rank_metrics(runner, self.registry, "prefill")
        self.servicer.attach(self.loop)
        return Capacity(
            runner.num_blocks,
            runner.config.max_position_embeddings,
            dtype,
            device,
            runner.startup_seconds,
            compat.describe(),
            self.loop.sched.block_manager if args.enable_prefix_caching else None,
            salt,
            rank_pids(runner),
        )

    def _fatal(self, err: PrefillLoopStopped) -> None:
        self.failure = err
        log.critical("worker draining: %s", err)
        self.shell.begin_drain()

    async def close(self) -> None:
        if self.loop is not None:
            await self.loop.close()
        if self.sender is not None:
            await self.sender.close()
        if self.runner is not None and self.runner.tp is not None:
            self.runner.tp.close()
        self.forward_thread.shutdown(wait=False)


async def serve(args: WorkerArgs) -> None:
    """Run a prefill worker until it has drained."""
    await run_pool(args, lambda shell, registry: PrefillPool(args, shell, registry))
