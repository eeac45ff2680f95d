"""What a :class:`~kv_transfer.testing.PeerProcess` can be asked to do (runs in the child)."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import msgspec
import torch
from prometheus_client import generate_latest

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.hugepages import SharedTensor, zeros_huge_pages
from pdserve.kv_transfer.config import FaultConfig
from pdserve.kv_transfer.kvbuf import block_bytes, compat_for
from pdserve.kv_transfer.receiver import KVReceiver
from pdserve.kv_transfer.sender import KVSender
from pdserve.kv_transfer.split import RankCaches
from pdserve.kv_transfer.testing.spec import (
    PeerSpec,
    expected_bytes,
    fingerprint,
    head_split,
    scatter_allocate,
)
from pdserve.kv_transfer.wire import KVCompat, TransferTicket


class PeerState:
    def __init__(self, spec: PeerSpec) -> None:
        self.spec = spec
        dtype = getattr(torch, spec.dtype)
        self.heads = head_split(spec.num_kv_heads, spec.tp_size)
        shape = (spec.num_layers, spec.num_blocks, 2, spec.block_size, len(self.heads[0]), spec.head_dim)
        # On CUDA this also creates the process's CUDA context, which must exist before ucxx starts
        # (start_receiver, the first sender, the raw baseline): UCX's CUDA transports look for it then.
        self._shared: SharedTensor | None = None
        if spec.kv_shared:
            self._shared = SharedTensor(*shape, dtype=dtype)
            self.kv = self._shared.tensor
        elif spec.huge_pages:
            self.kv = zeros_huge_pages(*shape, dtype=dtype, device=spec.device)  # [L, N, 2, B, Hkv, D]
        else:
            self.kv = torch.zeros(shape, dtype=dtype, device=spec.device)
        self.block_bytes = block_bytes(self.kv)
        self.kv_bytes = self.kv.view(spec.num_layers, spec.num_blocks, -1).view(torch.uint8)  # [L, N, bytes]
        self.blocks = BlockManager(spec.num_blocks, spec.block_size)
        self.compat: KVCompat = compat_for(self.kv, spec.model_id, num_kv_heads=spec.num_kv_heads)
        # Tensor parallelism: the other ranks' caches, in shared memory (a group's followers' are).
        self._rank_shared = [SharedTensor(*shape, dtype=dtype) for _ in self.heads[1:]]
        self.ranks: RankCaches | None = None
        if spec.tp_size > 1:
            fds = (None if self._shared is None else self._shared.fd, *(t.fd for t in self._rank_shared))
            self.ranks = RankCaches((self.kv, *(t.tensor for t in self._rank_shared)), self.heads, fds)
        self.receiver: KVReceiver | None = None
        self.senders: dict[tuple[int | None, FaultConfig | None, str], KVSender] = {}
        self.raw: Any = None
        self._snapshots: dict[str, tuple[list[int], str]] = {}
        self._handles: dict[str, Any] = {}  # request id -> its latest SenderHandle
        # reserve(track=True): a task awaiting the transfer, and when it resolved (perf_counter:
        # one clock for every process of the host, so the benchmark can subtract P's start).
        self._landings: dict[str, asyncio.Task[tuple[Any, float]]] = {}
        # Stand-ins for the model's forward thread, started once like the engine's.
        self._forward_threads = ThreadPoolExecutor(max_workers=32, thread_name_prefix="fake-forward")

    async def dispatch(self, command: str, kwargs: dict[str, Any]) -> Any:
        fn = getattr(self, f"cmd_{command}", None)
        if fn is None:
            raise ValueError(f"unknown command {command!r}")
        result = fn(**kwargs)
        return await result if asyncio.iscoroutine(result) else result

    async def close(self) -> None:
        for task in self._landings.values():
            task.cancel()
        self._landings.clear()
        for obj in (*self.senders.values(), self.receiver, self.raw):
            if obj is not None:
                await obj.close()
        self.senders.clear()
        self.receiver = self.raw = None
        self._forward_threads.shutdown(wait=False, cancel_futures=True)

    # -- decode side -------------------------------------------------------
    async def cmd_start_receiver(self) -> str:
        fd = None if self._shared is None else self._shared.fd
        self.receiver = KVReceiver(
            self.kv, self.blocks, self.compat, self.spec.config, shared_fd=fd, ranks=self.ranks
        )
        await self.receiver.start()
        return self.receiver.address

    def cmd_reserve(
        self,
        request_id: str,
        num_tokens: int,
        deadline_s: float | None = None,
        keep_every: int = 0,
        snapshot: bool = True,
        track: bool = False,
    ) -> bytes:
        """Reserve; ``snapshot`` records the blocks' digest for ``untouched`` (reads every byte);
        ``track``: ``wait`` also says when the transfer resolved here (``landed_at``)."""
        assert self.receiver is not None
        if keep_every:  # fragment the free list so the reservation gets scattered block ids
            fillers = [f"__filler_{request_id}_{i}" for i in range(self.blocks.num_free)]
            for f in fillers:
                self.blocks.allocate(f, 1)
            for i, f in enumerate(fillers):
                if i % keep_every != 0:
                    self.blocks.free(f)
            try:
                ticket = self.receiver.reserve(request_id, num_tokens, deadline_s)
            finally:
                for f in fillers:
                    self.blocks.free(f)
        else:
            ticket = self.receiver.reserve(request_id, num_tokens, deadline_s)
        if track:
            task = self._landings[request_id] = asyncio.get_running_loop().create_task(
                self._landing(request_id)
            )
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no warning
        blocks = list(ticket.block_ids)
        digest = fingerprint(self.kv_bytes[:, blocks]) if snapshot else ""
        self._snapshots[request_id] = (blocks, digest)
        return ticket.encode()

    async def cmd_wait(self, request_id: str, timeout: float = 30.0) -> dict[str, Any]:
        assert self.receiver is not None
        landing = self._landings.pop(request_id, None)
        landed_at = None
        if landing is None:
            res = await asyncio.wait_for(self.receiver.wait(request_id), timeout)
        else:
            res, landed_at = await asyncio.wait_for(asyncio.shield(landing), timeout)
        return {
            "first_token_id": res.first_token_id,
            "block_ids": list(res.block_ids),
            "bytes": res.bytes,
            "landed_at": landed_at,
        }

    async def _landing(self, request_id: str) -> tuple[Any, float]:
        assert self.receiver is not None
        res = await self.receiver.wait(request_id)
        return res, time.perf_counter()

    def cmd_verify(self, request_id: str, seed: int) -> bool:
        blocks, _ = self._snapshots[request_id]
        if self.ranks is not None:
            return all(
                torch.equal(got[:, blocks].reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
                for got, want in zip(self.ranks.kv, self._logical_by_rank(seed, len(blocks)), strict=True)
            )
        expected = expected_bytes(seed, self.spec.num_layers, len(blocks), self.block_bytes)
        return bool(torch.equal(self.kv_bytes[:, blocks].cpu(), expected))  # device KV: a host copy

    def _logical_by_rank(self, seed: int, num_blocks: int) -> list[torch.Tensor]:
        """Tensor parallelism: the seeded KV of ``num_blocks`` blocks over every head, as each rank holds
        it (``[L, n, 2, B, h, D]``)."""
        s = self.spec
        whole_block = 2 * s.block_size * s.num_kv_heads * s.head_dim * self.kv.element_size()
        logical = expected_bytes(seed, s.num_layers, num_blocks, whole_block).view(self.kv.dtype)
        logical = logical.view(s.num_layers, num_blocks, 2, s.block_size, s.num_kv_heads, s.head_dim)
        return [logical[..., h.start : h.stop, :].contiguous() for h in self.heads]

    def cmd_untouched(self, request_id: str) -> bool:
        blocks, digest = self._snapshots[request_id]
        return fingerprint(self.kv_bytes[:, blocks]) == digest

    def cmd_release(self, request_id: str) -> bool:
        """The decode engine's part after a successful hand-over: free the request's blocks."""
        return self.blocks.free(request_id)

    def cmd_abort(self, request_id: str, reason: str = "test") -> bool:
        assert self.receiver is not None
        return self.receiver.abort(request_id, reason)

    def cmd_progress(self, request_id: str) -> int:
        """Decode side: layers landed (tagged) or reported put (RMA: ``KVReceiver.progress``)."""
        assert self.receiver is not None
        return self.receiver.progress(request_id)

    def cmd_sent(self, request_id: str) -> int:
        """Prefill side: layers of ``request_id`` sent so far (RMA puts leave no trace at the receiver
        until Complete, so tests follow a transfer's progress here)."""
        handle = self._handles.get(request_id)
        return handle.layers_sent if handle is not None else 0

    def cmd_blocks(self) -> dict[str, int]:
        self.blocks.check_invariants()
        draining = self.receiver.draining if self.receiver is not None else 0
        return {"free": self.blocks.num_free, "total": self.blocks.num_blocks, "draining": draining}

    def cmd_control_requests(self) -> int:
        """UCX requests of control frames not yet freed: one posted receive per live connection."""
        from pdserve.kv_transfer.transports import ucp_tag

        return ucp_tag.pending()

    def cmd_metrics(self) -> str:
        parts = [
            generate_latest(x.metrics.registry).decode() for x in (self.receiver, *self.senders.values()) if x
        ]
        return "".join(parts)

    # -- prefill side ------------------------------------------------------
    def _sender(self, protocol_version: int | None, faults: FaultConfig | None, sender_name: str) -> KVSender:
        key = (protocol_version, faults, sender_name)
        sender = self.senders.get(key)
        if sender is None:
            compat = self.compat
            if protocol_version is not None:
                compat = msgspec.structs.replace(compat, protocol_version=protocol_version)
            config = self.spec.config if faults is None else replace(self.spec.config, faults=faults)
            sender = self.senders[key] = KVSender(self.kv, compat, config, ranks=self.ranks)
        return sender

    async def cmd_connect(
        self, address: str, faults: FaultConfig | None = None, sender_name: str = ""
    ) -> None:
        """Connect ``transfer``'s sender for (``faults``, ``sender_name``) now: tickets reserved after
        this are newer than its connection (eager puts, revokes)."""
        await self._sender(None, faults, sender_name).connect(address)

    async def cmd_transfer(
        self,
        ticket: bytes,
        seed: int,
        keep_every: int = 0,
        layer_interval_s: float = 0.0,
        first_token_id: int = 7,
        abort_after_layers: int | None = None,
        protocol_version: int | None = None,
        faults: FaultConfig | None = None,
        sender_name: str = "",
        fill: bool = True,
        burst: int = 0,
    ) -> dict[str, Any]:
        """Fill source blocks with seeded bytes, open, push every layer from a fake forward, complete.

        ``protocol_version``, ``faults`` and ``sender_name`` select a separate
        sender (its own connection) that claims another protocol version,
        injects faults, or is just another sender. ``fill=False`` sends the
        blocks as they are (the benchmark: the fill writes every byte right
        before the timed part, which the raw baseline's buffers never get).
        ``burst``: the fake forward pushes that many layers per call (``push_layers``, as a prefill
        under a CUDA graph pushes all of them at once); 0: one ``push_layer`` per layer.
        """
        sender = self._sender(protocol_version, faults, sender_name)
        t = TransferTicket.decode(ticket)
        seq = f"src-{sender_name}-{t.request_id}"  # two senders may hold the same ticket
        if keep_every:
            src = scatter_allocate(self.blocks, seq, t.num_tokens, keep_every)
        else:
            src = self.blocks.allocate(seq, t.num_tokens)
        try:
            if fill and self.ranks is not None:
                for kv, part in zip(self.ranks.kv, self._logical_by_rank(seed, len(src)), strict=True):
                    kv[:, src] = part
            elif fill:  # device KV: an asynchronous copy, ordered before the sends by push_layer's CUDA event
                seeded = expected_bytes(seed, self.spec.num_layers, len(src), self.block_bytes)
                self.kv_bytes[:, src] = seeded.to(self.kv.device)
            loop = asyncio.get_running_loop()
            t0 = time.perf_counter()
            handle = await sender.open(t, src)
            self._handles[t.request_id] = handle
            t1 = time.perf_counter()
            last = self.spec.num_layers if abort_after_layers is None else abort_after_layers
            pushed: asyncio.Future[None] = loop.create_future()

            def forward() -> None:  # stands in for the model's forward thread
                try:
                    step = burst or 1
                    for layer in range(0, last, step):
                        if layer_interval_s:  # the layer's compute
                            time.sleep(layer_interval_s)
                        if handle.error is not None:  # a prefill loop may stop early; push is a no-op anyway
                            return
                        if burst:
                            handle.push_layers(layer, min(step, last - layer))
                        else:
                            handle.push_layer(layer)
                finally:
                    loop.call_soon_threadsafe(pushed.set_result, None)

            self._forward_threads.submit(forward)
            await pushed
            t2 = time.perf_counter()
            if abort_after_layers is not None:
                await handle.abort("test abort")
                return {"aborted": True}
            stats = await handle.complete(first_token_id)
            t3 = time.perf_counter()
            return {
                "started_at": t0,
                "wall_seconds": t3 - t0,
                "open_seconds": t1 - t0,
                "push_seconds": t2 - t1,
                "complete_seconds": t3 - t2,
                "seconds": stats.seconds,
                "bytes": stats.bytes,
                "messages": stats.messages,
                "writes_per_layer": stats.writes_per_layer,
                "rma": handle.rma,
                # How this transfer's KV moved (``metrics.TRANSFER_PATHS``): the benchmark reports it,
                # so that a fallback (e.g. device memory not written by puts) shows. The handle says;
                # the opened-by-path counters would mean collecting the whole metrics registry twice a
                # transfer, right before and after the timed part.
                "path": handle.path,
                "layer_seconds": list(stats.layer_seconds),
            }
        finally:
            self.blocks.free(seq)

    # -- raw ucxx baseline -------------------------------------------------
    async def cmd_raw_serve(self, nbytes: int, count: int = 1) -> str:
        from pdserve.kv_transfer.testing.baseline import RawBaseline

        if self.raw is None:
            self.raw = RawBaseline(self.spec.config, self.spec.device)
        return await self.raw.serve(nbytes, count)

    async def cmd_raw_run(self, address: str, nbytes: int, reps: int, count: int = 1) -> list[float]:
        from pdserve.kv_transfer.testing.baseline import RawBaseline

        if self.raw is None:
            self.raw = RawBaseline(self.spec.config, self.spec.device)
        return await self.raw.run(address, nbytes, reps, count)

    def cmd_raw_starts(self) -> list[float]:
        """perf_counter times at which the last ``raw_run``'s rounds began (the sender)."""
        return list(self.raw.starts) if self.raw is not None else []

    def cmd_raw_landings(self) -> list[float]:
        """perf_counter times at which served rounds' data had all arrived (the receiver); cleared."""
        if self.raw is None:
            return []
        landed, self.raw.landed = self.raw.landed, []
        return landed
