"""The decode worker's gRPC face (roles ``decode`` and ``both``): ``Worker.Generate`` and load reports over
the engine loop and ``RemotePrefill``, which ``app.py`` builds and wires here. A request is prefilled by
the engine itself (LOCAL mode) or by a prefill worker (REMOTE mode, ``remote.py``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from pdserve.decode_pool.engine_loop import EngineDied, EngineLoop, StepFailed
from pdserve.decode_pool.metrics import DecodeMetrics
from pdserve.decode_pool.migration import StreamExport
from pdserve.decode_pool.remote import RemotePrefill, blocks_freed
from pdserve.decode_pool.stream import relay_deltas
from pdserve.engine.params import SamplingParams
from pdserve.kv_transfer import TransferConfig, TransferError
from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.worker.convert import request_id_from_metadata, sampling_params_from_proto
from pdserve.worker.shell import RETRY_ELSEWHERE_KEY, PoolServicer, WorkerShell

log = logging.getLogger(__name__)

# The reservation of a request without a deadline: freed when its stream ends (the router's cancel).
_NO_DEADLINE_S = 24 * 3600.0


class DecodeServicer(PoolServicer, worker_pb2_grpc.WorkerServicer):
    """Registered before the model loads; ``attach`` wires the engine once it has.

    Until then the shell's interceptor rejects Generate/Prefill (it is not SERVING)
    and GetLoad reports the shell's state with no capacity.
    """

    def __init__(
        self,
        shell: WorkerShell,
        transfer_config: TransferConfig,
        metrics: DecodeMetrics,
        admit_limit: int = 1 << 30,
    ) -> None:
        """``admit_limit``: requests this worker holds at most (running plus waiting); more are refused
        (RESOURCE_EXHAUSTED, the router routes them again): several routers admit into it at once, each
        counting only its own requests."""
        self.shell = shell
        self.admit_limit = admit_limit
        self.admitted = 0  # Generate calls in progress here
        self.metrics = metrics
        self.transfer_config = transfer_config
        self.loop: EngineLoop | None = None
        self.remote: RemotePrefill | None = None
        self.export: StreamExport | None = None
        self.remote_prefill = False  # takes REMOTE mode (role decode); MIGRATE needs only ``remote``

    def attach(
        self,
        loop: EngineLoop,
        remote: RemotePrefill | None,
        export: StreamExport | None = None,
        remote_prefill: bool = True,
    ) -> None:
        self.loop, self.remote, self.export = loop, remote, export
        self.remote_prefill = remote_prefill and remote is not None

    def load(self) -> worker_pb2.WorkerLoad:
        if self.loop is None:
            return worker_pb2.WorkerLoad(state=self.shell.state.proto)
        eng = self.loop.engine
        bm = eng.block_manager
        s = eng.scheduler
        self.metrics.set_kv_usage(bm.num_used, bm.num_blocks)
        self.metrics.set_preemptions(s.num_preemptions)
        if eng.speculator is not None:
            self.metrics.set_speculation(eng.speculator.stats)
        self.metrics.prefix_cache.update(
            s.prefix_query_tokens, s.prefix_hit_tokens, bm.num_evictions, bm.num_cached
        )
        self.metrics.prefix_cache.check(bm)
        return worker_pb2.WorkerLoad(
            state=self.shell.state.proto,
            running=len(s.running),
            queued=len(s.waiting) + (self.remote.pending if self.remote else 0),
            queued_prefill_tokens=sum(len(q.prompt_token_ids) for q in list(s.waiting)),
            kv_blocks_used=bm.num_used,
            kv_blocks_total=bm.num_blocks,
            kv_blocks_cached=bm.num_cached,
            prefill_tokens_per_s=self.metrics.prefill.rate.tokens_per_s,
        )

    async def Prefill(self, request, context):  # noqa: N802
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED, "this is a decode worker; Prefill goes to the prefill pool"
        )

    async def Generate(self, request: worker_pb2.WorkerGenerateRequest, context):  # noqa: N802
        assert self.loop is not None, "the shell admits requests only once the engine is attached"
        rid = request.request_id
        meta_id = request_id_from_metadata(context.invocation_metadata())
        log.debug("Generate %s (x-request-id %s)", rid, meta_id)
        try:
            params = sampling_params_from_proto(request.sampling)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.{e}")
        timeout = None
        if request.deadline_unix > 0:
            timeout = request.deadline_unix - time.time()
            if timeout <= 0:
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before decode started"
                )
        remote = request.mode == worker_pb2.PREFILL_MODE_REMOTE
        migrate = request.mode == worker_pb2.PREFILL_MODE_MIGRATE
        if remote and request.output_offset:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "output_offset needs local prefill mode")
        if (remote or migrate) and request.resumed_choices:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "resumed_choices needs local prefill mode")
        if remote and not self.remote_prefill:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "remote prefill needs role decode")
        if migrate and not 0 < request.output_offset < len(request.prompt_token_ids):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "a migrated stream needs output_offset in [1, len(prompt_token_ids))",
            )
        if migrate and self.remote is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this worker takes no migrated streams")
        if self.admitted >= self.admit_limit:
            self.metrics.refused_full.inc()
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"decode worker has no room: {self.admitted} requests here, at most {self.admit_limit} "
                "(--max-running plus --max-queued)",
            )
        self.admitted += 1
        try:
            async for msg in self._generate(request, params, timeout, context):
                yield msg
        finally:
            self.admitted -= 1

    async def _generate(
        self,
        request: worker_pb2.WorkerGenerateRequest,
        params: SamplingParams,
        timeout: float | None,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
        """Generate, admitted: the local or remote choreography of one attempt."""
        assert self.loop is not None
        rid, prompt = request.request_id, list(request.prompt_token_ids)
        remote = request.mode in (worker_pb2.PREFILL_MODE_REMOTE, worker_pb2.PREFILL_MODE_MIGRATE)
        offset = request.output_offset if request.mode == worker_pb2.PREFILL_MODE_MIGRATE else 0
        # A new attempt of an id means the router gave the earlier one up: end it in the engine now (its
        # stream's own abort may come later), before this attempt validates (a call the engine thread
        # runs after it) and reserves blocks under the id.
        self.loop.end_earlier_attempt(rid)
        # The same id may still hold blocks of a reservation that is settling (a retry of a request whose
        # prefill worker failed): it is freed within the receiver's settle timeouts.
        settle_s = 3 * self.transfer_config.settle_timeout_s
        if not await blocks_freed(self.loop.engine.block_manager, rid, settle_s):
            await context.abort(grpc.StatusCode.ABORTED, f"request {rid} still holds KV blocks here")
        try:
            async with asyncio.timeout(timeout):
                if remote:
                    assert self.remote is not None
                    # RemotePrefill frees on its own paths (the receiver before adoption, the engine after).
                    async for msg in self.remote.run(
                        rid, prompt, params, context, self.transfer_deadline(timeout), offset
                    ):
                        yield msg
                else:
                    choices = params.n
                    if request.resumed_choices:  # an n > 1 request's open choices, after a migration
                        resumed = [(c.index, list(c.token_ids)) for c in request.resumed_choices]
                        sub = self.loop.submit_choices(rid, prompt, params, resumed)
                        choices = len(resumed)
                    else:
                        sub = self.loop.submit(rid, prompt, params, request.output_offset)
                    try:
                        async for msg in relay_deltas(sub, choices):
                            yield msg
                    finally:
                        # Idempotent: a finished request holds nothing; a cancelled one is freed now. This
                        # attempt's only: never a newer attempt's of the id.
                        self.loop.abort(rid, sub)
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"request {rid} passed its deadline")
        except EngineDied as e:
            # This worker can serve nothing more (it drains and exits): UNAVAILABLE, which the router
            # reads as a dead worker, moving the request to another one.
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except StepFailed as e:  # this worker's fault, not the request's: the router moves it
            await context.abort(
                grpc.StatusCode.INTERNAL, str(e), trailing_metadata=((RETRY_ELSEWHERE_KEY, "step_failed"),)
            )
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    # -- live migration, the side a stream leaves (migration.py) ----------------
    async def Suspend(self, request: worker_pb2.SuspendRequest, context):  # noqa: N802
        export = await self._export(context)
        try:
            outputs, kv_tokens = await export.suspend(request.request_id)
        except ValueError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return worker_pb2.SuspendResponse(output_token_ids=outputs, kv_tokens=kv_tokens)

    async def Resume(self, request: worker_pb2.SuspendRequest, context):  # noqa: N802
        export = await self._export(context)
        try:
            if not await export.resume(request.request_id):
                await context.abort(
                    grpc.StatusCode.NOT_FOUND, f"request {request.request_id} is not suspended here"
                )
        except ValueError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return worker_pb2.Empty()

    async def ExportKV(self, request: worker_pb2.ExportKVRequest, context):  # noqa: N802
        export = await self._export(context)
        try:
            stats = await export.export(request.request_id, request.transfer_ticket)
        except ValueError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except TransferError as e:
            await context.abort(grpc.StatusCode.ABORTED, f"the KV of {request.request_id} did not move: {e}")
        self.metrics.migrated_out(stats.bytes)
        return worker_pb2.ExportKVResponse(transfer_bytes=stats.bytes, transfer_seconds=stats.seconds)

    async def _export(self, context) -> StreamExport:
        if self.export is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is not loaded yet")
        assert self.export is not None
        return self.export

    def transfer_deadline(self, timeout: float | None) -> float:
        """A reservation lives as long as the request may: a prompt queued on a busy prefill worker is
        served, not expired (a started transfer that stalls fails by ``RemotePrefill``'s watch)."""
        return _NO_DEADLINE_S if timeout is None else max(timeout, 0.001)
