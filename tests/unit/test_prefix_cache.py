"""Automatic prefix caching: the block manager's cache (unit tests and a hypothesis state machine that
simulates the K/V each block holds), the scheduler's reuse over a fake model that reads back its cache, and
the engine's exactness against caching off and transformers."""

from __future__ import annotations

import collections

import pytest
from hypothesis import HealthCheck, given, settings
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

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.block_manager import BlockManager, BlockState, OutOfBlocksError
from pdserve.engine.prefix_hash import RemovedBlock, StoredBlock, block_hashes
from pdserve.engine.scheduler import Scheduler, SchedulerConfig
from tests.unit.test_llm import assert_no_leak, hf_greedy, prompts_of
from tests.unit.test_scheduler import EOS, FakeRunner, V, ignore_eos, next_token, reference


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


# -- scheduler over a fake model that reads back its cache --------------------------------------------------
def make_sched(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, mixed=True, max_model_len=1000):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    cfg = SchedulerConfig(
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        eos_token_ids=(EOS,),
        mixed_steps=mixed,
        cache_salt="fake-model",
    )
    return Scheduler(cfg, bm), bm, FakeRunner(bm)


def run_step(sched: Scheduler, runner: FakeRunner, batch) -> list:
    """One step; first checks that every position it writes lies in a block its sequence holds alone and
    that has no hash (a cached block is shared read-only)."""
    bm, bs = sched.block_manager, sched.block_manager.block_size
    for it in batch.items:
        table = bm.block_table(it.seq.seq_id)
        for b in {table[p // bs] for p in range(it.start, it.start + it.num_tokens)}:
            assert bm._ref[b] == 1 and bm._hash[b] is None, f"{it.seq.seq_id} writes shared block {b}"
    return sched.postprocess(batch, runner.run(sched, batch))


def drive_cached(sched: Scheduler, runner: FakeRunner, max_steps: int = 5000, on_step=None) -> dict:
    done: dict = {}
    for step in range(max_steps):
        if not sched.has_unfinished():
            break
        batch = sched.schedule()
        assert batch is not None, "work is pending but nothing can be scheduled (deadlock)"
        for seq in run_step(sched, runner, batch):
            if seq.is_finished:
                done[seq.seq_id] = seq
        sched.block_manager.check_invariants()
        if on_step:
            on_step(step)
    else:
        pytest.fail("did not finish within the step bound")
    return done


def first_span(sched: Scheduler, runner: FakeRunner, seq_id) -> tuple[int, int]:
    """Run to ``seq_id``'s first prefill step; its (start, num_tokens)."""
    while True:
        batch = sched.schedule()
        spans = [(it.start, it.num_tokens) for it in batch.items if it.seq.seq_id == seq_id]
        run_step(sched, runner, batch)
        if spans:
            return spans[0]


PREFIX = list(range(10, 30))  # 20 tokens: 5 blocks of 4


@pytest.mark.parametrize(
    ("shared", "tail", "reused_blocks"),
    [
        (3, [1, 2, 3], 0),  # shorter than a block: nothing to reuse
        (8, [], 1),  # exactly 2 blocks, all of the prompt: the last block is recomputed
        (8, [1], 2),  # 2 blocks + 1: both reused
        (9, [1, 2, 3, 4], 2),
    ],
)
def test_a_later_prompt_reuses_the_full_blocks_it_shares(shared, tail, reused_blocks):
    sched, bm, runner = make_sched()
    sched.add("a", PREFIX, ignore_eos(3))
    drive_cached(sched, runner)
    assert "a" not in bm and bm.num_cached == len(PREFIX) // 4  # a's prompt blocks, kept
    prompt = PREFIX[:shared] + tail
    seq = sched.add("b", prompt, ignore_eos(5))
    assert first_span(sched, runner, "b") == (4 * reused_blocks, len(prompt) - 4 * reused_blocks)
    assert seq.num_cached_tokens == 4 * reused_blocks
    done = drive_cached(sched, runner)
    assert done["b"].output_token_ids == reference(prompt, 5)
    assert bm.num_used == 0 and bm.num_free == bm.num_blocks


def test_decoded_blocks_are_cached_too_and_hashes_survive_preemption():
    sched, bm, runner = make_sched(budget=64)
    sched.add("a", PREFIX[:6], ignore_eos(10))  # 16 tokens: 4 full blocks once decoded
    done = drive_cached(sched, runner)
    full = PREFIX[:6] + done["a"].output_token_ids
    assert len(done["a"].block_hashes) == 3  # the 4th block filled with the last token, never computed
    seq = sched.add("b", full[:13], ignore_eos(2))
    assert first_span(sched, runner, "b") == (12, 1)  # 3 blocks, two of them decoded by a
    assert seq.num_cached_tokens == 12
    drive_cached(sched, runner)


def test_chunked_prefill_hits_the_blocks_an_earlier_prompt_just_committed():
    # Both arrive at once. a's chunks of 8 commit its blocks as they go; b's first step shares a's last
    # (4 tokens left of the budget) and starts past the 4 blocks committed by then.
    sched, bm, runner = make_sched(budget=8, mixed=False)
    sched.add("a", PREFIX, ignore_eos(2))
    sched.add("b", PREFIX + [1, 2], ignore_eos(2))
    assert first_span(sched, runner, "b") == (16, 4)
    done = drive_cached(sched, runner)
    assert done["b"].output_token_ids == reference(PREFIX + [1, 2], 2)
    assert done["a"].num_cached_tokens == 0 and done["b"].num_cached_tokens == 16


def test_preempted_sequence_keeps_its_first_cached_count():
    sched, bm, runner = make_sched(num_blocks=12, budget=64, max_num_seqs=4)
    sched.add("warm", PREFIX[:8], ignore_eos(1))
    drive_cached(sched, runner)
    prompts = {i: PREFIX[:8] + [40 + i] * 3 for i in range(3)}
    for i, p in prompts.items():
        sched.add(i, p, ignore_eos(16))  # 27 tokens each, 7 blocks: they cannot all fit
    done = drive_cached(sched, runner)
    assert sched.num_preemptions > 0
    for i, p in prompts.items():
        assert done[i].output_token_ids == reference(p, 16)
        assert done[i].num_cached_tokens == 8
    assert bm.num_used == 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    num_blocks=st.integers(8, 40),
    block_size=st.sampled_from([1, 2, 4]),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 40),
    mixed=st.booleans(),
)
def test_random_shared_prefix_workloads_are_exact_and_leak_nothing(
    data, num_blocks, block_size, max_num_seqs, budget, mixed
):
    sched, bm, runner = make_sched(num_blocks, block_size, max_num_seqs, budget, mixed, max_model_len=64)
    cap = num_blocks * block_size
    stems = [[7] * 20, list(range(1, 21))]
    expect = {}
    rounds = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=2), label="round sizes")
    rid = 0
    for size in rounds:  # a later round hits what the earlier left in the cache
        for _ in range(size):
            stem = stems[data.draw(st.integers(0, 1), label="stem")][: data.draw(st.integers(0, 20))]
            tail = data.draw(st.lists(st.integers(1, V - 1), max_size=6), label="tail")
            prompt = (stem + tail)[: min(40, cap - 1)] or [3]
            max_tokens = data.draw(st.integers(1, max(1, min(cap, 64) - len(prompt))), label="max_tokens")
            sched.add(rid, prompt, ignore_eos(max_tokens))
            expect[rid] = reference(prompt, max_tokens, max_model_len=64)
            rid += 1
        aborts = data.draw(st.dictionaries(st.sampled_from(list(expect)), st.integers(0, 20), max_size=1))

        def maybe_abort(step, aborts=aborts):
            for r, at in aborts.items():
                if at == step and sched.abort(r):
                    expect.pop(r)

        done = drive_cached(sched, runner, on_step=maybe_abort)
        for r, toks in done.items():
            if r in expect:
                assert toks.output_token_ids == expect.pop(r)
        assert not expect
        assert bm.num_used == 0 and bm.num_free == bm.num_blocks and len(bm) == 0


