"""``n`` > 1 in the engine: the seeds choices derive, the block manager's fork of a prompt's blocks, the
scheduler's fork over a fake model that reads back its cache, the engine's choices against separate
requests with the derived seeds, the prompt's blocks held once, and a leak check; the decode worker's
stream of several choices."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.decode_pool.stream import relay_deltas
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.block_manager import BlockManager, OutOfBlocksError
from pdserve.engine.llm_engine import RequestOutputDelta
from pdserve.engine.params import MAX_N, choice_params, choice_seed
from pdserve.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.engine.sequence import ChoiceId, SequenceStatus
from tests.unit.test_llm import assert_no_leak, prompts_of
from tests.unit.test_scheduler import EOS, FakeRunner, next_token, reference


# -- parameters ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, -1, MAX_N + 1, 1.5, "2", True])
def test_n_out_of_bounds_names_n(n):
    with pytest.raises(ValueError, match=r"^n must be"):
        SamplingParams(n=n)


def test_choice_seeds_are_the_request_seed_plus_the_index():
    assert [choice_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert choice_seed(2**64 - 1, 1) == 0  # (mod 2**64: a uint64 on the wire)
    assert choice_seed(None, 3) is None
    p = SamplingParams(n=4, seed=10, temperature=0.5, max_tokens=9)
    assert choice_params(p, 2) == SamplingParams(n=1, seed=12, temperature=0.5, max_tokens=9)
    one = SamplingParams(seed=3)
    assert choice_params(one, 0) is one


# -- block manager ---------------------------------------------------------------------------------------
def test_fork_prefix_shares_full_blocks_and_gives_a_fresh_partial_block():
    bm = BlockManager(8, 4)
    bm.allocate("p", 10)  # two full blocks and a partial one
    src = bm.block_table("p")
    copy = bm.fork_prefix("p", "c", 10)
    dst = bm.block_table("c")
    assert dst[:2] == src[:2] and dst[2] != src[2]
    assert copy == (src[2], dst[2])
    assert bm.num_used == 4
    assert (
        bm.fork_prefix("p", "d", 8) is None and bm.block_table("d") == src[:2]
    )  # whole blocks: nothing to copy
    bm.check_invariants()
    for sid in ("p", "c", "d"):
        bm.free(sid)
    assert bm.num_free == 8
    bm.check_invariants()


def test_fork_prefix_is_all_or_nothing():
    bm = BlockManager(3, 4)
    bm.allocate("p", 10)
    with pytest.raises(OutOfBlocksError):
        bm.fork_prefix("p", "c", 10)
    assert "c" not in bm and bm.num_used == 3
    bm.check_invariants()


# -- scheduler (fake model) ------------------------------------------------------------------------------
class CopyingRunner(FakeRunner):
    """The fake model, with the engine's block copies: a copied block carries the K/V its source holds."""

    def copy_blocks(self, sched: Scheduler) -> None:
        B = self.bm.block_size
        for src, dst in sched.choices.block_copies:
            for o in range(B):
                if src * B + o in self.cache:
                    self.cache[dst * B + o] = self.cache[src * B + o]
                else:
                    self.cache.pop(dst * B + o, None)
        sched.choices.block_copies.clear()


def fork_tokens(seq, choices: int) -> list[int]:
    """The first tokens of choices 1.. of ``seq`` (before it has output): each differs (a sampler's would,
    seeded apart), so the fake model then decodes each choice from what its own blocks hold."""
    return [1 + (next_token(seq.prompt_token_ids) + 7 * c) % 49 for c in range(1, choices)]


def run(sched: Scheduler, runner: CopyingRunner, on_step=None) -> dict:
    done = {}
    for _ in range(1000):
        if not sched.has_unfinished():
            return done
        batch = sched.schedule()
        assert batch is not None
        tokens = runner.run(sched, batch)
        forks = {
            it.seq.seq_id: fork_tokens(it.seq, 1 + it.seq.forks) for it in batch.sample_items if it.seq.forks
        }
        for seq in sched.postprocess(batch, tokens, forks):
            if seq.is_finished:
                done[seq.seq_id] = seq
        runner.copy_blocks(sched)
        sched.block_manager.check_invariants()
        if on_step:
            on_step()
    pytest.fail("did not finish")


