"""The router's KV index: which workers hold which prefix-cache blocks, built only from the workers' own
events (``WorkerLoad.kv_events``), never from routing history, so every router of a cluster can hold one.
Pure logic: no grpc, no torch (the events are read through their fields)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.engine.prefix_hash import block_hashes
from pdserve.router.registry import Worker


class EventBatch(Protocol):
    """One heartbeat's events (``worker_pb2.KvEvents``)."""

    epoch: str
    seq: int
    snapshot: bool
    stored: Sequence[bytes]
    removed: Sequence[bytes]


@dataclass
class _Stream:
    """What the index knows of one worker process's event stream."""

    epoch: str
    next_seq: int  # the batch expected next; the one before it may come again (an unanswered re-send)
    blocks: set[bytes] = field(default_factory=set)


class KvIndex:
    def __init__(self) -> None:
        self._holders: dict[bytes, set[str]] = {}
        self._streams: dict[str, _Stream] = {}
        self.gaps = 0  # batches refused for a gap or an unknown epoch (a metric)

    def apply(self, worker_id: str, batch: EventBatch) -> bool:
        """Take a worker's batch; False when it cannot be applied (a gap in the numbering, or an epoch
        not seen before that is not a snapshot): the worker's entries are dropped until it sends a
        snapshot, which the caller asks for."""
        s = self._streams.get(worker_id)
        if batch.snapshot:
            self.drop(worker_id)
            s = self._streams[worker_id] = _Stream(batch.epoch, batch.seq)
        elif s is None or s.epoch != batch.epoch or batch.seq not in (s.next_seq, s.next_seq - 1):
            self.drop(worker_id)
            self.gaps += 1
            return False
        for h in batch.removed:
            if h in s.blocks:
                s.blocks.discard(h)
                holders = self._holders[h]
                holders.discard(worker_id)
                if not holders:
                    del self._holders[h]
        for h in batch.stored:
            if h not in s.blocks:
                s.blocks.add(h)
                self._holders.setdefault(h, set()).add(worker_id)
        s.next_seq = batch.seq + 1
        return True

    def drop(self, worker_id: str) -> None:
        """Forget a worker's entries (it left, or its stream has a gap)."""
        s = self._streams.pop(worker_id, None)
        if s is None:
            return
        for h in s.blocks:
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(worker_id)
                if not holders:
                    del self._holders[h]

    def retain(self, worker_ids: Iterable[str]) -> None:
        """Drop every worker not in ``worker_ids`` (the registry's members)."""
        keep = set(worker_ids)
        for wid in [w for w in self._streams if w not in keep]:
            self.drop(wid)

    def cached_blocks(self, worker_id: str, block_hashes: Sequence[bytes]) -> int:
        """How many leading ``block_hashes`` the worker holds, by its events so far."""
        s = self._streams.get(worker_id)
        if s is None:
            return 0
        n = 0
        for h in block_hashes:
            if h not in s.blocks:
                break
            n += 1
        return n

    def num_blocks(self, worker_id: str) -> int:
        s = self._streams.get(worker_id)
        return len(s.blocks) if s is not None else 0

    def __len__(self) -> int:
        """Distinct block hashes held by any worker."""
        return len(self._holders)


class PromptProbe:
    """``policy.PrefixProbe`` for one prompt: what each worker holds of it by the index. The prompt's
    block hashes are computed once per salt and block size, on first use."""

    def __init__(self, index: KvIndex, token_ids: Sequence[int]) -> None:
        self._index = index
        self._tokens = token_ids
        self._hashes: dict[tuple[str, int], list[bytes]] = {}

    def cached_tokens(self, worker: Worker) -> int:
        if not worker.prefix_cache_salt or worker.block_size < 1:
            return 0
        key = (worker.prefix_cache_salt, worker.block_size)
        hashes = self._hashes.get(key)
        if hashes is None:
            n = len(self._tokens)
            hashes = self._hashes[key] = block_hashes(
                self._tokens,
                worker.block_size,
                worker.prefix_cache_salt,
                max_blocks=(n - 1) // worker.block_size,
            )
        return self._index.cached_blocks(worker.worker_id, hashes) * worker.block_size
