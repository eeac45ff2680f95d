"""Block manager: unit tests and a hypothesis state machine against a simple model of ownership."""

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

from pdserve.engine.block_manager import BlockManager, OutOfBlocksError


def snapshot(bm: BlockManager) -> tuple:
    return (list(bm._free), list(bm._ref), {k: list(v) for k, v in bm._tables.items()})


def test_allocate_grow_free_roundtrip():
    bm = BlockManager(num_blocks=8, block_size=4)
    t = bm.allocate("a", 5)  # 5 tokens -> 2 blocks
    assert len(t) == 2 and bm.num_free == 6 and bm.num_used == 2
    assert bm.grow("a", 8) == []  # still fits in 2 blocks
    added = bm.grow("a", 9)
    assert len(added) == 1 and bm.block_table("a") == t + added
    assert bm.capacity("a") == 12
    assert bm.slot("a", 9) == added[0] * 4 + 1
    assert bm.free("a") is True
    assert bm.free("a") is False  # idempotent
    assert bm.num_free == 8
    bm.check_invariants()


def test_zero_token_allocation_holds_no_blocks():
    bm = BlockManager(4, 16)
    assert bm.allocate("a", 0) == []
    assert "a" in bm and bm.num_free == 4
    assert len(bm.grow("a", 1)) == 1


def test_out_of_blocks_is_clear_and_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 5)  # 3 blocks
    before = snapshot(bm)
    with pytest.raises(OutOfBlocksError, match="need 2 KV blocks but only 1 of 4 are free"):
        bm.allocate("b", 4)
    assert snapshot(bm) == before and "b" not in bm
    with pytest.raises(OutOfBlocksError):
        bm.grow("a", 10)
    assert snapshot(bm) == before
    bm.check_invariants()


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)
    bm = BlockManager(4, 16)
    bm.allocate("a", 1)
    with pytest.raises(ValueError, match="already holds blocks"):
        bm.allocate("a", 1)
    with pytest.raises(ValueError, match="num_tokens"):
        bm.allocate("b", -1)
    with pytest.raises(KeyError):
        bm.grow("missing", 4)


def test_grow_each_is_grow_in_order_up_to_the_first_that_cannot():
    bm = BlockManager(num_blocks=6, block_size=4)
    for sid in "abc":
        bm.allocate(sid, 4)  # 1 block each, 3 free
    assert bm.grow_each(["a", "b", "c"], [4, 5, 8]) == 3  # a fits; b and c take one block each
    assert [len(bm.block_table(s)) for s in "abc"] == [1, 2, 2] and bm.num_free == 1
    b, c = bm.block_table("b"), bm.block_table("c")
    assert bm.grow_each(["a", "b", "c"], [5, 13, 9]) == 1  # a grows; b needs 2 of the 0 left: stops
    assert len(bm.block_table("a")) == 2 and bm.num_free == 0
    assert bm.block_table("b") == b and bm.block_table("c") == c  # b unchanged, c not tried
    assert bm.grow_each(["missing", "a"], [1, 1]) == 0  # holds no blocks: the caller decides
    assert bm.grow_each([], []) == 0
    assert bm.block_tables(["c", "a"]) == [bm.block_table("c"), bm.block_table("a")]
    bm.check_invariants()


def test_fork_shares_blocks_until_last_owner_frees():
    bm = BlockManager(4, 4)
    t = bm.allocate("a", 8)
    bm.fork("a", "b")
    assert bm.block_table("b") == t and bm.num_free == 2
    bm.free("a")
    assert bm.num_free == 2  # b still holds them
    bm.free("b")
    assert bm.num_free == 4
    bm.check_invariants()


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate/grow/fork/free sequences, checked against a model of who holds how many tokens."""

    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=4)
        self.tokens: dict[int, int] = {}  # seq -> tokens it asked to hold
        self.next_id = 0

    def _expect_failure(self, fn, *args) -> None:
        before = snapshot(self.bm)
        with pytest.raises(OutOfBlocksError):
            fn(*args)
        assert snapshot(self.bm) == before

    @rule(target=seqs, n=st.integers(0, 60))
    def allocate(self, n):
        sid = self.next_id
        self.next_id += 1
        if self.bm.blocks_needed(n) > self.bm.num_free:
            assert not self.bm.can_allocate(n)
            self._expect_failure(self.bm.allocate, sid, n)
            return multiple()  # nothing was allocated
        assert self.bm.can_allocate(n)
        table = self.bm.allocate(sid, n)
        assert len(table) == self.bm.blocks_needed(n)
        self.tokens[sid] = n
        return sid

    @rule(sid=seqs, extra=st.integers(0, 20))
    def grow(self, sid, extra):
        if sid not in self.tokens:
            return
        old = self.bm.block_table(sid)
        want = self.tokens[sid] + extra
        need = self.bm.blocks_needed(want) - len(old)
        if need > self.bm.num_free:
            self._expect_failure(self.bm.grow, sid, want)
            return
        added = self.bm.grow(sid, want)
        assert len(added) == max(0, need)
        assert self.bm.block_table(sid) == old + added  # existing blocks never move
        self.tokens[sid] = want

    @rule(target=seqs, src=seqs)
    def fork(self, src):
        sid = self.next_id
        self.next_id += 1
        if src not in self.tokens:
            return sid
        self.bm.fork(src, sid)
        self.tokens[sid] = self.tokens[src]
        return sid

    @rule(sid=consumes(seqs))
    def free(self, sid):
        held = sid in self.tokens
        assert self.bm.free(sid) is held
        self.tokens.pop(sid, None)
        assert self.bm.free(sid) is False

    @precondition(lambda self: self.tokens)
    @rule()
    def free_everything(self):
        for sid in list(self.tokens):
            self.bm.free(sid)
        self.tokens.clear()
        assert self.bm.num_free == self.bm.num_blocks  # every block comes back

    @invariant()
    def consistent(self):
        bm = self.bm
        bm.check_invariants()
        owned: dict[int, set[int]] = {}
        for sid in self.tokens:
            table = bm.block_table(sid)
            assert len(table) == len(set(table)), "a table holds a block twice"
            assert bm.capacity(sid) >= self.tokens[sid]
            for b in table:
                owned.setdefault(b, set()).add(sid)
        free = list(bm._free)
        assert not set(free) & set(owned), "a free block is also owned"
        # No block handed to two sequences unless they share it through fork (same table prefix).
        for b, holders in owned.items():
            if len(holders) > 1:
                tables = [bm.block_table(s) for s in holders]
                idx = {t.index(b) for t in tables}
                assert len(idx) == 1, f"block {b} handed out twice"
        assert len(free) + len(owned) == bm.num_blocks

    def teardown(self):
        for sid in list(self.tokens):
            self.bm.free(sid)
        assert self.bm.num_free == self.bm.num_blocks
        self.bm.check_invariants()


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockManagerMachine = BlockManagerMachine.TestCase


def test_never_hands_out_a_block_twice_without_fork():
    bm = BlockManager(32, 1)
    seen: set[int] = set()
    for i in range(32):
        for b in bm.allocate(i, 1):
            assert b not in seen
            seen.add(b)
    with pytest.raises(OutOfBlocksError):
        bm.allocate("x", 1)
