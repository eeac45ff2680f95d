"""Scheduler: pure logic driven by a fake model that reads and writes a simulated paged KV cache.

The fake model's next token is a function of the tokens it *reads back from the
cache*, so a block freed too early, reused while live, or a wrong position or
chunk boundary changes the output and the test sees it.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.params import SamplingParams
from pdserve.engine.scheduler import BatchKind, Scheduler, SchedulerConfig, check_stop
from pdserve.engine.sequence import FinishReason, Sequence, SequenceStatus

V = 50
EOS = 0


def next_token(tokens: list[int]) -> int:
    h = len(tokens)
    for t in tokens:
        h = (h * 31 + t) % 1_000_003
    return 1 + h % (V - 1)  # never EOS: tests choose when a stream stops


def reference(prompt: list[int], max_tokens: int, max_model_len: int = 10_000) -> list[int]:
    toks = list(prompt)
    out: list[int] = []
    while len(out) < max_tokens and len(toks) < max_model_len:
        out.append(next_token(toks))
        toks.append(out[-1])
    return out


class FakeRunner:
    """Executes batches against a dict-backed paged cache and checks what attention would read."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.cache: dict[int, tuple[object, int]] = {}  # slot -> (token, position)
        self.max_decode = 0
        self.max_prefill_tokens = 0

    def run(self, sched: Scheduler, batch) -> list[int]:
        B = self.bm.block_size
        out = []
        for it in batch.items:
            seq = it.seq
            table = self.bm.block_table(seq.seq_id)
            assert len(table) * B >= it.start + it.num_tokens, "block table does not cover the step"
            assert seq.num_computed_tokens == it.start, "step does not start at the first uncached token"
            toks = seq.token_ids()

            def slot(p: int, table: list[int] = table) -> int:
                return table[p // B] * B + p % B

            for p in range(it.start):  # what attention reads must be this sequence's own K/V
                assert self.cache.get(slot(p)) == (toks[p], p), f"KV of {seq.seq_id} position {p} corrupted"
            for p in range(it.start, it.start + it.num_tokens):
                self.cache[slot(p)] = (toks[p], p)
            if it.sample:
                out.append(next_token([self.cache[slot(p)][0] for p in range(it.start + it.num_tokens)]))
        decodes, prefills = batch.items[: batch.decodes], batch.items[batch.decodes :]
        assert (batch.kind is BatchKind.DECODE) == (not prefills)
        assert (batch.kind is BatchKind.PREFILL) == (not decodes)
        assert all(it.num_tokens == 1 and it.sample for it in decodes)
        assert batch.num_tokens <= sched.config.max_num_batched_tokens or not prefills
        self.max_decode = max(self.max_decode, len(decodes))
        self.max_prefill_tokens = max(self.max_prefill_tokens, sum(it.num_tokens for it in prefills))
        return out


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=1000, mixed=True):
    bm = BlockManager(num_blocks, block_size)
    cfg = SchedulerConfig(
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        eos_token_ids=(EOS,),
        mixed_steps=mixed,
    )
    return Scheduler(cfg, bm), bm, FakeRunner(bm)


def drive(sched: Scheduler, runner: FakeRunner, max_steps: int = 5000, on_step=None) -> dict:
    done: dict[object, Sequence] = {}
    for step in range(max_steps):
        if not sched.has_unfinished():
            break
        batch = sched.schedule()
        assert batch is not None, "work is pending but nothing can be scheduled (deadlock)"
        for seq in sched.postprocess(batch, runner.run(sched, batch)):
            if seq.is_finished:
                done[seq.seq_id] = seq
        sched.block_manager.check_invariants()
        live = [s.seq_id for s in sched.running + sched.waiting if s.seq_id in sched.block_manager]
        tables = [b for sid in live for b in sched.block_manager.block_table(sid)]
        assert len(tables) == len(set(tables)), "a block is held by two live sequences"
        assert len(sched.running) <= sched.config.max_num_seqs
        if on_step:
            on_step(step)
    else:
        pytest.fail("did not finish within the step bound")
    return done


def ignore_eos(n):
    return SamplingParams(max_tokens=n, ignore_eos=True)


