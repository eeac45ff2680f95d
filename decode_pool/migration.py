"""Live migration, the side a decoding stream leaves: hold it out of the batches (``suspend``), write its
KV into the destination's reservation as a prefill worker writes a prompt's (``export``), or put it back
when the move fails (``resume``). The router that routes the stream drives the move; the destination
adopts it through ``remote.RemotePrefill`` (``PREFILL_MODE_MIGRATE``)."""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import CollectorRegistry

from pdserve.decode_pool.engine_loop import EngineLoop
from pdserve.kv_transfer import KVCompat, KVSender, SendStats, TransferConfig
from pdserve.worker.ranks import rank_caches

log = logging.getLogger(__name__)


class StreamExport:
    """The export side of this worker's live migrations. Its KV sender connects on the first export."""

    def __init__(
        self, loop: EngineLoop, compat: KVCompat, config: TransferConfig, registry: CollectorRegistry | None
    ) -> None:
        self.loop = loop
        self.compat = compat
        self.config = config
        self.registry = registry
        self._sender: KVSender | None = None
        self._exporting: set[str] = set()

    async def suspend(self, request_id: str) -> tuple[list[int], int]:
        """Hold the stream out of the batches at the next step boundary: its output tokens so far and the
        tokens whose K/V it holds. ValueError when it is not a decoding stream of one choice here."""
        return await self.loop.call(lambda e: e.suspend(request_id))

    async def resume(self, request_id: str) -> bool:
        """The move failed: the stream decodes here again (False: it is not suspended, e.g. it ended)."""
        if request_id in self._exporting:
            raise ValueError(f"request {request_id!r} is being exported")
        return await self.loop.call(lambda e: e.resume(request_id))

    async def export(self, request_id: str, ticket: bytes) -> SendStats:
        """Write the suspended stream's KV into the reservation ``ticket`` names, as one transfer; returns
        once the destination acknowledged every layer. Its blocks stay held throughout, even if the stream
        ends meanwhile (a cancel): they are freed once nothing reads them."""
        if request_id in self._exporting:
            raise ValueError(f"request {request_id!r} is already being exported")
        self._exporting.add(request_id)
        try:
            blocks, last_token = await self.loop.call(lambda e: e.pin(request_id))
            try:
                handle = await (await self._started()).open(ticket, blocks)
                try:
                    # Off the event loop: a direct writer copies on the calling thread.
                    await asyncio.to_thread(handle.push_layers, 0, self.compat.num_layers)
                    return await handle.complete(last_token)
                except BaseException:
                    # Also on a cancel: the blocks are unpinned only once no send reads them.
                    await asyncio.shield(handle.abort("the export failed"))
                    raise
            finally:
                await self.loop.call(lambda e: e.unpin(request_id))
        finally:
            self._exporting.discard(request_id)

    async def _started(self) -> KVSender:
        if self._sender is None:
            runner = self.loop.engine.runner
            self._sender = KVSender(
                runner.kv, self.compat, self.config, self.registry, "decode-export", rank_caches(runner)
            )
        return self._sender

    async def close(self) -> None:
        if self._sender is not None:
            await self._sender.close()