class RacingBlockManager(BlockManager):
    """Another thread acts right after each lookup: evicts every cached block, or commits one more block
    (seen as a lookup one block short)."""

    race = "evict"

    def cached_prefix_blocks(self, block_hashes):
        hit = super().cached_prefix_blocks(block_hashes)
        if self.race == "evict" and self.num_cached:
            self.allocate("other thread", self.num_free * self.block_size)
            self.free("other thread")
        return max(0, hit - 1) if self.race == "stale" else hit


@pytest.mark.parametrize("race", ["evict", "stale"])
def test_a_lookup_gone_stale_before_the_allocation_stays_exact(race):
    sched, _, runner = make_sched(budget=12)
    bm = sched.block_manager = RacingBlockManager(64, 4, enable_prefix_caching=True)
    runner.bm = bm
    sched.add("a", PREFIX, ignore_eos(1))
    drive_cached(sched, runner)
    bm.race = race
    seq = sched.add("b", PREFIX + [1], ignore_eos(3))
    # evict: nothing is left to reuse, so b computes from 0 within the budget it planned for 20 tokens.
    # stale: b reuses the 4 blocks the lookup saw, not the 5th it missed, and computes from there.
    assert first_span(sched, runner, "b") == ((0, 12) if race == "evict" else (16, 5))
    assert seq.num_cached_tokens == (0 if race == "evict" else 16)
    done = drive_cached(sched, runner)
    assert done["b"].output_token_ids == reference(PREFIX + [1], 3)


