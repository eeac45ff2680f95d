"""Speculative decoding (``engine.speculative``): the n-gram proposer, the adaptive rule, and exact
acceptance: greedy and seeded output with speculation equals the output without it (and transformers'
greedy tokens), batched with mixed lengths, with penalties, min_tokens, stop tokens, logprobs, prefix
caching, a cache small enough to refuse lookahead blocks, and a stream moved live between verify steps;
unseeded sampling keeps its distribution.

A random tiny model rarely repeats itself, so most tests propose with an oracle that knows the
non-speculative output and spoils some of its guesses on purpose: every verify path (all accepted, some,
none) runs on every step, which the n-gram proposer alone would reach only by chance.

Exactness rule: a verify forward computes a stream's positions as rows of one batch where single steps
computed them one by one, so a product over several rows may sum in another order; a sequence is compared
up to the first step whose top-2 reference logits are within 1e-5 (``compared_steps``), and its logits
agree within 1e-4 up to there.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.sequence import Sequence
from pdserve.engine.speculative import (
    DEFAULT_ROW_SHARE,
    PROBE_PAUSE_STEPS,
    DraftProposer,
    NgramProposer,
    SpeculativeConfig,
    Speculator,
    StepCost,
    accepted_prefix,
)
from tests.unit.test_llm import assert_no_leak, hf_greedy, prompts_of
from tests.unit.test_prefix_cache import compared_steps, generate_with_logits

N = 40
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)


class OracleProposer:
    """Proposes the reference continuation of each prompt, spoiling it by the number of outputs so far:
    every third step its first guess (nothing accepted), every other step one later guess (some
    accepted); the rest are whole (all accepted)."""

    def __init__(self, refs: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        self.refs, self.vocab = refs, vocab

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        return [self.guess(s, n) if n else [] for s, n in zip(seqs, limits, strict=True)]

    def guess(self, seq: Sequence, max_tokens: int) -> list[int]:
        ref = self.refs[tuple(seq.prompt_token_ids)]
        n = len(seq.output_token_ids)
        prop = list(ref[n : n + max_tokens])
        if not prop:
            return []
        if n % 3 == 0:
            prop[0] = (prop[0] + 1) % self.vocab
        elif n % 2 == 0 and len(prop) > 1:
            prop[len(prop) // 2] = (prop[len(prop) // 2] + 7) % self.vocab
        return prop


def speculating(model_dir, k: int, refs, adaptive: bool = False, **opts) -> LLM:
    llm = LLM(
        model_dir,
        dtype="float32",
        speculative_config={"num_speculative_tokens": k, "adaptive": adaptive},
        **opts,
    )
    spec = llm.engine.speculator
    assert spec is not None
    spec.proposer = OracleProposer(refs, llm.engine.vocab_size)
    return llm


def assert_same_tokens(prompts, outs, logits, ref_outs, ref_logits, model_dir=None) -> None:
    for p, o, lg, r, rlg in zip(prompts, outs, logits, ref_outs, ref_logits, strict=True):
        n = compared_steps(lg, rlg) if lg else len(rlg)
        assert n > len(rlg) // 2, "too many near ties to compare: pick other prompts"
        assert o.token_ids[:n] == r.token_ids[:n]
        if model_dir is not None:
            assert o.token_ids[:n] == hf_greedy(model_dir, p, len(rlg))[:n]


def spec_logits(llm: LLM, prompts, params):
    """``generate_with_logits`` for a speculating engine: the logits each output token was sampled from,
    recorded from the verify forwards (rows in stream order) and the plain steps."""
    engine, rows = llm.engine, collections.defaultdict(list)
    forward = engine._forward
    sample = engine._sample_speculative

    def recording_sample(seqs, proposals, logits, row_seq, masks):
        tokens = sample(seqs, proposals, logits, row_seq, masks)
        r = 0
        for seq, prop in zip(seqs, proposals, strict=True):
            got = accepted_prefix(prop, tokens[r : r + len(prop) + 1]) + 1
            for j in range(got):
                rows[seq.seq_id].append(logits[r + j].float().cpu())
            r += len(prop) + 1
        return tokens

    def recording_forward(batch):
        out = forward(batch)
        for it, row in zip(batch.sample_items, out, strict=True):
            rows[it.seq.seq_id].append(row.float().cpu())
        return out

    engine._sample_speculative, engine._forward = recording_sample, recording_forward
    try:
        outs = llm.generate(prompts, params)
    finally:
        del engine._sample_speculative, engine._forward
    return outs, [rows[o.request_id][: len(o.token_ids)] for o in outs]


# -- the pieces ------------------------------------------------------------------------------------------
def test_ngram_proposes_the_continuation_of_the_longest_most_recent_match():
    prop = NgramProposer(SpeculativeConfig(prompt_lookup_min=2, prompt_lookup_max=3))
    seq = Sequence("s", [5, 6, 7, 8, 1, 2, 5, 6, 9, 4, 5, 6], GREEDY, 0)
    # [5, 6] occurred twice before the end; the most recent occurrence continues [9, 4, 5].
    assert prop.lookup(seq, 3) == [9, 4, 5]
    seq.output_token_ids += [9]  # now [5, 6, 9] matches (the longest n first) and continues [4, 5, 6, 9]
    assert prop.lookup(seq, 8) == [4, 5, 6, 9]
    seq.output_token_ids += [3, 3]  # [9, 3, 3] / [3, 3] never occurred before: nothing
    assert prop.lookup(seq, 4) == []
    other = Sequence("t", [1], GREEDY, 0)
    assert prop.propose([seq, other, seq], [4, 4, 0]) == [[], [], []]


def _fitted(a: float, b: float) -> StepCost:
    cost = StepCost()
    for rows in (1, 2, 3, 4, 5) * 4:
        cost.observe(rows, a + b * rows)
    return cost


def test_the_step_cost_fit_gives_the_share_of_a_step_its_rows_cost():
    cost = StepCost()
    for _ in range(20):  # one size of step only: nothing to fit a slope to
        cost.observe(8, 0.1)
    assert cost.row_share(8) == DEFAULT_ROW_SHARE
    cost = _fitted(a=0.9, b=0.1)
    assert cost.row_share(1) == pytest.approx(0.1) and cost.row_share(9) == pytest.approx(0.5)


def test_the_adaptive_rule_weighs_acceptance_against_the_step_cost_and_rests_streams_that_do_not_pay():
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4))
    spec.step_cost = _fitted(a=0.9, b=0.1)
    spec.plan(1)  # batch 1: a row costs a tenth of the step
    seq = Sequence("s", [1, 2], GREEDY, 0)
    assert spec.limit(seq, 10) == 3  # the prior even chance: 1/2, 1/4, 1/8 > 1/10 > 1/16
    spec.record(seq, 3, 3)  # all accepted: the fourth token pays too
    assert spec.limit(seq, 10) == 4
    assert spec.limit(seq, 3) == 3 and spec.limit(seq, 0) == 0  # the room caps it
    for _ in range(2):  # wholly rejected: its acceptance falls, and fewer tokens pay
        spec.record(seq, 4, 0)
    assert 1 <= spec.limit(seq, 10) < 4
    for _ in range(5):  # more misses: not even its first token pays at a tenth of the step
        spec.record(seq, 1, 0)
    # It rests, then tries one token (so that its estimate can move), and rests again if that does not pay.
    rests = [0] * (PROBE_PAUSE_STEPS + 1)
    assert [spec.limit(seq, 10) for _ in range(PROBE_PAUSE_STEPS + 3)] == [*rests, 1, 0]
    for _ in range(2):  # accepted tokens raise it again: once its rest is over, it proposes
        spec.record(seq, 1, 1)
    assert [spec.limit(seq, 10) for _ in range(PROBE_PAUSE_STEPS + 1)][-1] >= 1

    sure = Sequence("t", [1, 2], GREEDY, 0)
    for _ in range(3):
        spec.record(sure, 4, 4)
    assert spec.limit(sure, 10) == 4
    spec.step_cost = _fitted(a=0.01, b=0.1)
    spec.plan(8)  # 8 streams where rows cost nearly all of a step: not even a 96% token pays
    assert [spec.limit(sure, 10) for _ in range(PROBE_PAUSE_STEPS + 3)] == [*rests, 1, 0]
    fixed = Speculator(SpeculativeConfig(num_speculative_tokens=4, adaptive=False))
    fixed.plan(8)
    assert fixed.limit(Sequence("u", [1, 2], GREEDY, 0), 10) == 4
    s = spec.stats
    assert s.verify_steps == 0 and s.streams_verified == 1 + 2 + 5 + 2 + 3
    assert 0 < s.acceptance_rate < 1 and s.mean_accepted_length > 1


def test_a_costly_proposer_proposes_fewer_tokens():
    # Batch 1, a row a tenth of a step: the prior even chance pays for 3 tokens when proposing is free
    # (1/2, 1/4, 1/8 > 1/10). A draft whose every token costs a quarter of a step pays for one only.
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4))
    spec.step_cost = _fitted(a=0.9, b=0.1)
    spec.plan(1)
    assert spec.limit(Sequence("s", [1, 2], GREEDY, 0), 10) == 3
    for _ in range(30):
        spec.observe_proposing(4, 1.0)  # 0.25 s a token against a 1 s step
    spec.plan(1)
    assert spec.limit(Sequence("t", [1, 2], GREEDY, 0), 10) == 1


def _tiled(rows: int) -> float:
    """A CPU step whose matrix kernel works in tiles of 8 rows: one row past a tile costs a whole tile."""
    return 0.010 + 0.008 * -(-rows // 8)


def test_the_step_cost_learns_a_row_count_that_costs_a_tile_and_trims_what_does_not_pay():
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4))
    seqs = [Sequence(f"s{i}", [1, 2], GREEDY, 0) for i in range(8)]
    proposals = [[7, 7, 7, 7] for _ in seqs]
    assert spec.trim(seqs, proposals) == proposals  # nothing trimmed before the step cost is known
    for rows in (8, 9, 16, 12, 8, 9, 10, 16, 8, 24, 9, 16, 8, 32, 40) * 3:
        spec.observe_step(rows, _tiled(rows))
    cost = spec.step_cost
    for rows in (8, 9, 16, 40):
        assert cost.seconds(rows) == pytest.approx(_tiled(rows), rel=0.05)
    for seq in seqs:  # an even chance that each stream's first token stands
        for _ in range(3):
            spec.record(seq, 4, 1)
    # One token: the ninth row costs a tile (8 ms) for half a token's worth (3.25 ms).
    lone = [[7, 7]] + [[] for _ in seqs[1:]]
    assert spec.trim(seqs, lone) == [[] for _ in seqs]
    # A tile of them pays (8 x 1/2 x 3.25 ms > 8 ms): every stream's first token fills the second tile;
    # the second tokens (a chance in four each) would not pay for a third.
    assert spec.trim(seqs, proposals) == [[7] for _ in seqs]
    for seq in seqs:  # likelier: more tiles pay
        for _ in range(3):
            spec.record(seq, 4, 4)
    assert all(len(g) >= 2 for g in spec.trim(seqs, proposals))
    # Batch 1: rows cost little next to the step, and the whole proposal pays.
    one = Speculator(SpeculativeConfig(num_speculative_tokens=4))
    for rows in (1, 2, 5, 3, 1, 4) * 4:
        one.observe_step(rows, 0.020 + 0.001 * rows)
    for _ in range(2):
        one.record(seqs[0], 4, 2)
    assert one.trim(seqs[:1], [[7, 7, 7, 7]]) == [[7, 7, 7, 7]]
    # Without the adaptive rule nothing is trimmed.
    fixed = Speculator(SpeculativeConfig(num_speculative_tokens=4, adaptive=False))
    for rows in (8, 9, 16) * 4:
        fixed.observe_step(rows, _tiled(rows))
    assert fixed.trim(seqs, lone) == lone


def test_the_draft_proposer_drafts_every_stream_at_once_for_its_own_limit():
    calls = []

    class Echo:  # guesses "position + 100"
        def next_tokens(self, seqs, token_ids, positions):
            calls.append((len(seqs), list(positions)))
            return [p + 100 for p in positions]

    a, b = Sequence("a", [1, 2, 3], GREEDY, 0), Sequence("b", [1], GREEDY, 0)
    got = DraftProposer(Echo()).propose([a, b, a], [3, 1, 0])
    assert got == [[102, 103, 104], [100], []]
    assert calls == [(2, [2, 0]), (1, [3]), (1, [4])]


def test_bad_options_name_the_field():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match="draft_layers must be fewer than the model's 2 layers"):
        SpeculativeConfig(method="draft", draft_layers=2).layers_of(2)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match=r"unknown speculative_config option\(s\) \['k'\]"):
        EngineConfig(speculative_config={"k": 3})
    with pytest.raises(ValueError, match="speculative must be a bool"):
        SamplingParams(speculative="no")  # type: ignore[arg-type]


# -- exact acceptance ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tiny_model_dir", "k"),
    [("llama", 2), ("qwen2", 4)],
    indirect=["tiny_model_dir"],
    ids=["llama-k2", "qwen2-k4"],
)
def test_greedy_output_equals_plain_decoding_and_transformers(tiny_model_dir, k):
    prompts = prompts_of([1, 5, 17, 33], seed=4)
    base = LLM(tiny_model_dir, dtype="float32", block_size=4)
    ref_outs, ref_logits = generate_with_logits(base, prompts, GREEDY)
    refs = {tuple(p): o.token_ids for p, o in zip(prompts, ref_outs, strict=True)}
    llm = speculating(tiny_model_dir, k, refs, block_size=4)
    outs, logits = spec_logits(llm, prompts, GREEDY)
    assert_same_tokens(prompts, outs, logits, ref_outs, ref_logits, tiny_model_dir)
    s = llm.engine.speculator.stats
    # every kind of verify ran: wholly accepted, partly, and wholly rejected proposals
    assert s.verify_steps > 0 and 0 < s.accepted_tokens < s.proposed_tokens
    assert s.mean_accepted_length > 1.5
    # fewer steps than tokens: each verify forward gave a stream more than one token on average
    assert llm.engine.num_steps < len(prompts) + N
    assert_no_leak(llm)


SAMPLED = [
    SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=N, ignore_eos=True),
    SamplingParams(
        temperature=0.8,
        top_k=40,
        seed=11,
        max_tokens=N,
        min_tokens=N // 2,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=-0.3,
    ),  # fmt: skip
    SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logit_bias={5: 3.0}, presence_penalty=-1),
]


@pytest.mark.parametrize("params", SAMPLED, ids=["seeded", "seeded-penalties-min-tokens", "greedy-bias"])
def test_seeded_and_penalised_output_equals_plain_decoding(tiny_llama_dir, params):
    """Each position of a verify forward samples with the noise, min_tokens mask and penalties its output
    index would have had alone (the proposals before it counted as outputs)."""
    prompts = prompts_of([3, 9, 21, 2], seed=5)
    opts = dict(block_size=4, num_blocks=48, max_num_seqs=8)
    base = LLM(tiny_llama_dir, dtype="float32", **opts)
    ref_outs, ref_logits = generate_with_logits(base, prompts, params)
    refs = {tuple(p): o.token_ids for p, o in zip(prompts, ref_outs, strict=True)}
    llm = speculating(tiny_llama_dir, 4, refs, **opts)
    outs, logits = spec_logits(llm, prompts, params)
    assert_same_tokens(prompts, outs, logits, ref_outs, ref_logits)
    assert llm.engine.speculator.stats.accepted_tokens > 0
    assert_no_leak(llm)


def test_stop_tokens_logprobs_and_a_tight_cache(tiny_llama_dir):
    """A stop token inside an accepted run ends the stream there (the tokens after it are never output);
    logprobs come for every token a verify forward gives; a cache too small for every stream's lookahead
    still gives the same tokens (a stream that cannot reserve its lookahead blocks proposes nothing)."""
    prompts = prompts_of([6, 14, 3], seed=6)
    base = LLM(tiny_llama_dir, dtype="float32", block_size=4, num_blocks=20)
    plain = base.generate(prompts, GREEDY)
    stop = plain[1].token_ids[N // 2]  # a stop token the second stream meets half-way
    params = dataclasses.replace(GREEDY, stop_token_ids=(stop,), logprobs=3)
    ref_outs = base.generate(prompts, params)
    refs = {tuple(p): o.token_ids for p, o in zip(prompts, plain, strict=True)}
    llm = speculating(tiny_llama_dir, 4, refs, block_size=4, num_blocks=20)
    outs = llm.generate(prompts, params)
    for o, r in zip(outs, ref_outs, strict=True):
        assert o.token_ids == r.token_ids and o.finish_reason == r.finish_reason
        assert len(o.logprobs) == len(o.token_ids)
        for a, b in zip(o.logprobs, r.logprobs, strict=True):
            assert a.token_id == b.token_id
            assert abs(a.logprob - b.logprob) <= 1e-4
            assert a.top_ids == b.top_ids or abs(a.top_logprobs[-1] - a.top_logprobs[-2]) < 1e-5
    assert outs[1].finish_reason == "stop" and len(outs[1].token_ids) <= N // 2 + 1
    assert llm.engine.speculator.stats.accepted_tokens > 0
    assert_no_leak(llm)


def test_prefix_caching_and_preemption_stay_exact_under_speculation(tiny_llama_dir):
    """Shared prefixes (blocks committed as verify forwards fill them) and a cache that preempts."""
    stem = prompts_of([13], seed=8)[0]
    prompts = [stem + t for t in prompts_of([2, 7, 1, 5], seed=9)] + [stem[:9]]
    opts = dict(block_size=4, num_blocks=40, max_num_batched_tokens=16)
    base = LLM(tiny_llama_dir, dtype="float32", **opts)
    ref_outs, ref_logits = generate_with_logits(base, prompts, GREEDY)
    refs = {tuple(p): o.token_ids for p, o in zip(prompts, ref_outs, strict=True)}
    llm = speculating(tiny_llama_dir, 4, refs, **opts)
    for _ in range(2):  # the second round reuses blocks the first committed
        outs, logits = spec_logits(llm, prompts, GREEDY)
        assert_same_tokens(prompts, outs, logits, ref_outs, ref_logits)
    assert llm.engine.stats().num_preemptions > 0
    assert any(o.num_cached_tokens > 0 for o in outs)
    assert_no_leak(llm)


def test_ngram_speculation_on_repetitive_text_is_exact_and_accepts(tiny_llama_dir):
    """The n-gram proposer itself, adaptive: a prompt made of the model's own greedy continuation of a
    stem, repeated, so that lookups find it; requests that turn speculation off never propose."""
    base = LLM(tiny_llama_dir, dtype="float32", block_size=4)
    stems = prompts_of([4, 6], seed=12)
    conts = base.generate(stems, dataclasses.replace(GREEDY, max_tokens=24))
    prompts = [s + c.token_ids + s for s, c in zip(stems, conts, strict=True)]
    ref_outs, ref_logits = generate_with_logits(base, prompts, GREEDY)
    llm = LLM(tiny_llama_dir, dtype="float32", block_size=4, speculative_config={"method": "ngram"})
    outs, logits = spec_logits(llm, prompts, GREEDY)
    assert_same_tokens(prompts, outs, logits, ref_outs, ref_logits)
    s = llm.engine.speculator.stats
    assert s.proposed_tokens > 0 and s.verify_steps > 0
    before = dataclasses.replace(s)
    off = llm.generate(prompts, dataclasses.replace(GREEDY, speculative=False))
    assert [o.token_ids for o in off] == [o.token_ids for o in ref_outs]
    assert llm.engine.speculator.stats == before
    assert_no_leak(llm)


def test_a_stream_moved_between_verify_steps_continues_exactly(tiny_llama_dir):
    """Suspend a speculating stream at a step boundary, copy its KV to another speculating engine, adopt it
    there: the rest is the undisturbed run's, and both engines end with every block free."""
    prompt = prompts_of([10], seed=13)[0]
    params = SamplingParams(temperature=0.9, seed=3, max_tokens=N, ignore_eos=True)
    base = LLM(tiny_llama_dir, dtype="float32", block_size=4)
    want = base.generate([prompt], params)[0].token_ids
    refs = {tuple(prompt): want, tuple(prompt + want[:9]): want[9:]}
    src = speculating(tiny_llama_dir, 4, refs, block_size=4).engine
    dst = speculating(tiny_llama_dir, 4, refs, block_size=4).engine
    src.add_request("s", prompt, params)
    got: list[int] = []
    while len(got) < 9:
        for d in src.step():
            got += d.new_token_ids
    outputs, kv_tokens = src.suspend("s")
    assert outputs == got == want[: len(got)]
    blocks, _ = src.pin("s")
    tokens = prompt + outputs
    dst.block_manager.allocate("s", kv_tokens)
    dst.runner.kv[:, dst.block_manager.block_table("s")] = src.runner.kv[:, blocks]
    src.abort("s")
    src.unpin("s")
    refs[tuple(tokens)] = want[len(got) :]
    dst.add_migrated_request("s", tokens, len(got), dataclasses.replace(params, max_tokens=N - len(got)))
    while dst.has_unfinished():
        for d in dst.step():
            got += d.new_token_ids
    assert got == want
    assert dst.speculator.stats.accepted_tokens > 0
    for e in (src, dst):
        assert_no_leak(e)


