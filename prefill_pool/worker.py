"""Prefill worker (role ``prefill``): batched prefill that streams KV to decode workers.

A request's stages here (see ``prefill_pool.scheduler`` for the queue states):

    Prefill RPC (prompt, sampling, the decode worker's transfer ticket)
    -> transfer opened (endpoint cached per decode worker; the handshake checks
       protocol version and compatibility hash before any data moves)
    -> queued -> scheduled into a forward under the token budget (blocks allocated)
    -> during the forward, after each layer, that layer's K/V for every request
       in the batch is handed to its transfer (sent while later layers compute)
    -> first token sampled -> answered to the router AT ONCE (TTFT does not wait
       for decode) -> completion (carrying the first token) sent to the decode
       worker -> blocks freed when the transfer ends.
    Cancel (the router's RPC cancelled), deadline, or a failed transfer at any
    stage: the transfer is aborted (the decode worker frees its reservation) and
    this worker's blocks are freed.

One thread runs forwards (``asyncio.to_thread``); the event loop owns the queue,
the transfers and the block manager, so the block manager is touched only on the
loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass

import grpc
import torch

from engine.block_manager import BlockManager
from engine.model_runner import ModelRunner, PrefillItem
from engine.params import SamplingParams, validate_prompt_token_ids
from engine.sampler import Sampler, SampleRow
from kv_transfer import IncompatibleError, KVSender, SenderHandle, TransferError, TransferTicket, compat_for
from prefill_pool.metrics import PrefillMetrics
from prefill_pool.scheduler import PrefillJob, PrefillScheduler, Stage
from proto import worker_pb2, worker_pb2_grpc
from router.agent import AgentConfig, RouterAgent, run_worker
from router.metrics_http import process_registry, serve_metrics
from router.validate import sampling_params_from_proto
from router.worker_shell import PoolServicer, WorkerArgs, WorkerShell

log = logging.getLogger(__name__)

DEFAULT_PREFILL_KV_BYTES = 512 << 20  # holds the prompts of the batches in flight, not whole conversations


class _BatchCancelled(Exception):
    """Raised from the layer hook to stop a forward whose every request was cancelled."""


@dataclass(eq=False)
class _Req:
    params: SamplingParams
    ticket: TransferTicket
    result: asyncio.Future[tuple[int, float]]  # (first token, forward seconds)
    handle: SenderHandle | None = None
    cancelled: bool = False


class PrefillServicer(PoolServicer, worker_pb2_grpc.WorkerServicer):
    """Registered before the model loads; ``attach`` wires the runner once it has."""

    def __init__(self, shell: WorkerShell, metrics: PrefillMetrics) -> None:
        self.shell = shell
        self.metrics = metrics
        self.runner: ModelRunner | None = None
        self.sched: PrefillScheduler | None = None
        self.sampler: Sampler | None = None
        self.sender: KVSender | None = None
        self._wake = asyncio.Event()
        self._running_tokens = 0
        self._running = 0
        self._task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()

    def attach(
        self, runner: ModelRunner, sampler: Sampler, sender: KVSender, max_batched_tokens: int
    ) -> None:
        self.runner, self.sampler, self.sender = runner, sampler, sender
        self.sched = PrefillScheduler(BlockManager(runner.num_blocks, runner.block_size), max_batched_tokens)
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._background:
            await asyncio.wait(self._background, timeout=10)

    def load(self) -> worker_pb2.WorkerLoad:
        if self.sched is None:
            return worker_pb2.WorkerLoad(state=self.shell.state.proto)
        bm = self.sched.block_manager
        self.metrics.set_queue_tokens(self.sched.queued_tokens + self._running_tokens)
        return worker_pb2.WorkerLoad(
            state=self.shell.state.proto,
            running=self._running,
            queued=self.sched.num_queued,
            queued_prefill_tokens=self.sched.queued_tokens + self._running_tokens,
            kv_blocks_used=bm.num_used,
            kv_blocks_total=bm.num_blocks,
        )

    async def Generate(self, request, context):  # noqa: N802
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED, "this is a prefill worker; Generate goes to decode"
        )

    async def Prefill(self, request: worker_pb2.PrefillRequest, context) -> worker_pb2.PrefillResponse:  # noqa: N802
        assert self.sched is not None and self.runner is not None, "the shell admits requests once attached"
        rid = request.request_id
        prompt = list(request.prompt_token_ids)
        try:
            params = sampling_params_from_proto(request.sampling)
            validate_prompt_token_ids(
                prompt,
                vocab_size=self.runner.config.vocab_size,
                max_model_len=self.runner.config.max_position_embeddings,
                name="prompt_token_ids",
            )
            ticket = TransferTicket.decode(request.transfer_ticket)
            if ticket.num_tokens != len(prompt):
                raise ValueError(f"ticket reserves {ticket.num_tokens} tokens for a prompt of {len(prompt)}")
            job = PrefillJob(rid, prompt)
            self.sched.add(job)  # ValueError when it can never fit this worker's cache
        except (ValueError, IncompatibleError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        req = _Req(params, ticket, asyncio.get_running_loop().create_future())
        job.payload = req
        self._wake.set()
        timeout = request.deadline_unix - time.time() if request.deadline_unix > 0 else None
        try:
            async with asyncio.timeout(timeout):
                first, forward_s = await asyncio.shield(req.result)
        except TimeoutError:
            self._give_up(job, "deadline")
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"request {rid} passed its deadline in prefill"
            )
        except asyncio.CancelledError:
            self._give_up(job, "cancelled by the router")
            raise
        except TransferError as e:
            # ABORTED, not UNAVAILABLE: this worker is alive; the transfer failed.
            await context.abort(grpc.StatusCode.ABORTED, f"KV transfer for {rid} failed: {e}")
        except RuntimeError as e:
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
        return worker_pb2.PrefillResponse(
            first_token_id=first, prefill_seconds=forward_s, first_token_unix=time.time()
        )

    def _give_up(self, job: PrefillJob, reason: str) -> None:
        """The router no longer wants the result. Blocks are freed by whoever holds the job now."""
        assert self.sched is not None
        req: _Req = job.payload
        req.cancelled = True
        if job.stage is Stage.QUEUED:
            self.sched.cancel(job)  # no blocks, no transfer yet
            return
        if req.handle is not None:
            # Tell the decode worker now; the loop frees P's blocks once the forward and sends are done.
            self._spawn(req.handle.abort(reason))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _finish(self, job: PrefillJob, first: int | None) -> None:
        """Complete (or abort) the job's transfer, then free its blocks: no send reads them after this."""
        assert self.sched is not None
        req: _Req = job.payload
        try:
            if req.handle is not None:
                if first is None or req.cancelled:
                    await req.handle.abort("prefill cancelled")
                else:
                    await req.handle.complete(first)
        except TransferError as e:
            log.warning("transfer of %s ended with %s", job.request_id, e)
        except Exception:
            log.exception("transfer of %s failed", job.request_id)
            if req.handle is not None:
                await req.handle.abort("error")
        finally:
            self.sched.finish(job)
            self._wake.set()

    async def _open(self, batch: list[PrefillJob]) -> list[PrefillJob]:
        """Open every job's transfer (handshake per new peer); jobs that fail are answered and freed."""
        assert self.sender is not None
        opened = await asyncio.gather(
            *(self.sender.open(j.payload.ticket, j.block_table) for j in batch), return_exceptions=True
        )
        live = []
        for job, h in zip(batch, opened, strict=True):
            req: _Req = job.payload
            if isinstance(h, BaseException):
                if not req.result.done():
                    req.result.set_exception(h if isinstance(h, TransferError) else RuntimeError(repr(h)))
                self.sched.finish(job)  # nothing was sent
                continue
            req.handle = h
            if req.cancelled:
                self._spawn(self._finish(job, None))
                continue
            live.append(job)
        return live

    async def _loop(self) -> None:
        """Forever: take a batch under the budget, open its transfers, run the forward, hand out tokens."""
        assert self.sched is not None and self.runner is not None and self.sampler is not None
        while True:
            batch = self.sched.schedule()
            if not batch:
                self._wake.clear()
                await self._wake.wait()
                continue
            live = await self._open(batch)
            if not live:
                continue
            handles = [j.payload.handle for j in live]
            items = [PrefillItem(j.prompt_token_ids, j.block_table) for j in live]

            def hook(layer: int, k: torch.Tensor, v: torch.Tensor, handles=handles, live=live) -> None:
                # Forward thread, right after ``layer`` wrote its K/V into the cache: queue the send.
                # A batch nobody waits for any more stops at the next layer, so its blocks come back
                # within one layer's time instead of a whole forward's.
                if all(j.payload.cancelled for j in live):
                    raise _BatchCancelled
                for h in handles:
                    h.push_layer(layer)

            self._running, self._running_tokens = len(live), sum(j.num_tokens for j in live)
            t0 = time.perf_counter()
            try:
                logits = await asyncio.to_thread(self.runner.prefill, items, hook)  # [n, V]
                tokens = self.sampler(logits, [SampleRow(j.payload.params, 0) for j in live])
            except _BatchCancelled:
                for j in live:
                    self._spawn(self._finish(j, None))
                continue
            except Exception as e:  # noqa: BLE001 - fail the batch, keep serving
                log.exception("prefill forward failed")
                for j in live:
                    if not j.payload.result.done():
                        j.payload.result.set_exception(RuntimeError(f"prefill failed: {e!r}"))
                    self._spawn(self._finish(j, None))
                continue
            finally:
                self._running, self._running_tokens = 0, 0
            dt = time.perf_counter() - t0
            self.metrics.observe_prefill(dt, sum(j.num_tokens for j in live))
            for j, tok in zip(live, tokens, strict=True):
                req = j.payload
                if req.cancelled or req.result.done():
                    self._spawn(self._finish(j, None))
                    continue
                # Answer the router first (TTFT), then complete the transfer in the background.
                req.result.set_result((int(tok), dt))
                self._spawn(self._finish(j, int(tok)))