def make(num_blocks=64, caching=False):
    bm = BlockManager(num_blocks, 4, enable_prefix_caching=caching)
    cfg = SchedulerConfig(max_model_len=1000, max_num_batched_tokens=64, eos_token_ids=(EOS,))
    return Scheduler(cfg, bm), bm, CopyingRunner(bm)


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("prompt_len", [8, 10])
def test_choices_fork_from_the_computed_prompt_and_decode_from_their_own_blocks(caching, prompt_len):
    sched, bm, runner = make(caching=caching)
    prompt = list(range(3, 3 + prompt_len))
    sched.add("r", prompt, SamplingParams(n=3, max_tokens=6, ignore_eos=True))
    peak = []
    done = run(sched, runner, on_step=lambda: peak.append(bm.num_used))
    assert set(done) == {"r", ChoiceId("r", 1), ChoiceId("r", 2)}
    firsts = [done["r"].output_token_ids[0], *fork_tokens(done["r"], 3)]
    for i, sid in enumerate(["r", ChoiceId("r", 1), ChoiceId("r", 2)]):
        seq = done[sid]
        assert (seq.request_id, seq.index) == ("r", i)
        assert seq.output_token_ids[0] == firsts[i]
        # Every later token is the fake model's reading of this choice's own cache: prompt + its outputs.
        assert seq.output_token_ids[1:] == reference(prompt + [firsts[i]], 5)
    # Right after the fork: the prompt's full blocks once, and a partial block per choice.
    full, partial = divmod(prompt_len, 4)
    assert peak[0] == full + 3 * (partial > 0)
    assert bm.num_used == 0 and not sched.has_request("r")


def test_a_choice_with_no_block_for_its_copy_waits_and_recomputes():
    sched, bm, runner = make(num_blocks=9)
    prompt = list(range(3, 13))  # 3 blocks, the last partial
    sched.add("r", prompt, SamplingParams(n=3, max_tokens=2, ignore_eos=True))
    bm.allocate("other", 20)  # 5 of the 9 blocks: room for the prompt and one copy only
    batch = sched.schedule()
    tokens = runner.run(sched, batch)
    out = sched.postprocess(batch, tokens, {"r": fork_tokens(batch.items[0].seq, 3)})
    runner.copy_blocks(sched)
    c1, c2 = out[1:]
    assert c1.status is SequenceStatus.RUNNING and c2.status is SequenceStatus.WAITING and c2.seq_id not in bm
    bm.free("other")
    done = run(sched, runner)
    assert done[c2.seq_id].output_token_ids == [
        c2.output_token_ids[0],
        *reference(prompt + c2.output_token_ids[:1], 1),
    ]
    assert bm.num_used == 0


def test_abort_ends_every_choice_and_a_prefilled_request_forks_at_adoption():
    sched, bm, runner = make()
    sched.add("r", list(range(3, 13)), SamplingParams(n=4, max_tokens=8, ignore_eos=True))
    for _ in range(2):
        b = sched.schedule()
        toks = runner.run(sched, b)
        sched.postprocess(
            b,
            toks,
            {s.seq_id: fork_tokens(s, 1 + s.forks) for s in (it.seq for it in b.sample_items) if s.forks},
        )
        runner.copy_blocks(sched)
    assert len(sched.request_seqs("r")) == 4 and sched.num_unfinished == 4
    assert sched.abort("r") and not sched.has_request("r") and bm.num_used == 0
    bm.check_invariants()

    bm.allocate("p", 10)  # the prompt's K/V "arrived over the network"
    seqs = sched.add_prefilled_choices(
        "p", list(range(3, 13)), [5, 6, EOS], SamplingParams(n=3, max_tokens=4)
    )
    assert [s.output_token_ids for s in seqs] == [[5], [6], [EOS]]
    assert (
        seqs[2].is_finished and len(sched.choices.block_copies) == 2
    )  # (the finished one's copy is harmless)
    with pytest.raises(ValueError, match="first tokens"):
        sched.add_prefilled_choices("q", [1, 2], [5], SamplingParams(n=2))
    sched.abort("p")
    assert bm.num_used == 0
    bm.check_invariants()


def test_the_cache_bounds_n():
    sched, _, _ = make(num_blocks=16)
    sched.check_fits(10, SamplingParams(n=2, max_tokens=22))  # 8 blocks each
    with pytest.raises(ValueError, match=r"^n is 3: .* lower n"):
        sched.check_fits(10, SamplingParams(n=3, max_tokens=22))


# -- engine (tiny model) ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", num_blocks=96, block_size=4)


def separate(llm, prompt, params: SamplingParams) -> list[list[int]]:
    """The choices as separate requests with the derived seeds, in one batch."""
    plist = [choice_params(params, i) for i in range(params.n)]
    return [o.token_ids for o in llm.generate([prompt] * params.n, plist)]