@pytest.mark.parametrize(
    ("tiny_model_dir", "k", "params"),
    [("llama", 2, GREEDY), ("qwen2", 4, SAMPLED[0]), ("llama", 4, SAMPLED[1])],
    indirect=["tiny_model_dir"],
    ids=["llama-k2-greedy", "qwen2-k4-seeded", "llama-k4-seeded-penalties"],
)
def test_the_self_speculative_draft_is_exact(tiny_model_dir, k, params):
    """The draft proposer (the target's first layer and its LM head, writing that layer's K/V into the
    target's cache ahead of the verify) changes no token."""
    prompts = prompts_of([2, 9, 25], seed=16)
    base = LLM(tiny_model_dir, dtype="float32", block_size=4)
    ref_outs, ref_logits = generate_with_logits(base, prompts, params)
    llm = LLM(
        tiny_model_dir,
        dtype="float32",
        block_size=4,
        speculative_config={"method": "draft", "num_speculative_tokens": k, "adaptive": False},
    )
    outs, logits = spec_logits(llm, prompts, params)
    greedy = params.temperature == 0
    assert_same_tokens(prompts, outs, logits, ref_outs, ref_logits, tiny_model_dir if greedy else None)
    s = llm.engine.speculator.stats
    assert s.verify_steps > 0 and s.proposed_tokens >= s.verify_steps
    assert_no_leak(llm)


