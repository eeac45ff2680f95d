"""Remote prefill on a decode worker: reserve KV blocks, hand out the transfer ticket, fail a stalled
transfer, and adopt the request into the engine once its KV is complete. A stream moved here live from
another decode worker (``migration.py`` is the other end) comes the same way, its source as the writer.
Who frees the blocks at each step is the contract in ``kv_transfer/__init__.py``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from pdserve.decode_pool.engine_loop import EngineLoop
from pdserve.decode_pool.stream import relay_deltas
from pdserve.engine.block_manager import OutOfBlocksError
from pdserve.engine.params import SamplingParams
from pdserve.engine.prefix_hash import block_hashes
from pdserve.kv_transfer import KVCompat, KVReceiver, TransferConfig, TransferError
from pdserve.kv_transfer.reservation import RxState
from pdserve.kv_transfer.split import RankCaches
from pdserve.proto import worker_pb2


class RemotePrefill:
    """``run`` serves one ``Worker.Generate`` stream in REMOTE mode. A reservation lives as long as its
    request (queueing on a busy prefill worker never expires it); only a started transfer can stall."""

    def __init__(
        self,
        loop: EngineLoop,
        compat: KVCompat,
        config: TransferConfig,
        registry=None,
        stall_timeout_s: float = 30.0,
        ranks: RankCaches | None = None,
    ) -> None:
        """``ranks``: a tensor-parallel group's caches, each rank's heads received (``kv_transfer.split``)."""
        self.loop = loop
        self.stall_timeout_s = stall_timeout_s
        self.config = config
        eng = loop.engine
        # The receiver reserves on this (event loop) thread while the engine steps on its own: safe by
        # the rules of the block-ownership contract in kv_transfer/__init__.py.
        # A KV cache in shared memory (--kv-shared-memory) is offered to same-host prefill workers.
        shared_fd = eng.runner.kv_shared_fd
        self.receiver = KVReceiver(
            eng.runner.kv, eng.block_manager, compat, config, registry, shared_fd, ranks=ranks
        )
        self.pending = 0  # requests reserved but not yet adopted
        self._started: asyncio.Future[None] | None = None

    async def start(self) -> None:
        """Start receiving (idempotent; concurrent callers wait for the one start)."""
        if self._started is None:
            self._started = asyncio.ensure_future(self.receiver.start())
        await asyncio.shield(self._started)

    async def close(self) -> None:
        if self._started is not None:
            await self.receiver.close()

    async def run(
        self,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        context: grpc.aio.ServicerContext,
        deadline_s: float | None,
        output_offset: int = 0,
    ) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
        """``output_offset`` > 0: a stream moved here live, ``prompt`` its prompt and output tokens so
        far; the KV written is that of all its tokens but the last."""
        # Validate before reserving anything: a bad request must not cost blocks.
        await self.loop.call(lambda e: e.validate_request(prompt, params))
        await self.start()  # (a colocated worker's receiver starts with the first stream moved to it)
        eng = self.loop.engine
        bm = eng.block_manager
        kv_tokens = len(prompt) - 1 if output_offset else len(prompt)
        # The prompt's cached prefix is held, not received: the ticket tells P to send only the rest.
        hashes = (
            block_hashes(prompt[:kv_tokens], bm.block_size, eng.cache_salt)
            if bm.enable_prefix_caching
            else []
        )
        try:
            ticket = self.receiver.reserve(rid, kv_tokens, deadline_s, hashes)
        except OutOfBlocksError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"decode worker has no room: {e}")
        self.pending += 1
        adoption = asyncio.ensure_future(self._adopt(rid, prompt, params, output_offset))
        try:
            yield worker_pb2.WorkerGenerateResponse(transfer_ticket=ticket.encode())
            # Not cancelled by a cancel of this stream: whichever way the transfer ends, exactly one side
            # frees the blocks.
            q = await self._watch(rid, adoption)
        except TransferError as e:
            # ABORTED, not UNAVAILABLE: this worker is alive; the transfer failed. The router may move the
            # request back here under the same id: answer once the receiver has freed its blocks.
            await self._freed(rid)
            await context.abort(grpc.StatusCode.ABORTED, f"KV transfer for {rid} failed: {e}")
        except BaseException:
            self._give_up(rid, adoption)
            raise
        finally:
            self.pending -= 1
        try:
            async for msg in relay_deltas(q, params.n):
                yield msg
        finally:
            self.loop.abort(rid, q)  # this attempt's: never a newer one's of the id

    async def _watch(self, rid: str, adoption: asyncio.Future):
        """Wait for ``adoption``; fail the transfer when it started and then made no progress for
        ``stall_timeout_s`` (counted from Open, then from each landed layer): a prefill worker that hangs
        mid-transfer (one that dies is seen at once by the receiver's connection). One-sided puts land
        unseen here, so the sender reports them with Progress frames: a long forward is no stall."""
        tick = min(self.stall_timeout_s / 4, 0.5)
        clock = asyncio.get_running_loop().time
        progress, since = (None, 0), clock()
        while True:
            done, _ = await asyncio.wait((adoption,), timeout=tick)
            if done:
                return adoption.result()
            now = (self.receiver.state(rid), self.receiver.progress(rid))
            if now != progress or now[0] is not RxState.OPEN:
                progress, since = now, clock()
            elif clock() - since > self.stall_timeout_s:
                self.receiver.abort(rid, f"the transfer made no progress for {self.stall_timeout_s:g}s")

    async def _freed(self, rid: str) -> None:
        """Until a failed reservation's blocks are back (bounded: the receiver's settle timeouts)."""
        await blocks_freed(self.loop.engine.block_manager, rid, 3 * self.config.settle_timeout_s)

    async def _adopt(self, rid: str, prompt: list[int], params: SamplingParams, output_offset: int):
        result = await self.receiver.wait(rid)
        # From here the blocks are the engine's: it frees them on finish or abort.
        if output_offset:
            return self.loop.submit_migrated(rid, prompt, output_offset, params)
        return self.loop.submit_prefilled(rid, prompt, result.first_token_id, params, result.choice_token_ids)

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
                self.loop.abort(rid, fut.result())

        adoption.add_done_callback(settle)


async def blocks_freed(blocks, rid: str, timeout_s: float) -> bool:
    """Wait until ``rid`` holds no blocks in ``blocks`` (a BlockManager), at most ``timeout_s``.

    A request the router moves off a failed prefill worker may come back to this decode worker under the
    same id while the receiver still settles the old reservation (it frees only once no write can land).
    """
    clock = asyncio.get_running_loop().time
    end = clock() + timeout_s
    while rid in blocks:
        if clock() >= end:
            return False
        await asyncio.sleep(0.01)
    return True
