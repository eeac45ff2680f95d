"""Decode worker (roles ``decode`` and ``both``): continuous batching over a paged KV cache.

Stages of a request on this worker (``Worker.Generate``, one stream per request):

LOCAL mode (short prompts, and every request on a colocated ``both`` worker)
    submitted -> engine waiting -> prefill step(s) -> running (decode steps)
    -> finished; tokens stream back as the engine produces them.
REMOTE mode (a prefill worker computes the prompt's KV)
    reserve blocks with the KV receiver -> first message: the transfer ticket
    -> every layer + the completion (carrying token 0) arrive -> adopted into
    the running batch (``add_prefilled_request``) -> decode steps -> finished.
Every exit (finish, client cancel, deadline, transfer failure, drain timeout)
frees the request's blocks: before adoption the receiver frees them, after it
the engine does; ``EngineLoop.abort`` covers both and is idempotent.

Stop strings are the router's job (it detokenizes); this worker stops on
token ids, max_tokens and the context limit, so it runs without
detokenizing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING

import grpc

from decode_pool.engine_loop import EngineLoop, QueueItem
from decode_pool.metrics import DecodeMetrics
from engine.llm_engine import EngineConfig, LLMEngine, RequestOutputDelta
from kv_transfer import TransferConfig, compat_for
from proto import worker_pb2, worker_pb2_grpc
from router.agent import AgentConfig, RouterAgent, run_worker
from router.metrics_http import process_registry, serve_metrics
from router.registry import Role
from router.validate import sampling_params_from_proto
from router.worker_shell import PoolServicer, WorkerArgs, WorkerShell

if TYPE_CHECKING:
    from decode_pool.remote import RemotePrefill

log = logging.getLogger(__name__)

DEFAULT_DECODE_KV_BYTES = 1 << 30  # 1 GiB: ~23k tokens of SmolLM2 in float32, ~46k in bfloat16


def engine_config(args: WorkerArgs) -> EngineConfig:
    kv_bytes = args.kv_cache_bytes or (None if args.kv_blocks else DEFAULT_DECODE_KV_BYTES)
    return EngineConfig(
        max_num_seqs=args.max_running,
        max_num_batched_tokens=args.max_batched_tokens,
        block_size=args.block_size,
        num_blocks=args.kv_blocks or None,
        kv_cache_bytes=kv_bytes,
        dtype=args.dtype,
        threads=args.threads,
        detokenize=False,
    )


class DecodeServicer(PoolServicer, worker_pb2_grpc.WorkerServicer):
    """Registered before the model loads; ``attach`` wires the engine once it has.

    Until then the shell's interceptor rejects Generate/Prefill (it is not SERVING)
    and GetLoad reports the shell's state with no capacity.
    """

    def __init__(self, shell: WorkerShell, transfer_config: TransferConfig, metrics: DecodeMetrics) -> None:
        self.shell = shell
        self.metrics = metrics
        self.transfer_config = transfer_config
        self.loop: EngineLoop | None = None
        self.remote: RemotePrefill | None = None

    def attach(self, loop: EngineLoop, remote: RemotePrefill | None) -> None:
        self.loop, self.remote = loop, remote

    def load(self) -> worker_pb2.WorkerLoad:
        if self.loop is None:
            return worker_pb2.WorkerLoad(state=self.shell.state.proto)
        eng = self.loop.engine
        bm = eng.block_manager
        s = eng.scheduler
        self.metrics.set_kv_usage(bm.num_used, bm.num_blocks)
        return worker_pb2.WorkerLoad(
            state=self.shell.state.proto,
            running=len(s.running),
            queued=len(s.waiting) + (self.remote.pending if self.remote else 0),
            queued_prefill_tokens=sum(len(q.prompt_token_ids) for q in list(s.waiting)),
            kv_blocks_used=bm.num_used,
            kv_blocks_total=bm.num_blocks,
        )

    async def Prefill(self, request, context):  # noqa: N802
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED, "this is a decode worker; Prefill goes to the prefill pool"
        )

    async def Generate(self, request: worker_pb2.WorkerGenerateRequest, context):  # noqa: N802
        assert self.loop is not None, "the shell admits requests only once the engine is attached"
        rid = request.request_id
        try:
            params = sampling_params_from_proto(request.sampling)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.{e}")
        prompt = list(request.prompt_token_ids)
        timeout = None
        if request.deadline_unix > 0:
            timeout = request.deadline_unix - time.time()
            if timeout <= 0:
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before decode started"
                )
        remote = request.mode == worker_pb2.PREFILL_MODE_REMOTE
        if remote and self.remote is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "remote prefill needs role decode")
        try:
            async with asyncio.timeout(timeout):
                if remote:
                    assert self.remote is not None
                    # RemotePrefill frees on its own paths (the receiver before adoption, the engine after).
                    async for msg in self.remote.run(
                        rid, prompt, params, context, self.transfer_deadline(timeout)
                    ):
                        yield msg
                else:
                    try:
                        async for msg in relay_deltas(self.loop.submit(rid, prompt, params)):
                            yield msg
                    finally:
                        # Idempotent: a finished request holds nothing; a cancelled one is freed now.
                        self.loop.abort(rid)
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"request {rid} passed its deadline")
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def transfer_deadline(self, timeout: float | None) -> float | None:
        """A reservation lives as long as the request may, capped by the transfer config's default."""
        return None if timeout is None else max(min(timeout, self.transfer_config.deadline_s), 0.001)