async def serve(args: WorkerArgs) -> None:
    """Run a prefill worker until it has drained."""
    from engine.llm_engine import DTYPES
    from engine.registry import resolve_model
    from engine.tokenizer import Tokenizer

    registry = process_registry(args.role.value)
    metrics_endpoint = serve_metrics(registry, args.host, args.metrics_port)
    shell = WorkerShell(args.shell_config())
    servicer = PrefillServicer(shell, PrefillMetrics(registry))
    address = await shell.start(lambda server: worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server))
    shell.install_signal_handlers()
    model_dir = await asyncio.to_thread(resolve_model, args.model, args.cache_dir)
    kv_bytes = args.kv_cache_bytes or (None if args.kv_blocks else DEFAULT_PREFILL_KV_BYTES)
    runner = await asyncio.to_thread(
        ModelRunner,
        model_dir,
        dtype=DTYPES[args.dtype],
        block_size=args.block_size,
        num_blocks=args.kv_blocks or None,
        kv_cache_bytes=kv_bytes,
    )
    eos = list(runner.config.eos_token_ids)
    try:
        eos += [t for t in Tokenizer.from_dir(model_dir).eos_token_ids if t not in eos]
    except FileNotFoundError:
        pass
    sampler = Sampler(tuple(eos), device=runner.kv.device)
    sender = KVSender(
        runner.kv,
        compat_for(runner.kv, model_dir.name),
        args.transfer_config(),
        registry,
        name=args.worker_id,
    )
    servicer.attach(runner, sampler, sender, args.max_batched_tokens)
    await shell.set_serving()
    agent = RouterAgent(
        AgentConfig(router_address=args.router),
        args.worker_info(
            address,
            kv_blocks_total=runner.num_blocks,
            context_length=runner.config.max_position_embeddings,
            pid=os.getpid(),
            metrics_url=metrics_endpoint.url,
        ),
        load=servicer.load,
        on_drain=shell.begin_drain,
    )
    try:
        await run_worker(shell, agent)
    finally:
        await servicer.close()
        await sender.close()
        metrics_endpoint.close()
        log.info("prefill worker %s stopped", args.worker_id)