def test_prefill_chunks_long_prompts_under_the_token_budget():
    sched, bm, runner = make(budget=8)
    sched.add("a", list(range(1, 21)), ignore_eos(3))
    spans = []
    while (b := sched.schedule()) is not None and b.kind is BatchKind.PREFILL:
        spans.append([(it.start, it.num_tokens, it.sample) for it in b.items])
        sched.postprocess(b, runner.run(sched, b))
    assert spans == [[(0, 8, False)], [(8, 8, False)], [(16, 4, True)]]
    done = drive(sched, runner)
    assert done["a"].output_token_ids == reference(list(range(1, 21)), 3)
    assert bm.num_free == bm.num_blocks


@pytest.mark.parametrize("mixed", [True, False])
def test_budget_packs_several_prompts_and_splits_the_last(mixed):
    sched, _, runner = make(budget=10, mixed=mixed)
    for i, n in enumerate([3, 4, 6]):
        sched.add(i, list(range(1, n + 1)), ignore_eos(2))
    b = sched.schedule()
    assert [(it.seq.seq_id, it.start, it.num_tokens, it.sample) for it in b.items] == [
        (0, 0, 3, True),
        (1, 0, 4, True),
        (2, 0, 3, False),
    ]
    sched.postprocess(b, runner.run(sched, b))
    b = sched.schedule()
    if mixed:  # the two running streams decode in the same step as the rest of the partial prefill
        assert b.kind is BatchKind.MIXED and b.decodes == 2
        assert [(it.seq.seq_id, it.start, it.num_tokens) for it in b.items] == [
            (0, 3, 1),
            (1, 4, 1),
            (2, 3, 3),
        ]
    else:  # the partial prefill heads the queue and goes first
        assert [(it.seq.seq_id, it.start, it.num_tokens) for it in b.items] == [(2, 3, 3)]


def test_mixed_steps_keep_streams_decoding_while_a_long_prompt_prefills():
    """A long prompt chunked over several steps: every step also decodes the running streams, and the
    decodes count against the token budget."""
    sched, bm, runner = make(budget=8)
    sched.add("a", [1, 2], ignore_eos(10))
    sched.add("b", [3, 4], ignore_eos(10))
    sched.postprocess(b := sched.schedule(), runner.run(sched, b))  # both prompts, one step
    sched.add("long", list(range(1, 21)), ignore_eos(2))
    chunks = []
    while (b := sched.schedule()).kind is BatchKind.MIXED:
        assert [it.seq.seq_id for it in b.items[: b.decodes]] == ["a", "b"]
        assert b.num_tokens <= 8
        chunks.append([(it.start, it.num_tokens) for it in b.items[b.decodes :]])
        sched.postprocess(b, runner.run(sched, b))
    assert chunks == [[(0, 6)], [(6, 6)], [(12, 6)], [(18, 2)]]
    done = drive(sched, runner)
    assert done["long"].output_token_ids == reference(list(range(1, 21)), 2)
    assert done["a"].output_token_ids == reference([1, 2], 10)
    assert bm.num_free == bm.num_blocks


def test_mixed_steps_wait_for_room_when_decodes_fill_the_budget():
    sched, bm, runner = make(budget=2)
    sched.add("a", [1], ignore_eos(3))
    sched.add("b", [2], ignore_eos(3))
    sched.postprocess(b := sched.schedule(), runner.run(sched, b))
    sched.add("c", [5, 6], ignore_eos(1))
    b = sched.schedule()
    assert b.kind is BatchKind.DECODE and len(b.items) == 2  # no token left for c's prompt
    sched.postprocess(b, runner.run(sched, b))
    done = drive(sched, runner)
    assert done["c"].output_token_ids == reference([5, 6], 1)
    assert bm.num_free == bm.num_blocks


def test_max_num_seqs_bounds_running_and_decode_batches():
    sched, bm, runner = make(max_num_seqs=2)
    prompts = {i: [i + 1] * (i + 2) for i in range(5)}
    for i, p in prompts.items():
        sched.add(i, p, ignore_eos(4 + i))
    done = drive(sched, runner)
    assert runner.max_decode == 2
    for i, p in prompts.items():
        assert done[i].output_token_ids == reference(p, 4 + i)
        assert done[i].finish_reason is FinishReason.LENGTH
    assert bm.num_free == bm.num_blocks


