"""Publishes a worker's prefix-cache changes to the router: batches of stored and removed block hashes
on each heartbeat (``WorkerLoad.kv_events``), numbered per process epoch, re-sent until the router took
them, and a snapshot of the whole cache when the router asks or the block manager dropped events."""

from __future__ import annotations

import secrets
import threading
from typing import Protocol

from pdserve.engine.prefix_hash import BlockHash, KVEvent, StoredBlock
from pdserve.proto import worker_pb2


class EventSource(Protocol):
    """What the publisher reads of a block manager (``engine.block_manager.BlockManager`` is one)."""

    def drain_events(self) -> tuple[list[KVEvent], bool]: ...

    def has_events(self) -> bool: ...

    def cached_hashes(self) -> list[tuple[BlockHash, BlockHash | None]]: ...


class KvEventPublisher:
    """``batch()`` before each heartbeat, ``answered(resp)`` after the router answered it. A batch the
    router did not answer is sent again under the same number, with what happened since folded in: each
    hash appears once per batch with its latest state, so applying a batch twice is harmless."""

    def __init__(self, source: EventSource) -> None:
        self._source = source
        self.epoch = secrets.token_hex(8)
        self._seq = 0
        self._snapshot = True  # the first batch of a process tells a router everything
        # hash -> (stored, parent): each hash's latest state since the last batch the router took
        self._pending: dict[BlockHash, tuple[bool, BlockHash | None]] = {}
        self._lock = threading.Lock()  # the load callback and the heartbeat answer may be on two threads

    def batch(self) -> worker_pb2.KvEvents:
        with self._lock:
            events, overflowed = self._source.drain_events()
            if overflowed:
                self._snapshot = True
            if self._snapshot:
                self._pending = {h: (True, parent) for h, parent in self._source.cached_hashes()}
            else:
                for e in events:
                    stored = isinstance(e, StoredBlock)
                    self._pending[e.block_hash] = (
                        stored,
                        e.parent_hash if isinstance(e, StoredBlock) else None,
                    )
            kept = [(h, parent) for h, (stored, parent) in self._pending.items() if stored]
            return worker_pb2.KvEvents(
                epoch=self.epoch,
                seq=self._seq,
                snapshot=self._snapshot,
                stored=[h for h, _ in kept],
                stored_parents=[parent or b"" for _, parent in kept],
                removed=[h for h, (stored, _) in self._pending.items() if not stored],
            )

    def pending(self) -> bool:
        """The cache changed since the last batch was built."""
        return self._source.has_events()

    def answered(self, resp: worker_pb2.HeartbeatResponse) -> None:
        """The router took the last batch (``kv_snapshot``: and wants a snapshot next)."""
        with self._lock:
            self._pending = {}
            self._seq += 1
            self._snapshot = resp.kv_snapshot
