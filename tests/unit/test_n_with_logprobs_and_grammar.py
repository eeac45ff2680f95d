"""``n`` > 1 beside the other per-sequence state: each choice's own logprobs (the prompt's once), its own
penalty counts and its own grammar matcher, in a colocated engine, on a decode engine that adopts a
prefilled request's choices, and for moved choices; and the OpenAI front's shape of them."""

from __future__ import annotations

import json
import re

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.engine.model_runner import ModelRunner, PrefillItem
from pdserve.engine.params import choice_params
from pdserve.engine.structured import StructuredOutputsParams as SO
from pdserve.proto import generation_pb2 as g
from pdserve.router.openai.logprobs import ResponseOptions
from pdserve.router.openai.mapping import Collected, EventStream, Kind

LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def llm(tiny_served_model):
    llm = LLM(str(tiny_served_model), dtype="float32", num_blocks=96, block_size=4)
    yield llm
    engine = llm.engine
    assert not engine.has_unfinished() and not engine.constrained and not engine._logprobs
    assert engine.block_manager.num_free == engine.block_manager.num_blocks


def _separate(llm, prompt, params: SamplingParams):
    return llm.generate([prompt] * params.n, [choice_params(params, i) for i in range(params.n)])


def test_each_choice_has_its_own_logprobs_and_penalty_counts(llm):
    """n = 2 with logprobs = 2 and a penalty: each choice's entries are of its own tokens and equal those
    of a request of its own with the derived seed; the prompt's come once."""
    prompt = llm.tokenizer.encode("One two three four five", add_special_tokens=False)
    sp = SamplingParams(
        n=2,
        seed=7,
        temperature=1.0,
        max_tokens=8,
        ignore_eos=True,
        logprobs=2,
        prompt_logprobs=1,
        presence_penalty=1.5,
        frequency_penalty=0.5,
    )
    out = llm.generate([prompt], sp)[0]
    alone = _separate(llm, prompt, sp)
    assert len(out.outputs) == 2 and out.outputs[0].token_ids != out.outputs[1].token_ids
    for choice, ref in zip(out.outputs, alone, strict=True):
        assert choice.token_ids == ref.token_ids  # (penalties count each choice's own tokens)
        assert [e.token_id for e in choice.logprobs] == choice.token_ids
        assert all(len(e.top_ids) == 2 for e in choice.logprobs)
        for a, b in zip(choice.logprobs, ref.logprobs, strict=True):
            assert abs(a.logprob - b.logprob) < LOGPROB_TOL
    assert out.logprobs == out.outputs[0].logprobs
    assert [e and e.token_id for e in out.prompt_logprobs][1:] == prompt[1:]


def test_the_prompt_logprobs_come_once_on_choice_0s_first_delta(llm):
    eng = llm.engine
    prompt = llm.tokenizer.encode("Hello there", add_special_tokens=False)
    eng.add_request("p", prompt, SamplingParams(n=3, max_tokens=2, logprobs=0, prompt_logprobs=0))
    deltas = []
    while eng.has_unfinished():
        deltas += eng.step()
    with_prompt = [d for d in deltas if d.prompt_logprobs is not None]
    assert [(d.choice_index, d.num_output_tokens) for d in with_prompt] == [(0, 1)]
    assert all(d.logprobs is not None and d.logprobs[0].token_id == d.new_token_ids[0] for d in deltas)


def test_each_forked_choice_follows_its_own_grammar_state(llm):
    """A constrained n = 3 request: every choice matches the grammar, and equals a constrained request of
    its own with the derived seed (its matcher a copy of the prompt's, taken before token 0)."""
    spec = SO(regex="(cat|dog|bird)-[0-9]{2}")
    sp = SamplingParams(n=3, seed=3, temperature=1.0, max_tokens=16, structured_outputs=spec, logprobs=1)
    prompt = llm.tokenizer.encode("A pet and a number:", add_special_tokens=False)
    out = llm.generate([prompt], sp)[0]
    alone = _separate(llm, prompt, sp)
    for choice, ref in zip(out.outputs, alone, strict=True):
        assert re.fullmatch("(cat|dog|bird)-[0-9]{2}", choice.text) and choice.finish_reason == "stop"
        assert choice.token_ids == ref.token_ids
        assert [e.token_id for e in choice.logprobs] == choice.token_ids


