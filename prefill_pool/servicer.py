"""The prefill worker's gRPC face: ``Worker.Prefill``, ``AttachTicket`` and load reports over
``loop.PrefillLoop``, which ``app.py`` builds and wires here."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from pdserve.engine.params import validate_prompt_token_ids
from pdserve.kv_transfer import IncompatibleError, TransferError, TransferTicket
from pdserve.prefill_pool.loop import ForwardFailed, PrefillLoop, PrefillLoopStopped
from pdserve.prefill_pool.metrics import PrefillMetrics
from pdserve.prefill_pool.tickets import LateOpenFailed
from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.worker.convert import logprobs_to_proto, request_id_from_metadata, sampling_params_from_proto
from pdserve.worker.shell import RETRY_ELSEWHERE_KEY, PoolServicer, WorkerShell

log = logging.getLogger(__name__)


class PrefillServicer(PoolServicer, worker_pb2_grpc.WorkerServicer):
    """Registered before the model loads; ``attach`` wires the loop once it has."""

    def __init__(self, shell: WorkerShell, metrics: PrefillMetrics) -> None:
        self.shell = shell
        self.metrics = metrics
        self.loop: PrefillLoop | None = None

    def attach(self, loop: PrefillLoop) -> None:
        self.loop = loop

    def load(self) -> worker_pb2.WorkerLoad:
        if self.loop is None:
            return worker_pb2.WorkerLoad(state=self.shell.state.proto)
        sched = self.loop.sched
        bm = sched.block_manager
        queued_tokens = sched.queued_tokens + self.loop.running_tokens
        self.metrics.set_queue_tokens(queued_tokens)
        self.metrics.prefix_cache.update(
            sched.prefix_query_tokens, sched.prefix_hit_tokens, bm.num_evictions, bm.num_cached
        )
        self.metrics.prefix_cache.check(bm)
        return worker_pb2.WorkerLoad(
            state=self.shell.state.proto,
            running=self.loop.running,
            queued=sched.num_queued,
            queued_prefill_tokens=queued_tokens,
            kv_blocks_used=bm.num_used,
            kv_blocks_total=bm.num_blocks,
            kv_blocks_cached=bm.num_cached,
            prefill_tokens_per_s=self.metrics.rate.tokens_per_s,
        )

    async def Generate(self, request, context):  # noqa: N802
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED, "this is a prefill worker; Generate goes to decode"
        )

    async def Prefill(self, request: worker_pb2.PrefillRequest, context) -> worker_pb2.PrefillResponse:  # noqa: N802
        loop = self.loop
        assert loop is not None, "the shell admits requests once attached"
        rid = request.request_id
        meta_id = request_id_from_metadata(context.invocation_metadata())
        log.debug("Prefill %s (x-request-id %s)", rid, meta_id)
        prompt = list(request.prompt_token_ids)
        try:
            params = sampling_params_from_proto(request.sampling)
            validate_prompt_token_ids(
                prompt,
                vocab_size=loop.runner.config.vocab_size,
                max_model_len=loop.runner.config.max_position_embeddings,
                name="prompt_token_ids",
            )
            ticket = None  # empty: AttachTicket brings it (the router did not wait for the decode worker)
            if request.transfer_ticket:
                ticket = TransferTicket.decode(request.transfer_ticket)
                if ticket.num_tokens != len(prompt):
                    raise ValueError(
                        f"ticket reserves {ticket.num_tokens} tokens for a prompt of {len(prompt)}"
                    )
            deadline = None
            if request.deadline_unix > 0:
                deadline = asyncio.get_running_loop().time() + request.deadline_unix - time.time()
            # ValueError: can never fit the cache
            job, result = loop.submit(
                rid, prompt, params, ticket, deadline=deadline, attach_key=request.attach_key
            )
        except (ValueError, IncompatibleError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except PrefillLoopStopped as e:  # another prefill worker should take it
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        timeout = request.deadline_unix - time.time() if request.deadline_unix > 0 else None
        try:
            async with asyncio.timeout(timeout):
                first, forward_s = await asyncio.shield(result)
        except TimeoutError:
            loop.give_up(job, "deadline")
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"request {rid} passed its deadline in prefill"
            )
        except asyncio.CancelledError:
            loop.give_up(job, "cancelled by the router")
            raise
        except TransferError as e:
            # ABORTED, not UNAVAILABLE: this worker is alive; the transfer failed.
            await context.abort(grpc.StatusCode.ABORTED, f"KV transfer for {rid} failed: {e}")
        except PrefillLoopStopped as e:  # this worker drains and exits: the router moves the request
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except ForwardFailed as e:  # this worker's fault, not the prompt's: another worker prefills it
            await context.abort(
                grpc.StatusCode.INTERNAL, str(e), trailing_metadata=((RETRY_ELSEWHERE_KEY, "step_failed"),)
            )
        except RuntimeError as e:
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
        # When the token was sampled: the answer itself may go out after the decode worker has the KV.
        sampled_at = job.payload.first_token_unix or time.time()
        resp = worker_pb2.PrefillResponse(
            first_token_id=first,
            prefill_seconds=forward_s,
            first_token_unix=sampled_at,
            cached_tokens=job.cached_tokens,
            first_token_ids=(first, *job.payload.choice_tokens) if params.n > 1 else (),
        )
        if job.payload.first_logprobs is not None:
            resp.first_logprobs.CopyFrom(logprobs_to_proto([job.payload.first_logprobs])[0])
            resp.choice_logprobs.extend(logprobs_to_proto(job.payload.choice_logprobs))
        if job.payload.prompt_logprobs is not None:
            resp.prompt_logprobs.extend(logprobs_to_proto(job.payload.prompt_logprobs))
        return resp

    async def AttachTicket(self, request: worker_pb2.AttachTicketRequest, context) -> worker_pb2.Empty:  # noqa: N802
        """The ticket of a Prefill sent without one (empty: the router gave the request up)."""
        loop = self.loop
        if loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this prefill worker is still loading")
        assert loop is not None
        try:
            ticket = TransferTicket.decode(request.transfer_ticket) if request.transfer_ticket else None
            kept = await loop.attach_and_open(request.request_id, ticket, request.attach_key)
        except (ValueError, IncompatibleError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except LateOpenFailed as e:  # the decode side waits on its reservation: the router moves it
            await context.abort(grpc.StatusCode.ABORTED, str(e))
        if not kept:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"no room to keep the ticket of {request.request_id}"
            )
        return worker_pb2.Empty()