def test_finished_sequences_free_blocks_at_once():
    sched, bm, runner = make()
    sched.add("short", [1, 2, 3], ignore_eos(1))
    sched.add("long", [4, 5, 6], ignore_eos(20))
    b = sched.schedule()
    finished = [s for s in sched.postprocess(b, runner.run(sched, b)) if s.is_finished]
    assert [s.seq_id for s in finished] == ["short"]
    assert "short" not in bm and bm.num_used == bm.blocks_needed(3)
    drive(sched, runner)
    assert bm.num_free == bm.num_blocks


def test_preemption_under_block_pressure_recomputes_and_stays_correct():
    # 12 blocks of 4 = 48 slots; four sequences want up to 3 + 30 tokens each.
    sched, bm, runner = make(num_blocks=12, block_size=4, max_num_seqs=4, budget=64)
    prompts = {i: [i + 1, i + 2, i + 3] for i in range(4)}
    for i, p in prompts.items():
        sched.add(i, p, ignore_eos(30))
    done = drive(sched, runner)
    assert sum(s.num_preemptions for s in done.values()) > 0
    for i, p in prompts.items():
        assert done[i].output_token_ids == reference(p, 30)
    assert bm.num_free == bm.num_blocks


def test_request_that_cannot_fit_the_cache_is_rejected_up_front():
    sched, _, _ = make(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add("x", [1] * 10, ignore_eos(10))  # 20 tokens > 16 slots
    sched.add("y", [1] * 10, ignore_eos(6))
    with pytest.raises(ValueError, match="already in use"):
        sched.add("y", [1], ignore_eos(1))
    with pytest.raises(ValueError, match="context"):
        make(max_model_len=8)[0].add("z", [1] * 8, ignore_eos(1))
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_model_len=8, max_num_seqs=0)


def test_context_limit_finishes_with_length():
    sched, bm, runner = make(max_model_len=10)
    sched.add("a", [1, 2, 3, 4, 5, 6], ignore_eos(100))  # the cache-fit check caps at the context
    done = drive(sched, runner)
    assert done["a"].num_tokens == 10 and done["a"].finish_reason is FinishReason.LENGTH
    assert done["a"].output_token_ids == reference([1, 2, 3, 4, 5, 6], 100, max_model_len=10)


def test_abort_frees_blocks_in_every_state():
    sched, bm, runner = make(budget=4, max_num_seqs=2)
    sched.add("run", [1, 2], ignore_eos(50))
    sched.add("partial", list(range(1, 12)), ignore_eos(50))
    sched.add("queued", [3, 4], ignore_eos(50))
    for _ in range(2):
        b = sched.schedule()
        sched.postprocess(b, runner.run(sched, b))
    assert sched.get("run").status is SequenceStatus.RUNNING
    assert sched.get("partial").num_computed_tokens > 0 and "partial" in bm
    assert "queued" not in bm
    bm.allocate("reserved", 8)  # a decode worker's reservation the engine never adopted
    for rid in ("run", "partial", "queued", "reserved"):
        assert sched.abort(rid) is True
        assert rid not in bm
    assert sched.abort("run") is False and sched.abort("nope") is False
    assert not sched.has_unfinished() and bm.num_free == bm.num_blocks
    assert sched.schedule() is None


def test_abort_between_schedule_and_postprocess():
    sched, bm, runner = make()
    sched.add("a", [1, 2], ignore_eos(5))
    sched.add("b", [3, 4], ignore_eos(5))
    b = sched.schedule()
    toks = runner.run(sched, b)
    sched.abort("a")
    got = sched.postprocess(b, toks)
    assert [s.seq_id for s in got] == ["b"]
    drive(sched, runner)
    assert bm.num_free == bm.num_blocks