@pytest.mark.slow  # seconds of work: make test runs it, test-fast does not
def test_unseeded_sampling_keeps_its_distribution(tiny_llama_dir):
    """Without a seed a verify forward draws other random numbers than plain steps, but each emitted
    token is the target's sample given the tokens before it (a proposal stands exactly when the target
    drew it). 1,000 draws of three tokens each way, the oracle proposing the greedy second token: the
    second and third tokens' distributions agree within sampling noise (fixed seeds: the test is
    deterministic). Accepting the proposal whatever was drawn would put the second token's distance
    near 0.7."""
    prompt = prompts_of([4], seed=14)[0]
    params = SamplingParams(temperature=0.2, max_tokens=3, ignore_eos=True)
    greedy = LLM(tiny_llama_dir, dtype="float32").generate(
        [prompt], dataclasses.replace(params, temperature=0)
    )
    base = LLM(tiny_llama_dir, dtype="float32", max_num_seqs=128, seed=1)
    spec = speculating(tiny_llama_dir, 2, {tuple(prompt): greedy[0].token_ids}, max_num_seqs=128, seed=2)
    draws = 1000
    a = [o.token_ids for o in base.generate([prompt] * draws, params, use_tqdm=False)]
    b = [o.token_ids for o in spec.generate([prompt] * draws, params, use_tqdm=False)]
    assert spec.engine.speculator.stats.accepted_tokens > draws // 8
    for pos in (1, 2):
        ca, cb = collections.Counter(x[pos] for x in a), collections.Counter(x[pos] for x in b)
        tv = 0.5 * sum(abs(ca[x] - cb[x]) for x in set(ca) | set(cb)) / draws
        assert tv < 0.08, (pos, tv, ca.most_common(5), cb.most_common(5))
    assert_no_leak(spec)