def test_an_adopted_prompt_is_committed_when_the_engine_adopts_it():
    sched, bm, runner = make_sched()
    prompt = PREFIX[:10]
    bm.allocate("p", len(prompt))
    table = bm.block_table("p")
    for pos, t in enumerate(prompt):  # the prompt K/V "arrived over the network"
        runner.cache[table[pos // 4] * 4 + pos % 4] = (t, pos)
    sched.add_prefilled("p", prompt, next_token(prompt), ignore_eos(4))
    hs = block_hashes(prompt, 4, "fake-model")
    assert bm.cached_prefix_blocks(hs) == 2  # the received K/V is whole: its full blocks are hits at once
    drive_cached(sched, runner)  # decodes positions 10..12: block 2 fills and is committed too
    seq = sched.add("q", prompt, ignore_eos(2))
    drive_cached(sched, runner)
    assert seq.num_cached_tokens == 8 and seq.output_token_ids == reference(prompt, 2)


# -- the engine: exact with caching on ---------------------------------------------------------------------
BS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def shared_prefix_prompts(seed: int) -> list[list[int]]:
    """Prompts sharing one prefix at every alignment to blocks of 4: shorter than a block, exactly 2 and 3
    blocks, 2 blocks + 1, and longer, plus one that shares nothing."""
    stem, tails = prompts_of([14], seed=seed)[0], prompts_of([3, 1, 5, 6], seed=seed + 1)
    return [
        stem[:3] + tails[0],
        stem[:8],
        stem[:12],
        stem[:8] + tails[1],
        stem + tails[2],
        stem[:13] + tails[3],
        tails[3],
    ]


def generate_with_logits(llm: LLM, prompts, params=GREEDY):
    """``llm.generate``'s outputs and, per prompt, the logits each output token was picked from."""
    engine, rows = llm.engine, collections.defaultdict(list)
    forward = engine._forward

    def recording(batch):
        logits = forward(batch)
        for it, row in zip(batch.sample_items, logits, strict=True):
            rows[it.seq.seq_id].append(row.float().cpu())
        return logits

    engine._forward = recording
    try:
        outs = llm.generate(prompts, params)
    finally:
        del engine._forward
    return outs, [rows[o.request_id] for o in outs]


def compared_steps(got_logits, want_logits, of_largest: bool = False) -> int:
    """The exactness rule: summing cached and computed K/V in another order may move a logit by rounding,
    so a sequence is compared up to the first step whose top-2 reference logits are within 1e-5 (a near
    tie may flip); up to there the logits agree within 1e-4 (``of_largest``: within 1e-4 of the step's
    largest logit, for sums reordered across every layer, as tensor parallelism's all-reduce does).
    Returns how many steps to compare tokens at."""
    for k, (g, w) in enumerate(zip(got_logits, want_logits, strict=True)):
        top2 = w.topk(2).values
        if (top2[0] - top2[1]).item() < 1e-5:
            return k
        tolerance = 1e-4 * (w.abs().max().item() if of_largest else 1.0)
        diff = (g - w).abs().max().item()
        assert diff <= tolerance, f"step {k}: logits differ by {diff:.3g} (> {tolerance:.3g})"
    return len(want_logits)


def assert_exact(model_dir, prompts, outs, logits, ref_outs, ref_logits) -> None:
    """Caching on (outs) against caching off (ref_outs) and transformers' greedy tokens."""
    for p, o, lg, r, rlg in zip(prompts, outs, logits, ref_outs, ref_logits, strict=True):
        n = compared_steps(lg, rlg)
        assert n > len(rlg) // 2, "too many near ties to compare: pick other prompts"
        assert o.token_ids[:n] == r.token_ids[:n] == hf_greedy(model_dir, p, len(rlg))[:n]


@pytest.mark.parametrize("tiny_model_dir", ["llama", "qwen2"], indirect=True)
def test_shared_prefixes_at_every_alignment_are_exact(tiny_model_dir):
    opts = dict(dtype="float32", block_size=BS, max_num_batched_tokens=16)
    on, off = LLM(tiny_model_dir, **opts), LLM(tiny_model_dir, enable_prefix_caching=False, **opts)
    assert on.engine.cache_salt == off.engine.cache_salt  # the weights, dtype and quantization
    assert on.engine.cache_salt.startswith("pdserve-kv1:") and on.engine.cache_salt.endswith(":float32:none")
    prompts = shared_prefix_prompts(seed=10)
    ref_outs, ref_logits = generate_with_logits(off, prompts)
    assert all(o.num_cached_tokens == 0 for o in ref_outs)
    # Round 1, chunked 16 tokens a step: later prompts hit blocks earlier ones committed in the round.
    outs, logits = generate_with_logits(on, prompts)
    assert_exact(tiny_model_dir, prompts, outs, logits, ref_outs, ref_logits)
    assert any(o.num_cached_tokens > 0 for o in outs)
    # Round 2: every full block is cached by now (from sequences that finished), short of the last token.
    outs, logits = generate_with_logits(on, prompts)
    assert [o.num_cached_tokens for o in outs] == [(len(p) - 1) // BS * BS for p in prompts]
    assert outs[3].num_cached_tokens == 2 * BS  # 2 shared blocks + 1 token
    assert_exact(tiny_model_dir, prompts, outs, logits, ref_outs, ref_logits)
    assert_no_leak(on)
    assert on.engine.block_manager.num_cached > 0 and off.engine.block_manager.num_cached == 0


@pytest.mark.parametrize("mixed", [False, True], ids=["prefill_first", "mixed_steps"])
def test_preemption_and_eviction_in_a_tiny_cache_stay_exact(tiny_llama_dir, mixed):
    # 12 blocks of 4 tokens: the batch cannot all fit, so sequences are preempted and recomputed over
    # their cached blocks, and each round evicts blocks the last one cached.
    opts = dict(dtype="float32", block_size=BS, num_blocks=12, max_num_batched_tokens=8, mixed_steps=mixed)
    on, off = LLM(tiny_llama_dir, **opts), LLM(tiny_llama_dir, enable_prefix_caching=False, **opts)
    prompts = shared_prefix_prompts(seed=20)
    ref_outs, ref_logits = generate_with_logits(off, prompts)
    bm = on.engine.block_manager
    outs, logits = generate_with_logits(on, prompts)
    assert on.engine.stats().num_preemptions > 0
    assert_exact(tiny_llama_dir, prompts, outs, logits, ref_outs, ref_logits)
    other = prompts_of([20], seed=21)
    bm.drain_events()
    other_outs, other_logits = generate_with_logits(on, other)  # needs most of the cache: evicts
    assert any(isinstance(e, RemovedBlock) for e in bm.drain_events()[0])
    assert_exact(tiny_llama_dir, other, other_outs, other_logits, *generate_with_logits(off, other))
    outs, logits = generate_with_logits(on, prompts)  # what is left of the cache, and recompute
    assert_exact(tiny_llama_dir, prompts, outs, logits, ref_outs, ref_logits)
    assert_no_leak(on)


@pytest.mark.slow
def test_smollm2_chats_sharing_a_system_prompt_are_exact_with_the_cache():
    """The real model, colocated (in process): chats that share the chat template's system prompt and a
    first turn, cache on against cache off, under the exactness rule above."""
    opts = dict(dtype="float32", threads=2, kv_cache_bytes=128 << 20)
    on, off = LLM(**opts), LLM(enable_prefix_caching=False, **opts)
    tok = on.tokenizer
    assert tok is not None
    history = [{"role": "user", "content": "Name three rivers of Europe."}]
    chats = [
        history + [{"role": "assistant", "content": "The Danube, the Rhine and the Seine."}, turn]
        for turn in (
            {"role": "user", "content": "Which is the longest?"},
            {"role": "user", "content": "Which flows through Paris?"},
            {"role": "user", "content": "Name a fourth one."},
        )
    ]
    prompts = [tok.apply_chat_template(c, add_generation_prompt=True) for c in chats]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref_outs, ref_logits = generate_with_logits(off, prompts, params)
    for _ in range(2):  # the second round from the cache of the first
        outs, logits = generate_with_logits(on, prompts, params)
        for o, lg, r, rlg in zip(outs, logits, ref_outs, ref_logits, strict=True):
            n = compared_steps(lg, rlg)
            assert n > len(rlg) // 2 and o.token_ids[:n] == r.token_ids[:n]
    assert all(o.num_cached_tokens >= on.engine.block_manager.block_size for o in outs)
    assert_no_leak(on)
