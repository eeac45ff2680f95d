"""Paged KV-cache block allocator: block tables per sequence id, reference counted, with an optional
automatic prefix cache. Pure Python.

Every operation is atomic (one lock) and all-or-nothing, so a decode worker's KV receiver and its engine
thread share one instance; readings (``num_free``, ``can_allocate``) are stale once another thread uses it.
The rules across roles and threads are the block-ownership contract in ``kv_transfer/__init__.py``.

Prefix cache (``enable_prefix_caching``; vLLM v1 style, full blocks only). A block is in one ``BlockState``:
FREE (refcount 0, no hash), CACHED (refcount 0, holds a hash, evictable, in an LRU) or OWNED (refcount > 0,
hashed or not). ``commit`` hashes a sequence's computed full blocks (hashes from ``engine.prefix_hash``);
``free`` turns a hashed block whose refcount reaches 0 into CACHED; ``allocate_prefixed`` reuses the longest
cached prefix; taking blocks uses FREE ones first, then evicts the least recently used CACHED ones.
``num_free`` counts FREE + CACHED (what can be taken), ``num_used`` the referenced blocks only. A hashed
block is never written: a sequence writes only blocks past its reused prefix, and hashes them once full.

Events for the router: ``drain_events()`` returns ``(events, overflowed)``, the ``StoredBlock`` /
``RemovedBlock`` records since the last drain, oldest first. At most ``max_events`` are kept; past that the
queue is dropped and recording stops until the next drain, which says ``overflowed=True``: the caller then
sends ``cached_hashes()`` (every hashed block as ``(hash, parent hash)``) as a snapshot. Events recorded
between the drain and the snapshot are also in it, so applying events must be idempotent.
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence

from pdserve.engine.prefix_hash import BlockHash, KVEvent, RemovedBlock, StoredBlock

MAX_EVENTS = 65536


class OutOfBlocksError(RuntimeError):
    """Not enough free KV blocks; the allocator state is unchanged."""


class BlockState(enum.Enum):
    FREE = "free"  # refcount 0, no hash
    CACHED = "cached"  # refcount 0, holds a hash: reusable until evicted
    OWNED = "owned"  # refcount > 0


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        *,
        max_events: int = MAX_EVENTS,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_evictions = 0  # cached blocks evicted since start (a metric)
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks
        self._tables: dict[Hashable, list[int]] = {}
        self._lock = threading.RLock()
        # The prefix cache: each block's hash and its parent's, the hash -> block table, and the CACHED
        # blocks, least recently used first.
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._parent: list[BlockHash | None] = [None] * num_blocks
        self._by_hash: dict[BlockHash, int] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._events: list[KVEvent] = []
        self._max_events = max_events
        self._overflowed = False

    # -- queries -----------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be taken: free ones and evictable cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        """Blocks some sequence holds."""
        return self.num_blocks - len(self._free) - len(self._cached)

    @property
    def num_cached(self) -> int:
        """Blocks nobody holds that keep reusable K/V (counted in ``num_free`` too)."""
        return len(self._cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.num_free

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

    def block_state(self, block: int) -> BlockState:
        with self._lock:
            if self._ref[block] > 0:
                return BlockState.OWNED
            return BlockState.FREE if self._hash[block] is None else BlockState.CACHED

    def cached_prefix_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading ``block_hashes`` the cache holds (a lookup: holds nothing, and is stale once
        another thread acts)."""
        by_hash = self._by_hash
        n = 0
        for h in block_hashes:
            if h not in by_hash:
                break
            n += 1
        return n

    def cached_hashes(self) -> list[tuple[BlockHash, BlockHash | None]]:
        """Every hashed block (held or cached) as ``(hash, parent hash)``, in the order they were hashed:
        the snapshot a publisher sends after ``drain_events`` overflowed."""
        with self._lock:
            return [(h, self._parent[b]) for h, b in self._by_hash.items()]

    def has_events(self) -> bool:
        """Events recorded (or dropped) since the last drain: a reading, without the lock."""
        return bool(self._events) or self._overflowed

    def drain_events(self) -> tuple[list[KVEvent], bool]:
        """The events since the last drain, oldest first, and whether some were dropped (see the module
        docstring); clears both."""
        with self._lock:
            events, overflowed = self._events, self._overflowed
            self._events, self._overflowed = [], False
            return events, overflowed

    # -- mutations ---------------------------------------------------------
    def _record(self, event: KVEvent) -> None:
        if self._overflowed:
            return
        if len(self._events) >= self._max_events:
            self._events, self._overflowed = [], True
            return
        self._events.append(event)

    def _take(self, n: int) -> list[int]:
        free, cached = self._free, self._cached
        if n > len(free) + len(cached):
            raise OutOfBlocksError(
                f"need {n} KV blocks but only {len(free) + len(cached)} of {self.num_blocks} are free"
            )
        k = min(n, len(free))
        blocks = [free.popleft() for _ in range(k)]
        for _ in range(n - k):  # evict the least recently used cached blocks
            b, _ = cached.popitem(last=False)
            h = self._hash[b]
            assert h is not None
            del self._by_hash[h]
            self._hash[b] = self._parent[b] = None
            self._record(RemovedBlock(h))
            self.num_evictions += 1
            blocks.append(b)
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

    def allocate_prefixed(self, seq_id: Hashable, num_tokens: int, block_hashes: Sequence[BlockHash]) -> int:
        """Give a new sequence blocks for ``num_tokens`` tokens, reusing the longest run of leading
        ``block_hashes`` the cache holds (at most the blocks ``num_tokens`` needs) and taking fresh blocks
        after it; returns how many blocks were reused. The caller computes only past the reused blocks.
        All or nothing; with prefix caching off, ``allocate`` (and 0)."""
        if not self.enable_prefix_caching:
            self.allocate(seq_id, num_tokens)
            return 0
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        with self._lock:
            if seq_id in self._tables:
                raise ValueError(f"sequence {seq_id!r} already holds blocks")
            need = self.blocks_needed(num_tokens)
            hits: list[int] = []
            for h in block_hashes[:need]:
                b = self._by_hash.get(h)
                if b is None:
                    break
                hits.append(b)
            held_cached = sum(1 for b in hits if self._ref[b] == 0)
            fresh = need - len(hits)
            room = len(self._free) + len(self._cached) - held_cached
            if fresh > room:
                raise OutOfBlocksError(
                    f"need {fresh} KV blocks past {len(hits)} cached ones but only {room} of "
                    f"{self.num_blocks} are free"
                )
            for b in hits:
                if self._ref[b] == 0:
                    del self._cached[b]
                self._ref[b] += 1
            self._tables[seq_id] = hits + self._take(fresh)
            return len(hits)

    def commit(self, seq_id: Hashable, block_hashes: Sequence[BlockHash], start: int = 0) -> None:
        """The sequence's first ``len(block_hashes)`` blocks hold complete K/V for those hashes: each not
        yet hashed takes its hash and becomes reusable, unless another block already holds that hash (two
        sequences computed it at once; this one stays unhashed). ``start``: blocks before it are known to
        be committed already (a shortcut). A block's hash never changes: a different one is a ValueError,
        with nothing changed. No-op with prefix caching off."""
        if not self.enable_prefix_caching:
            return
        with self._lock:
            table = self._tables[seq_id]
            if len(block_hashes) > len(table):
                raise ValueError(
                    f"{len(block_hashes)} block hashes for {seq_id!r}, which holds {len(table)} blocks"
                )
            hash_of, by_hash = self._hash, self._by_hash
            for i in range(start, len(block_hashes)):
                old = hash_of[table[i]]
                if old is not None and old != block_hashes[i]:
                    raise ValueError(f"block {i} of sequence {seq_id!r} already holds another hash")
            parent = block_hashes[start - 1] if start > 0 else None
            for i in range(start, len(block_hashes)):
                b, h = table[i], block_hashes[i]
                if hash_of[b] is None and h not in by_hash:
                    hash_of[b], self._parent[b] = h, parent
                    by_hash[h] = b
                    self._record(StoredBlock(h, parent))
                parent = h

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
            tables, bs, free, cached = self._tables, self.block_size, self._free, self._cached
            for i, (seq_id, n) in enumerate(zip(seq_ids, num_tokens, strict=True)):
                table = tables.get(seq_id)
                if table is None:
                    return i
                extra = -(-n // bs) - len(table)
                if extra > 0:
                    if extra > len(free) + len(cached):
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

    def fork_prefix(self, src: Hashable, dst: Hashable, num_tokens: int) -> tuple[int, int] | None:
        """``dst`` takes the K/V of ``src``'s first ``num_tokens`` tokens: it shares (by reference count,
        read-only) the full blocks among them and gets a fresh block of its own for a partial last one,
        which it will write into. Returns ``(src's block, dst's block)`` for the caller to copy that
        partial block's K/V across, or None when the tokens fill whole blocks. All or nothing
        (OutOfBlocksError when no block is free for the copy)."""
        with self._lock:
            if dst in self._tables:
                raise ValueError(f"sequence {dst!r} already holds blocks")
            table = self._tables[src]
            full, partial = divmod(num_tokens, self.block_size)
            if full + (partial > 0) > len(table):
                raise ValueError(f"{src!r} holds {len(table)} blocks, fewer than {num_tokens} tokens need")
            fresh = self._take(1) if partial else []
            shared = table[:full]
            for b in shared:
                self._ref[b] += 1
            self._tables[dst] = shared + fresh
            return (table[full], fresh[0]) if partial else None

    def free(self, seq_id: Hashable) -> bool:
        """Release a sequence's blocks. Returns False when it held none (idempotent). A released hashed
        block stays reusable (CACHED); the sequence's tail goes first in the eviction order."""
        with self._lock:
            table = self._tables.pop(seq_id, None)
            if table is None:
                return False
            ref, hash_of = self._ref, self._hash
            hashed: list[int] = []
            for b in table:
                ref[b] -= 1
                if ref[b] == 0:
                    if hash_of[b] is None:
                        self._free.append(b)
                    else:
                        hashed.append(b)
            for b in reversed(hashed):
                self._cached[b] = None
            return True

    # Every block is FREE (refcount 0, no hash, on the free list), CACHED (refcount 0, hashed, in the LRU) or
    # OWNED (refcount == the number of tables that hold it); FREE + CACHED + OWNED == num_blocks, and the
    # hash table maps each hash to the block that holds it (the tests assert it after their operations).
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
        cached = set(self._cached)
        assert not free & cached, "a block is both free and cached"
        owned = 0
        for b in range(self.num_blocks):
            assert counts[b] == self._ref[b], f"block {b}: refcount {self._ref[b]} != owners {counts[b]}"
            h = self._hash[b]
            if counts[b] > 0:
                owned += 1
                assert b not in free and b not in cached, f"block {b}: owned but free or cached"
            elif h is None:
                assert b in free, f"block {b}: unowned and unhashed but not free"
            else:
                assert b in cached, f"block {b}: unowned and hashed but not cached"
            if h is not None:
                assert self._by_hash.get(h) == b, f"block {b}: its hash maps to {self._by_hash.get(h)}"
            else:
                assert self._parent[b] is None, f"block {b}: a parent without a hash"
        assert len(free) + len(cached) + owned == self.num_blocks, "blocks lost or counted twice"
        for h, b in self._by_hash.items():
            assert self._hash[b] == h, f"hash table entry for block {b} disagrees with the block"
        if not self.enable_prefix_caching:
            assert not self._by_hash and not self._cached, "prefix cache in use while off"