def test_speculation_runs_on_the_torch_backend_too(tiny_llama_dir):
    """The oracle backend (torch ops, SDPA over gathered blocks) verifies as the kernels do."""

    def run(engine: LLMEngine, prompts) -> list[list[int]]:
        got: dict = collections.defaultdict(list)
        for i, p in enumerate(prompts):
            engine.add_request(i, p, GREEDY)
        while engine.has_unfinished():
            for d in engine.step():
                got[d.request_id] += d.new_token_ids
        return [got[i] for i in range(len(prompts))]

    prompts = prompts_of([5, 11], seed=15)
    cfg = EngineConfig(dtype="float32")
    ref = run(LLMEngine(ModelRunner(tiny_llama_dir, backend="torch"), None, cfg), prompts)
    spec_cfg = dataclasses.replace(cfg, speculative_config=SpeculativeConfig(adaptive=False))
    engine = LLMEngine(ModelRunner(tiny_llama_dir, backend="torch"), None, spec_cfg)
    engine.speculator.proposer = OracleProposer(
        {tuple(p): r for p, r in zip(prompts, ref, strict=True)}, engine.vocab_size
    )
    got = run(engine, prompts)
    for g, r in zip(got, ref, strict=True):
        assert g[: N // 2] == r[: N // 2]
    assert engine.speculator.stats.accepted_tokens > 0
    assert_no_leak(engine)