def test_adopted_and_moved_choices_continue_under_their_grammar(tiny_served_model, llm):
    """PD: a decode engine adopts a prefilled n = 2 request with each choice's first token (as the prefill
    worker sampled them); each choice's fresh matcher takes its token and the output is the colocated
    one. Moved choices replay their tokens into their matchers the same way."""
    spec = SO(regex="(yes|no|maybe) [a-z]{3}")
    sp = SamplingParams(n=2, seed=5, temperature=1.0, max_tokens=16, structured_outputs=spec, logprobs=1)
    prompt = llm.tokenizer.encode("Answer:", add_special_tokens=False)
    want = [o.token_ids for o in llm.generate([prompt], sp)[0].outputs]
    decode = LLMEngine(
        tiny_served_model, llm.tokenizer, EngineConfig(block_size=4, num_blocks=32, dtype="float32")
    )
    table = decode.block_manager.allocate("r", len(prompt))
    B = decode.runner.block_size
    pos = torch.arange(len(prompt))
    blocks, offs = torch.tensor(table)[pos // B], pos % B

    def push(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        decode.runner.kv[layer, blocks, 0, offs] = k
        decode.runner.kv[layer, blocks, 1, offs] = v

    ModelRunner(tiny_served_model, block_size=4, num_blocks=8).prefill(
        [PrefillItem(prompt, [0, 1, 2, 3])], layer_hook=push
    )
    got: dict[int, list[int]] = {0: [], 1: []}
    deltas = decode.add_prefilled_choices("r", prompt, [w[0] for w in want], sp)
    while decode.has_unfinished():
        deltas += decode.step()
    for d in deltas:
        got[d.choice_index] += d.new_token_ids
        # An adopted token 0's logprobs are the prefill worker's; every later token has its own here.
        assert (
            d.logprobs is None if d.num_output_tokens == 1 else d.logprobs[0].token_id == d.new_token_ids[0]
        )
    assert [got[0], got[1]] == want
    decode.add_resumed_choices("m", prompt, sp, [(1, want[1][:3])])
    moved = list(want[1][:3])
    while decode.has_unfinished():
        for d in decode.step():
            moved += d.new_token_ids
    assert moved == want[1]
    assert decode.block_manager.num_free == decode.block_manager.num_blocks and not decode.constrained


# -- the OpenAI front ---------------------------------------------------------------------------------------
def _entry(token: int, logprob: float | None = -1.0) -> g.TokenLogprobs:
    e = g.TokenLogprobs(token_id=token, top_token_ids=[token], top_logprobs=[-1.0])
    if logprob is not None:
        e.logprob = logprob
    return e


def _messages() -> list[g.GenerateResponse]:
    """n = 2 with echo and logprobs: the prompt's logprobs on the first message only (choice 1's)."""
    usage = g.Usage(prompt_tokens=2, completion_tokens=3)
    return [
        g.GenerateResponse(
            index=1,
            token_ids=[7],
            text="h",
            logprobs=[_entry(7)],
            prompt_logprobs=[_entry(1, None), _entry(2)],
        ),
        g.GenerateResponse(index=0, token_ids=[5], text="a", logprobs=[_entry(5)], finish_reason="length"),
        g.GenerateResponse(
            index=1, token_ids=[8], text="i", logprobs=[_entry(8)], finish_reason="length", usage=usage
        ),
    ]


def test_with_echo_every_completion_choice_starts_with_the_prompt_and_its_logprobs():
    opts = ResponseOptions(echo="PQ", logprobs=1, token_text=lambda t: chr(ord("a") + t))
    body = Collected(Kind.COMPLETION, "cmpl-1", 0, "m", opts)
    for m in _messages():
        body.feed(m)
    doc = json.loads(body.response())
    texts = [c["text"] for c in doc["choices"]]
    assert [c["index"] for c in doc["choices"]] == [0, 1] and texts == ["PQa", "PQhi"]
    tokens = [c["logprobs"]["tokens"] for c in doc["choices"]]
    assert tokens == [["b", "c", "f"], ["b", "c", "h", "i"]]  # the prompt's two first, then the choice's
    assert doc["usage"]["completion_tokens"] == 3
    stream = EventStream(Kind.COMPLETION, "cmpl-1", 0, "m", False, opts)
    chunks = [
        json.loads(line[6:]) for m in _messages() for line in stream.feed(m).decode().split("\n\n") if line
    ]
    firsts = {}
    for ch in chunks:
        (c,) = ch["choices"]
        firsts.setdefault(c["index"], c)
    assert firsts[0]["text"] == "PQa" and firsts[1]["text"] == "PQh"
    assert firsts[0]["logprobs"]["tokens"] == ["b", "c", "f"]
    assert firsts[1]["logprobs"]["tokens"] == ["b", "c", "h"]
