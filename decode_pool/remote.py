"""Remote prefill on a decode worker: reserve blocks, hand out a ticket, adopt when the KV is complete.

Stages (one ``Worker.Generate`` stream in REMOTE mode):

    RESERVING  blocks for the prompt taken in the engine's BlockManager under the
               request id (on the engine thread, between steps, so the scheduler
               never races a reservation)
    WAITING    the ticket went out as the stream's first message; the prefill
               worker pushes every layer into those blocks, then the completion
               with token 0
    ADOPTED    ``add_prefilled_request``: the engine owns the blocks from here on
    (then the engine's own stages: running -> finished)

Who frees: until adoption the receiver frees the reservation on any failure
(deadline, peer death, abort); on a client cancel this module aborts the
receiver's transfer and the engine's request (both idempotent). After adoption
the engine frees on finish or abort.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from decode_pool.engine_loop import EngineLoop
from engine.block_manager import OutOfBlocksError
from engine.params import SamplingParams
from kv_transfer import KVCompat, KVReceiver, TransferConfig, TransferError
from proto import worker_pb2


class RemotePrefill:
    def __init__(self, loop: EngineLoop, compat: KVCompat, config: TransferConfig, registry=None) -> None:
        self.loop = loop
        eng = loop.engine
        # The receiver runs on the event loop thread; BlockManager operations are atomic and the
        # scheduler treats OutOfBlocksError as "no room yet", so reserving here never corrupts a step.
        self.receiver = KVReceiver(eng.runner.kv, eng.block_manager, compat, config, registry)
        self.pending = 0  # requests reserved but not yet adopted

    async def start(self) -> None:
        await self.receiver.start()

    async def close(self) -> None:
        await self.receiver.close()

    async def run(
        self,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        context: grpc.aio.ServicerContext,
        deadline_s: float | None,
    ) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
        from decode_pool.worker import relay_deltas

        # Validate before reserving anything: a bad request must not cost blocks.
        await self.loop.call(lambda e: e.validate_request(prompt, params))
        try:
            ticket = self.receiver.reserve(rid, len(prompt), deadline_s)
        except OutOfBlocksError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"decode worker has no room: {e}")
        self.pending += 1
        adoption = asyncio.ensure_future(self._adopt(rid, prompt, params))
        try:
            yield worker_pb2.WorkerGenerateResponse(transfer_ticket=ticket.encode())
            # Shielded: whichever way the transfer ends, exactly one side frees the blocks.
            q = await asyncio.shield(adoption)
        except TransferError as e:
            # ABORTED, not UNAVAILABLE: this worker is alive; the transfer failed (the receiver freed).
            await context.abort(grpc.StatusCode.ABORTED, f"KV transfer for {rid} failed: {e}")
        except BaseException:
            self._give_up(rid, adoption)
            raise
        finally:
            self.pending -= 1
        try:
            async for msg in relay_deltas(q):
                yield msg
        finally:
            self.loop.abort(rid)

    async def _adopt(self, rid: str, prompt: list[int], params: SamplingParams):
        result = await self.receiver.wait(rid)
        # From here the blocks are the engine's: it frees them on finish or abort.
        return self.loop.submit_prefilled(rid, prompt, result.first_token_id, params)

    def _give_up(self, rid: str, adoption: asyncio.Future) -> None:
        """The stream ended before adoption (cancel, deadline). Free through whoever owns the blocks.

        While the transfer is live, only the receiver may free (a posted receive may still write);
        if it already completed, the blocks were handed over and the engine frees them (``abort``
        frees an id it never adopted).
        """
        if not adoption.done():
            self.receiver.abort(rid, "decode side gave up")

        def settle(fut: asyncio.Future) -> None:
            if not fut.cancelled() and fut.exception() is None:
                self.loop.abort(rid)

        adoption.add_done_callback(settle)