@pytest.mark.parametrize("caching", [True, False])
def test_n_with_a_seed_equals_separate_requests_with_the_derived_seeds(tiny_llama_dir, caching):
    llm = LLM(tiny_llama_dir, dtype="float32", num_blocks=96, block_size=4, enable_prefix_caching=caching)
    prompt = prompts_of([11], seed=3)[0]  # two full blocks and a partial one
    sp = SamplingParams(n=4, seed=123, temperature=1.0, max_tokens=16, ignore_eos=True)
    out = llm.generate([prompt, prompts_of([5], seed=4)[0]], [sp, SamplingParams(max_tokens=4)])[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    choices = [o.token_ids for o in out.outputs]
    assert choices == separate(llm, prompt, sp)
    assert len({tuple(c) for c in choices}) == 4  # seeds apart: different draws
    assert (out.token_ids, out.finish_reason) == (choices[0], "length")
    assert_no_leak(llm)


def test_the_prompt_is_computed_once_and_its_full_blocks_held_once(llm):
    eng = llm.engine
    bm = eng.block_manager
    prompt = prompts_of([14], seed=5)[0]  # three full blocks and a partial one
    eng.add_request("r", prompt, SamplingParams(n=4, seed=1, max_tokens=3, ignore_eos=True))
    computed = []
    deltas = eng.step()  # the prompt's one prefill: every choice's first token
    computed.append(eng.last_batch.num_tokens)
    assert sorted(d.choice_index for d in deltas) == [0, 1, 2, 3] and {d.request_id for d in deltas} == {"r"}
    tables = [bm.block_table(s.seq_id) for s in eng.scheduler.request_seqs("r")]
    assert all(t[:3] == tables[0][:3] for t in tables)  # the full blocks: shared
    assert len({t[3] for t in tables}) == 4  # the partial one: a copy each
    assert bm.num_used == 3 + 4  # not 4 x 4
    while eng.has_unfinished():
        eng.step()
        computed.append(eng.last_batch.num_tokens)
    assert computed == [14, 4, 4]  # the prompt once, then one token per choice a step
    assert_no_leak(eng)


def test_moved_choices_go_on_from_their_own_tokens_as_undisturbed(llm):
    """A request moved after some output (choice 1 finished, left out): each open choice continues from
    its own tokens with its own seed and output indices, to what the undisturbed request gave."""
    eng = llm.engine
    prompt = prompts_of([9], seed=8)[0]
    sp = SamplingParams(n=3, seed=5, max_tokens=10, ignore_eos=True)
    want = [o.token_ids for o in llm.generate([prompt], sp)[0].outputs]
    eng.add_resumed_choices("m", prompt, sp, [(0, want[0][:4]), (2, want[2][:2])])
    got = {0: want[0][:4], 2: want[2][:2]}
    while eng.has_unfinished():
        for d in eng.step():
            got[d.choice_index] = got[d.choice_index] + list(d.new_token_ids)
            assert d.request_id == "m" and d.num_output_tokens == len(got[d.choice_index])
    assert got == {0: want[0], 2: want[2]}
    with pytest.raises(ValueError, match="choices must be distinct"):
        eng.add_resumed_choices("x", prompt, sp, [(3, [])])
    assert_no_leak(eng)


def test_stream_and_abort_cover_every_choice(llm):
    sp = SamplingParams(n=3, seed=9, max_tokens=5, ignore_eos=True)
    prompt = prompts_of([6], seed=6)[0]
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finishes = 0
    for d in llm.stream(prompt, sp):
        seen[d.choice_index] += d.new_token_ids
        finishes += d.finish_reason is not None
    assert finishes == 3 and list(seen.values()) == separate(llm, prompt, sp)
    stream = llm.stream(prompt, SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    for _ in range(4):
        next(stream)
    stream.close()  # aborts every choice
    assert_no_leak(llm)


# -- the decode worker's stream --------------------------------------------------------------------------
def test_the_decode_stream_coalesces_each_choice_apart_and_ends_with_the_last_finish():
    def delta(index: int, token: int, count: int, finish: str | None = None) -> RequestOutputDelta:
        return RequestOutputDelta("r", (token,), "", finish, 3, count, 0, choice_index=index)

    async def main() -> list[tuple[int, int, list[int], str]]:
        q: asyncio.Queue = asyncio.Queue()
        for d in (delta(0, 5, 1), delta(1, 6, 1), delta(0, 7, 2), delta(1, 8, 2, "stop")):
            q.put_nowait(d)
        msgs = []
        stream = relay_deltas(q, choices=2)
        msgs += [await stream.__anext__(), await stream.__anext__()]
        q.put_nowait(delta(0, 9, 3, "length"))
        q.put_nowait(None)
        msgs += [m async for m in stream]
        return [(m.index, m.first_index, list(m.token_ids), m.finish_reason) for m in msgs]

    assert asyncio.run(main()) == [(0, 0, [5, 7], ""), (1, 0, [6, 8], "stop"), (0, 2, [9], "length")]