async def relay_deltas(q: asyncio.Queue[QueueItem]):
    """Turn engine deltas into stream messages, coalescing whatever is already queued.

    ``admitted_unix`` is when the first delta reached this side: the engine had
    taken the request into its batch by then.
    """
    admitted_unix = 0.0
    while True:
        item = await q.get()
        if not admitted_unix:
            admitted_unix = time.time()
        batch: list[RequestOutputDelta] = []
        done = False
        while True:
            if item is None:
                done = True
                break
            if isinstance(item, BaseException):
                raise item
            batch.append(item)
            if item.finish_reason is not None or q.empty():
                break
            item = q.get_nowait()
        if batch:
            ids = [t for d in batch for t in d.new_token_ids]
            last = batch[-1]
            yield worker_pb2.WorkerGenerateResponse(
                first_index=last.num_output_tokens - len(ids),
                token_ids=ids,
                finish_reason=last.finish_reason or "",
                admitted_unix=admitted_unix,
            )
            if last.finish_reason is not None:
                return
        if done:
            return


async def serve(args: WorkerArgs) -> None:
    """Run a decode (or colocated) worker until it has drained."""
    from engine.registry import resolve_model
    from engine.tokenizer import Tokenizer

    registry = process_registry(args.role.value)
    metrics = DecodeMetrics(registry, args.role.value)
    metrics_endpoint = serve_metrics(registry, args.host, args.metrics_port)
    shell = WorkerShell(args.shell_config())
    tconf = args.transfer_config()
    servicer = DecodeServicer(shell, tconf, metrics)
    address = await shell.start(lambda server: worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server))
    shell.install_signal_handlers()
    model_dir = await asyncio.to_thread(resolve_model, args.model, args.cache_dir)
    try:
        tokenizer = Tokenizer.from_dir(model_dir)
    except FileNotFoundError:
        tokenizer = None
    engine = await asyncio.to_thread(LLMEngine, model_dir, tokenizer, engine_config(args))
    loop = EngineLoop(engine, asyncio.get_running_loop())
    loop.on_step(metrics.observe_step)
    loop.start()
    remote = None
    if args.role is Role.DECODE:
        from decode_pool.remote import RemotePrefill

        remote = RemotePrefill(loop, compat_for(engine.runner.kv, model_dir.name), tconf, registry)
        await remote.start()
    servicer.attach(loop, remote)
    await shell.set_serving()
    agent = RouterAgent(
        AgentConfig(router_address=args.router),
        args.worker_info(
            address,
            kv_blocks_total=engine.block_manager.num_blocks,
            context_length=engine.max_model_len,
            pid=os.getpid(),
            metrics_url=metrics_endpoint.url,
        ),
        load=servicer.load,
        on_drain=shell.begin_drain,
    )
    try:
        await run_worker(shell, agent)
    finally:
        if remote is not None:
            await remote.close()
        await loop.stop()
        metrics_endpoint.close()
        log.info("decode worker %s stopped", args.worker_id)