def test_prefilled_request_is_adopted_and_decodes():
    sched, bm, runner = make()
    prompt = [7, 8, 9, 10, 11]
    bm.allocate("p", len(prompt))
    table = bm.block_table("p")
    for pos, t in enumerate(prompt):  # the prompt K/V "arrived over the network"
        runner.cache[table[pos // 4] * 4 + pos % 4] = (t, pos)
    first = next_token(prompt)
    seq = sched.add_prefilled("p", prompt, first, ignore_eos(6))
    assert seq.status is SequenceStatus.RUNNING and seq.output_token_ids == [first]
    done = drive(sched, runner)
    assert done["p"].output_token_ids == reference(prompt, 6)
    assert bm.num_free == bm.num_blocks


def test_prefilled_first_token_goes_through_stop_checks():
    sched, bm, _ = make()
    bm.allocate("e", 3)
    seq = sched.add_prefilled("e", [1, 2, 3], EOS, SamplingParams(max_tokens=5))
    assert seq.finish_reason is FinishReason.STOP and "e" not in bm
    bm.allocate("one", 3)
    seq = sched.add_prefilled("one", [1, 2, 3], 9, SamplingParams(max_tokens=1))
    assert seq.finish_reason is FinishReason.LENGTH and "one" not in bm
    with pytest.raises(ValueError, match="holds no blocks"):
        sched.add_prefilled("none", [1, 2, 3], 9, SamplingParams())
    bm.allocate("small", 2)
    with pytest.raises(ValueError, match="holds no blocks"):
        sched.add_prefilled("small", [1, 2, 3, 4, 5], 9, SamplingParams())
    assert "small" in bm  # the caller still owns its blocks on error
    assert not sched.has_unfinished()


def _seq(out, **kw):
    s = Sequence("s", [1, 2], SamplingParams(**kw), arrival=0)
    s.output_token_ids = list(out)
    return s


def test_check_stop_rules():
    assert check_stop(_seq([EOS]), (EOS,), 100) is FinishReason.STOP
    assert check_stop(_seq([EOS], ignore_eos=True), (EOS,), 100) is None
    assert check_stop(_seq([7], stop_token_ids=[7]), (EOS,), 100) is FinishReason.STOP
    assert check_stop(_seq([7], stop_token_ids=[7], ignore_eos=True), (EOS,), 100) is FinishReason.STOP
    assert check_stop(_seq([EOS], min_tokens=2), (EOS,), 100) is None
    assert check_stop(_seq([3, EOS], min_tokens=2), (EOS,), 100) is FinishReason.STOP
    assert check_stop(_seq([3] * 16), (EOS,), 100) is FinishReason.LENGTH  # default max_tokens
    assert check_stop(_seq([3]), (EOS,), 3) is FinishReason.LENGTH  # context full
    assert check_stop(_seq([3, EOS], max_tokens=2), (EOS,), 100) is FinishReason.STOP


def test_eos_stops_sequences_in_a_run():
    sched, bm, runner = make()
    # next_token never yields EOS, so use a stop token id taken from the reference stream.
    prompt = [5, 6, 7]
    ref = reference(prompt, 10)
    sched.add("s", prompt, SamplingParams(max_tokens=10, stop_token_ids=[ref[3]]))
    done = drive(sched, runner)
    cut = ref.index(ref[3]) + 1
    assert done["s"].output_token_ids == ref[:cut] and done["s"].finish_reason is FinishReason.STOP


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    num_blocks=st.integers(8, 40),
    block_size=st.sampled_from([1, 2, 4, 8]),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 40),
    mixed=st.booleans(),
)
def test_random_workloads_finish_correctly_without_leaks(
    data, num_blocks, block_size, max_num_seqs, budget, mixed
):
    sched, bm, runner = make(num_blocks, block_size, max_num_seqs, budget, max_model_len=64, mixed=mixed)
    cap = num_blocks * block_size
    n = data.draw(st.integers(1, 8), label="requests")
    expect = {}
    for i in range(n):
        plen = data.draw(st.integers(1, min(40, cap - 1, 63)), label="prompt_len")
        max_tokens = data.draw(st.integers(1, max(1, min(cap, 64) - plen)), label="max_tokens")
        prompt = data.draw(st.lists(st.integers(1, V - 1), min_size=plen, max_size=plen), label="prompt")
        sched.add(i, prompt, ignore_eos(max_tokens))
        expect[i] = reference(prompt, max_tokens, max_model_len=64)
    aborts = data.draw(st.dictionaries(st.integers(0, n - 1), st.integers(0, 30), max_size=2), label="aborts")

    def maybe_abort(step):
        for rid, at in aborts.items():
            if at == step and sched.abort(rid):
                expect.pop(rid)

    done = drive(sched, runner, on_step=maybe_abort)
    for rid, toks in expect.items():
        assert done[rid].output_token_ids == toks
    assert bm.num_free == bm.num_blocks and len(bm) == 0
