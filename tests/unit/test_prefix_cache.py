"""Automatic prefix caching: the block manager's cache (unit tests and a hypothesis state machine that
simulates the K/V each block holds), the scheduler's reuse over a fake model that reads back its cache, and
the engine's exactness against caching off and transformers."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    precondition,
    rule,
)

from pdserve.engine.block_manager import BlockManager, BlockState, OutOfBlocksError
from pdserve.engine.prefix_hash import RemovedBlock, StoredBlock, block_hashes


def snapshot(bm: BlockManager) -> tuple:
    return (
        list(bm._free),
        list(bm._ref),
        {k: list(v) for k, v in bm._tables.items()},
        list(bm._hash),
        dict(bm._by_hash),
        list(bm._cached),
    )


def cached_bm(num_blocks: int = 8, block_size: int = 2, **kw) -> BlockManager:
    return BlockManager(num_blocks, block_size, enable_prefix_caching=True, **kw)


# -- block manager -----------------------------------------------------------------------------------------
def test_freed_committed_blocks_are_cached_and_reused():
    bm = cached_bm()
    ids = [5, 6, 7, 8, 9]
    hs = block_hashes(ids, 2)  # two full blocks
    assert bm.allocate_prefixed("a", 5, hs) == 0
    table = bm.block_table("a")
    bm.commit("a", hs)
    assert [bm.block_state(b) for b in table] == [BlockState.OWNED] * 3
    bm.free("a")
    # The two hashed blocks stay reusable; the partial third is free. Both count as free.
    assert (bm.num_used, bm.num_cached, bm.num_free) == (0, 2, 8)
    assert [bm.block_state(b) for b in table] == [BlockState.CACHED, BlockState.CACHED, BlockState.FREE]
    assert bm.cached_prefix_blocks(hs) == 2 and bm.cached_prefix_blocks(block_hashes([0, 0], 2) + hs) == 0
    assert bm.allocate_prefixed("b", 6, hs) == 2
    assert bm.block_table("b")[:2] == table[:2] and bm.num_cached == 0 and bm.num_used == 3
    assert bm.allocate_prefixed("c", 4, hs) == 2  # shared: refcount 2
    assert bm._ref[table[0]] == 2
    bm.free("b")
    bm.free("c")
    assert bm.num_used == 0 and bm.num_free == 8
    bm.check_invariants()


def test_reuse_is_capped_by_the_blocks_the_tokens_need():
    bm = cached_bm()
    hs = block_hashes([1, 2, 3, 4, 5, 6], 2)
    bm.allocate("a", 6)
    bm.commit("a", hs)
    assert bm.allocate_prefixed("b", 3, hs) == 2  # 3 tokens need 2 blocks: both reused
    assert bm.allocate_prefixed("c", 0, hs) == 0 and bm.block_table("c") == []
    bm.check_invariants()


def test_eviction_takes_free_blocks_first_then_the_least_recently_used_tail_first():
    bm = cached_bm(num_blocks=6)
    ha, hb = block_hashes([1, 1, 2, 2], 2), block_hashes([3, 3, 4, 4], 2)
    for sid, hs in (("a", ha), ("b", hb)):
        bm.allocate(sid, 4)
        bm.commit(sid, hs)
    ta, tb = bm.block_table("a"), bm.block_table("b")
    bm.free("a")
    bm.free("b")  # LRU: a's tail, a's head, b's tail, b's head
    bm.drain_events()
    assert bm.num_cached == 4 and len(bm._free) == 2
    bm.allocate("x", 2 * 3)  # 2 free blocks, then evicts a's tail
    assert bm.drain_events() == ([RemovedBlock(ha[1])], False)
    assert bm.cached_prefix_blocks(ha) == 1 and bm.cached_prefix_blocks(hb) == 2
    bm.allocate("y", 2)  # a's head
    assert bm.cached_prefix_blocks(ha) == 0 and bm.block_table("y") == [ta[0]]
    assert bm.allocate_prefixed("z", 4, hb) == 2 and bm.block_table("z") == tb  # reuse leaves the LRU
    with pytest.raises(OutOfBlocksError):
        bm.allocate("w", 1)
    bm.check_invariants()


def test_allocate_prefixed_is_all_or_nothing_counting_the_cached_blocks_it_holds():
    bm = cached_bm(num_blocks=4)
    hs = block_hashes([1, 2, 3, 4], 2)
    bm.allocate("a", 4)
    bm.commit("a", hs)
    bm.free("a")  # 2 cached, 2 free: 4 can be taken
    before = snapshot(bm)
    # 4 blocks reusing 2 cached ones: fits (2 fresh). 5 blocks: needs 3 fresh, and the 2 reused ones no
    # longer count as evictable, so only 2 are left.
    with pytest.raises(OutOfBlocksError, match="need 3 KV blocks past 2 cached ones but only 2"):
        bm.allocate_prefixed("b", 10, hs)
    assert snapshot(bm) == before and "b" not in bm
    with pytest.raises(ValueError, match="num_tokens"):
        bm.allocate_prefixed("b", -1, hs)
    assert bm.allocate_prefixed("b", 8, hs) == 2 and bm.num_free == 0
    with pytest.raises(ValueError, match="already holds blocks"):
        bm.allocate_prefixed("b", 1, hs)
    bm.check_invariants()


def test_commit_rules():
    bm = cached_bm()
    hs = block_hashes([1, 2, 3, 4], 2)
    bm.allocate("a", 4)
    bm.allocate("b", 4)
    bm.commit("a", hs[:1])
    bm.commit("a", hs, start=1)  # the rest, with the shortcut
    bm.commit("a", hs)  # again: nothing changes
    assert bm.drain_events() == ([StoredBlock(hs[0], None), StoredBlock(hs[1], hs[0])], False)
    # b computed the same blocks at once: they stay unhashed and free when released.
    bm.commit("b", hs)
    assert bm.drain_events() == ([], False)
    tb = bm.block_table("b")
    bm.free("b")
    assert [bm.block_state(b) for b in tb] == [BlockState.FREE] * 2
    other = block_hashes([9, 9], 2)
    with pytest.raises(ValueError, match="another hash"):
        bm.commit("a", other)
    with pytest.raises(ValueError, match="holds 2 blocks"):
        bm.commit("a", block_hashes([1, 2, 3, 4, 5, 6], 2))
    with pytest.raises(KeyError):
        bm.commit("missing", hs)
    assert sorted(bm.cached_hashes()) == sorted([(hs[0], None), (hs[1], hs[0])])
    bm.check_invariants()


def test_events_overflow_into_a_snapshot():
    bm = cached_bm(num_blocks=8, max_events=3)
    hs = block_hashes(list(range(16)), 2)
    bm.allocate("a", 16)
    bm.commit("a", hs[:2])
    assert bm.drain_events() == ([StoredBlock(hs[0], None), StoredBlock(hs[1], hs[0])], False)
    bm.commit("a", hs)  # 6 more: past the bound
    events, overflowed = bm.drain_events()
    assert events == [] and overflowed
    assert bm.cached_hashes() == [(h, hs[i - 1] if i else None) for i, h in enumerate(hs)]
    assert bm.drain_events() == ([], False)  # recording again after the drain


def test_caching_off_is_the_plain_allocator():
    bm = BlockManager(4, 2)
    hs = block_hashes([1, 2, 3, 4], 2)
    bm.allocate("a", 4)
    bm.commit("a", hs)  # no-op
    bm.free("a")
    assert bm.num_cached == 0 and bm.cached_prefix_blocks(hs) == 0
    assert bm.allocate_prefixed("b", 4, hs) == 0
    assert bm.drain_events() == ([], False) and bm.cached_hashes() == []
    bm.check_invariants()


# The simulated K/V a block holds: a full block's hash, or ("partial", seq, index).
Content = object


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random allocate / allocate_prefixed / commit / grow / fork / free sequences over two distinct tokens
    (so prefixes collide), with eviction from a small cache. Simulates what each block holds: a write only
    ever goes to a block its sequence holds alone and that has no hash, and a hashed block holds that
    hash's K/V. Events replayed onto a model equal the cache's contents."""

    seqs = Bundle("seqs")
    BS = 2

    def __init__(self) -> None:
        super().__init__()
        self.bm = cached_bm(num_blocks=10, block_size=self.BS, max_events=12)
        self.tokens: dict[int, list[int]] = {}
        self.written: dict[int, int] = {}  # tokens whose K/V the sequence wrote or reused
        self.frozen: set[int] = set()  # forked: shares a partial block, so never writes again
        self.content: dict[int, Content] = {}
        self.model: dict[bytes, bytes | None] = {}  # hashes the events say are cached
        self.next_id = 0

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _expect_failure(self, fn, *args) -> None:
        before = snapshot(self.bm)
        with pytest.raises(OutOfBlocksError):
            fn(*args)
        assert snapshot(self.bm) == before

    def _write(self, sid: int, commit: bool) -> None:
        """The sequence computes its tokens past what it wrote: only blocks it alone holds, unhashed."""
        bm, bs, toks = self.bm, self.BS, self.tokens[sid]
        table = bm.block_table(sid)
        hs = block_hashes(toks, bs)
        for i in range(self.written[sid] // bs, bm.blocks_needed(len(toks))):
            b = table[i]
            assert bm._ref[b] == 1 and bm._hash[b] is None, f"block {b} written while shared or hashed"
            self.content[b] = hs[i] if i < len(hs) else ("partial", sid, i)
        self.written[sid] = len(toks)
        if commit:  # as the scheduler does once a step computed them
            bm.commit(sid, hs)

    @rule(
        target=seqs,
        toks=st.lists(st.integers(1, 2), min_size=1, max_size=14),
        prefixed=st.booleans(),
        commit=st.booleans(),
    )
    def allocate(self, toks, prefixed, commit):
        bm, sid = self.bm, self._new_id()
        hs = block_hashes(toks, self.BS)
        need = bm.blocks_needed(len(toks))
        hit = bm.cached_prefix_blocks(hs[:need]) if prefixed else 0
        room = bm.num_free - sum(1 for b in map(bm._by_hash.get, hs[:hit]) if bm._ref[b] == 0)
        if need - hit > room:
            if prefixed:
                self._expect_failure(bm.allocate_prefixed, sid, len(toks), hs)
            else:
                self._expect_failure(bm.allocate, sid, len(toks))
            return multiple()
        if prefixed:
            assert bm.allocate_prefixed(sid, len(toks), hs) == hit
            for i, b in enumerate(bm.block_table(sid)[:hit]):
                assert self.content[b] == hs[i], "a reused block holds other K/V"
        else:
            bm.allocate(sid, len(toks))
        self.tokens[sid], self.written[sid] = list(toks), min(hit * self.BS, len(toks))
        self._write(sid, commit)
        return sid

    @rule(sid=seqs, more=st.lists(st.integers(1, 2), max_size=5), commit=st.booleans())
    def grow(self, sid, more, commit):
        if sid not in self.tokens or sid in self.frozen:
            return
        bm, toks = self.bm, self.tokens[sid] + more
        if bm.blocks_needed(len(toks)) - len(bm.block_table(sid)) > bm.num_free:
            self._expect_failure(bm.grow, sid, len(toks))
            return
        bm.grow(sid, len(toks))
        self.tokens[sid] = toks
        self._write(sid, commit)

    @rule(sid=seqs, data=st.data())
    def commit(self, sid, data):
        if sid not in self.tokens:
            return
        bs = self.BS
        hs = block_hashes(self.tokens[sid], bs)[: self.written[sid] // bs]
        k = data.draw(st.integers(0, len(hs)))
        self.bm.commit(sid, hs[:k])
        table = self.bm.block_table(sid)
        for i in range(k):  # hashed with its own hash, or left unhashed as a duplicate
            assert self.bm._hash[table[i]] in (hs[i], None)
            assert hs[i] in self.bm._by_hash

    @rule(target=seqs, src=seqs)
    def fork(self, src):
        sid = self._new_id()
        if src not in self.tokens:
            return sid
        self.bm.fork(src, sid)
        self.tokens[sid], self.written[sid] = list(self.tokens[src]), self.written[src]
        self.frozen |= {src, sid}
        return sid

    @rule(sid=consumes(seqs))
    def free(self, sid):
        assert self.bm.free(sid) is (sid in self.tokens)
        self.tokens.pop(sid, None)
        assert self.bm.free(sid) is False

    @precondition(lambda self: self.tokens)
    @rule()
    def free_everything(self):
        for sid in list(self.tokens):
            self.bm.free(sid)
        self.tokens.clear()
        assert self.bm.num_used == 0 and self.bm.num_free == self.bm.num_blocks

    @rule()
    def drain(self):
        events, overflowed = self.bm.drain_events()
        if overflowed:
            assert events == []
            self.model = dict(self.bm.cached_hashes())
            return
        for e in events:
            if isinstance(e, StoredBlock):
                assert e.block_hash not in self.model
                self.model[e.block_hash] = e.parent_hash
            else:
                del self.model[e.block_hash]
        assert self.model == dict(self.bm.cached_hashes())

    @invariant()
    def consistent(self):
        bm = self.bm
        bm.check_invariants()
        held = {b for sid in self.tokens for b in bm.block_table(sid)}
        assert bm.num_used == len(held) and bm.num_free == bm.num_blocks - len(held)
        for sid, toks in self.tokens.items():
            assert bm.capacity(sid) >= len(toks)
        for h, b in bm._by_hash.items():
            assert self.content.get(b) == h, f"block {b} is cached under a hash it does not hold"

    def teardown(self):
        for sid in list(self.tokens):
            self.bm.free(sid)
        assert self.bm.num_used == 0 and self.bm.num_free == self.bm.num_blocks
        self.bm.check_invariants()


PrefixCacheMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
TestPrefixCacheMachine = PrefixCacheMachine.TestCase
