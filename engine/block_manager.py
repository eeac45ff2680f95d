"""Paged KV-cache block allocator: block tables per sequence id, reference counted. Pure Python.

Every operation is atomic (one lock) and all-or-nothing, so a decode worker's KV receiver and its engine
thread share one instance; readings (``num_free``, ``can_allocate``) are stale once another thread uses it.
The rules across roles and threads are the block-ownership contract in ``kv_transfer/__init__.py``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Hashable


class OutOfBlocksError(RuntimeError):
    """Not enough free KV blocks; the allocator state is unchanged."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks
        self._tables: dict[Hashable, list[int]] = {}
        self._lock = threading.RLock()

    # -- queries -----------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= len(self._free)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._tables

    def __len__(self) -> int:
        return len(self._tables)

    def block_table(self, seq_id: Hashable) -> list[int]:
        with self._lock:
            return list(self._tables[seq_id])

    def block_tables(self, seq_ids: list[Hashable]) -> list[list[int]]:
        """Copies of several tables at once: ``block_table`` for each, one lock for the batch."""
        with self._lock:
            tables = self._tables
            return [list(tables[s]) for s in seq_ids]

    def live_tables(self, seq_ids: list[Hashable]) -> list[list[int]]:
        """The tables themselves, not copies: for the engine thread's decode step, which only reads them
        before its next mutation. A table only ever grows at its end while its id holds it; a freed or
        preempted id that allocates again gets a new list."""
        with self._lock:
            tables = self._tables
            return [tables[s] for s in seq_ids]

    def capacity(self, seq_id: Hashable) -> int:
        """Token slots the sequence can hold without growing."""
        return len(self._tables[seq_id]) * self.block_size

    def slot(self, seq_id: Hashable, position: int) -> int:
        table = self._tables[seq_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size

    # -- mutations ---------------------------------------------------------
    def _take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocksError(
                f"need {n} KV blocks but only {len(self._free)} of {self.num_blocks} are free"
            )
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._ref[b] = 1
        return blocks

    def allocate(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """Give a new sequence enough blocks for ``num_tokens`` tokens."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        with self._lock:
            if seq_id in self._tables:
                raise ValueError(f"sequence {seq_id!r} already holds blocks")
            blocks = self._take(self.blocks_needed(num_tokens))
            self._tables[seq_id] = blocks
            return list(blocks)

    def grow(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """Extend a sequence's table to hold ``num_tokens`` tokens; returns the added blocks."""
        with self._lock:
            table = self._tables[seq_id]
            extra = self.blocks_needed(num_tokens) - len(table)
            if extra <= 0:
                return []
            blocks = self._take(extra)
            table.extend(blocks)
            return blocks

    def grow_each(self, seq_ids: list[Hashable], num_tokens: list[int]) -> int:
        """``grow(seq_ids[i], num_tokens[i])`` for each ``i`` in order, under one lock (a decode step grows
        every running sequence). Stops at the first id that holds no blocks or does not fit, leaving it
        unchanged; returns how many were grown, so the caller handles that one and goes on after it."""
        with self._lock:
            tables, bs, free = self._tables, self.block_size, self._free
            for i, (seq_id, n) in enumerate(zip(seq_ids, num_tokens, strict=True)):
                table = tables.get(seq_id)
                if table is None:
                    return i
                extra = -(-n // bs) - len(table)
                if extra > 0:
                    if extra > len(free):
                        return i
                    table.extend(self._take(extra))
            return len(seq_ids)

    def fork(self, src: Hashable, dst: Hashable) -> None:
        """``dst`` shares every block of ``src`` (reference counted, read-only sharing)."""
        with self._lock:
            if dst in self._tables:
                raise ValueError(f"sequence {dst!r} already holds blocks")
            table = self._tables[src]
            for b in table:
                self._ref[b] += 1
            self._tables[dst] = list(table)

    def free(self, seq_id: Hashable) -> bool:
        """Release a sequence's blocks. Returns False when it held none (idempotent)."""
        with self._lock:
            table = self._tables.pop(seq_id, None)
            if table is None:
                return False
            for b in table:
                self._ref[b] -= 1
                if self._ref[b] == 0:
                    self._free.append(b)
            return True

    # Every block is either free with refcount 0 or owned, with refcount equal to the number of tables
    # that hold it; free + distinct owned == num_blocks (the tests assert it after their operations).
    def check_invariants(self) -> None:
        with self._lock:
            self._check_invariants()

    def _check_invariants(self) -> None:
        counts = [0] * self.num_blocks
        for table in self._tables.values():
            for b in table:
                counts[b] += 1
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for b in range(self.num_blocks):
            assert counts[b] == self._ref[b], f"block {b}: refcount {self._ref[b]} != owners {counts[b]}"
            assert (b in free) == (counts[b] == 0), f"block {b}: free-list membership disagrees"
