"""Structured output in the engine: the constraint's validation (errors name the field), the compile
cache, matcher replay, the sampler's masks (constrained rows only), a grammar that forbids the greedy token
changing it, eos only where the grammar ends, and the decode worker's hand-off after a masked token 0."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.grammar import (
    GrammarCompiler,
    MaskFiller,
    TokenMask,
    allowed_tokens,
    allowed_tokens_by_shifts,
)
from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.engine.model_runner import ModelRunner, PrefillItem
from pdserve.engine.params import validate_params_for_model
from pdserve.engine.sampler import Sampler, SampleRow
from pdserve.engine.structured import MAX_STRUCTURED_OUTPUT_BYTES
from pdserve.engine.structured import StructuredOutputsParams as SO
from pdserve.engine.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["name", "kind", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_served_model):
    llm = LLM(str(tiny_served_model), dtype="float32", num_blocks=64, block_size=16)
    yield llm
    engine = llm.engine
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
    assert not engine.constrained  # every matcher dropped with its sequence


@pytest.fixture(scope="module")
def compiler(llm) -> GrammarCompiler:
    return llm.engine.constrained.compiler


# -- validation --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({}, "exactly one of"),
        ({"json": "{}", "regex": "a"}, "exactly one of"),
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
        ({"json": "[1]"}, "structured_outputs.json must be a JSON schema"),
        ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
        ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
        ({"choice": "ab"}, "structured_outputs.choice must be a list of strings"),
        ({"json_object": False}, "exactly one of"),
        ({"regex": "a" * (MAX_STRUCTURED_OUTPUT_BYTES + 1)}, "structured_outputs.regex has 65,537 bytes"),
    ],
)
def test_a_malformed_constraint_is_a_value_error_naming_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        SO(**kw)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"json": {"type": "foo"}}, "structured_outputs.json"),
        ({"json": {"$ref": "#/$defs/missing"}}, "structured_outputs.json"),
        ({"regex": "(("}, "structured_outputs.regex"),
        ({"grammar": "root ::= (("}, "structured_outputs.grammar"),
    ],
)
def test_a_constraint_the_library_cannot_compile_is_a_value_error_naming_the_field(kw, field, compiler):
    params = SamplingParams(structured_outputs=SO(**kw))  # well-formed ...
    with pytest.raises(ValueError, match=f"^{field} does not compile"):  # ... but it does not compile
        validate_params_for_model(params, vocab_size=10, can_detokenize=True)
    with pytest.raises(ValueError, match=f"^{field} does not compile"):
        compiler.compile(params.structured_outputs)


def test_a_model_without_a_tokenizer_refuses_a_constraint():
    with pytest.raises(ValueError, match="structured_outputs needs the model's tokenizer"):
        GrammarCompiler(None, 100, ()).compile(SO(regex="a"))


# -- compile cache, matchers ----------------------------------------------------------------------------
def test_each_distinct_constraint_compiles_once(compiler):
    before = compiler.num_compiled
    a = compiler.compile(SO(json=SCHEMA))
    assert compiler.compile(SO(json=json.dumps(SCHEMA, separators=(",", ":")))) is a  # the same schema
    assert compiler.compile(SO(json=dict(SCHEMA))) is a
    assert compiler.num_compiled == before + 1
    compiler.compile(SO(regex="[0-9]+"))
    compiler.compile(SO(regex="[0-9]+"))
    assert compiler.num_compiled == before + 2


def test_a_replayed_matcher_is_where_the_one_that_took_the_tokens_is(compiler, llm):
    tok: Tokenizer = llm.tokenizer
    spec = SO(json=SCHEMA)
    text = '{"name":"Rex","kind":"dog","tags":["a","bc"]}'
    ids = tok.encode(text, add_special_tokens=False)
    stepped = compiler.matcher(spec)
    for n, t in enumerate(ids):
        assert stepped.accept(t)
        assert compiler.matcher(spec, ids[: n + 1]).state() == stepped.state()
    ended, accepting, stopped, _ = stepped.state()
    assert (ended, accepting, stopped) == (False, True, True)  # complete: only eos is left
    mask = allowed_tokens(torch.frombuffer(bytearray(stepped.state()[3]), dtype=torch.int32)[None], 10**6)
    assert mask.nonzero()[:, 1].tolist() == sorted(compiler.eos_token_ids)
    assert stepped.accept(sorted(compiler.eos_token_ids)[0]) and stepped.ended
    with pytest.raises(ValueError, match="structured_outputs.json: the output so far does not match"):
        compiler.matcher(spec, tok.encode('{"nom"', add_special_tokens=False))


# -- the sampler ---------------------------------------------------------------------------------------------
def test_masks_apply_to_their_rows_alone_and_greedy_rows_stay_argmax(compiler):
    V = compiler.vocab_size
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    m = compiler.matcher(SO(regex="[0-9]{2}"))
    filler = MaskFiller(compiler.bitmask_words)
    try:
        mask = filler.start([1], [m]).result()
    finally:
        filler.close()
    allowed = allowed_tokens(mask.bitmask, V)[0]
    greedy = SamplingParams(temperature=0)
    rows = [SampleRow(greedy, 0), SampleRow(greedy, 0), SampleRow(SamplingParams(seed=3), 0)]
    copy = logits.clone()
    out = Sampler()(logits, rows, mask)
    assert torch.equal(logits, copy)  # the caller's logits are untouched
    assert out[0] == int(logits[0].argmax()) and out[2] == Sampler()(logits, rows)[2]  # unconstrained rows
    assert allowed[out[1]] and out[1] == int(logits[1].masked_fill(~allowed, -torch.inf).argmax())
    assert not allowed[int(logits[1].argmax())]  # (the mask did change the greedy token)
    # Seeded and unseeded draws never leave the mask.
    for seed in (None, 1, 2, 3):
        row = [SampleRow(SamplingParams(seed=seed), 0)]
        for _ in range(5):
            assert allowed[Sampler(seed=seed or 0)(logits[1:2], row, TokenMask([0], mask.bitmask))[0]]


def test_the_bitmask_unpacks_to_the_same_tokens_with_numpy_and_with_torch_shifts():
    words = torch.randint(
        -(2**31), 2**31 - 1, (3, 5), dtype=torch.int32, generator=torch.Generator().manual_seed(1)
    )
    want = [[bool(int(words[r, t // 32]) >> (t % 32) & 1) for t in range(150)] for r in range(3)]
    assert allowed_tokens(words, 150).tolist() == want  # (CPU: numpy)
    assert allowed_tokens_by_shifts(words, 150).tolist() == want  # (what a GPU runs)


# -- the engine ----------------------------------------------------------------------------------------------
def test_a_grammar_that_forbids_the_greedy_token_at_step_one_changes_it(llm):
    tok = llm.tokenizer
    free = llm.generate(["Say a number:"], SamplingParams(temperature=0, max_tokens=4))[0]
    greedy_first = free.token_ids[0]
    assert not tok.decode([greedy_first]).strip().isdigit()  # (the random model's favourite is no digit)
    out = llm.generate(
        ["Say a number:"],
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=SO(regex="[0-9]{3}")),
    )[0]
    assert out.token_ids[0] != greedy_first
    assert out.text.isdigit() and len(out.text) == 3 and out.finish_reason == "stop"
    assert out.token_ids[-1] in llm.engine.eos_token_ids  # ended by eos, the one token left


def test_constrained_and_free_requests_share_a_batch(llm):
    prompts = ["a", "b", "c", "d"]
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(prompts[:1], free)[0]
    params = [
        free,
        SamplingParams(temperature=1.0, seed=7, max_tokens=64, structured_outputs=SO(json=SCHEMA)),
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=SO(choice=["yes", "no"])),
        SamplingParams(temperature=0.8, seed=1, max_tokens=16, structured_outputs=SO(json_object=True)),
    ]
    outs = llm.generate(prompts, params)
    assert outs[0].token_ids == alone.token_ids  # an unconstrained row is untouched by its neighbours
    doc = json.loads(outs[1].text)
    assert set(doc) == {"name", "kind", "tags"} and doc["kind"] in ("cat", "dog")
    assert outs[1].finish_reason == "stop" and outs[2].text in ("yes", "no")
    assert outs[3].finish_reason == "length" or isinstance(json.loads(outs[3].text), dict)


def test_the_grammar_ends_the_output_whatever_ignore_eos_and_min_tokens_say(llm):
    for extra in ({"ignore_eos": True}, {"min_tokens": 6}):
        p = SamplingParams(temperature=0, max_tokens=30, structured_outputs=SO(choice=["yes", "no"]), **extra)
        out = llm.generate(["?"], p)[0]
        assert out.text in ("yes", "no") and out.finish_reason == "stop"


def test_a_migrated_stream_replays_its_outputs_into_its_matcher(llm):
    """Migration (and preemption's recompute) carry on where the grammar is: the outputs so far,
    now the prompt's tail, are replayed into a fresh matcher."""
    tok = llm.tokenizer
    spec = SO(json=SCHEMA)
    prompt = tok.encode("Pet:", add_special_tokens=False)
    whole = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=64, structured_outputs=spec))[0]
    cut = 5
    engine = llm.engine
    sent = whole.token_ids[:cut]
    p = SamplingParams(temperature=0, max_tokens=64 - cut, structured_outputs=spec)
    engine.add_request("moved", prompt + sent, p, output_offset=cut)
    got: list[int] = []
    while engine.has_unfinished():
        for d in engine.step():
            got += d.new_token_ids
    assert sent + got == whole.token_ids


def test_the_decode_worker_continues_after_a_prefill_workers_masked_first_token(tiny_served_model, llm):
    """PD: the prefill side samples token 0 under the grammar's mask; the decode engine's matcher takes
    it on adoption and the output is the colocated engine's."""
    spec = SO(json=SCHEMA)
    params = SamplingParams(temperature=0, max_tokens=64, structured_outputs=spec)
    prompt = llm.tokenizer.encode("A pet as JSON:", add_special_tokens=False)
    expect = llm.generate([prompt], params)[0]
    decode = LLMEngine(
        tiny_served_model, llm.tokenizer, EngineConfig(block_size=16, num_blocks=32, dtype="float32")
    )
    prefill = ModelRunner(tiny_served_model, block_size=16, num_blocks=8)
    table = decode.block_manager.allocate("r", len(prompt))
    B = decode.runner.block_size
    pos = torch.arange(len(prompt))
    blocks, offs = torch.tensor(table)[pos // B], pos % B

    def push(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        decode.runner.kv[layer, blocks, 0, offs] = k
        decode.runner.kv[layer, blocks, 1, offs] = v

    logits = prefill.prefill([PrefillItem(prompt, [0])], layer_hook=push)
    compiler = GrammarCompiler(llm.tokenizer, decode.vocab_size, decode.eos_token_ids)
    filler = MaskFiller(compiler.bitmask_words)
    try:
        mask = filler.start([0], [compiler.matcher(spec)]).result()
    finally:
        filler.close()
    first = Sampler(decode.eos_token_ids)(logits, [SampleRow(params, 0)], mask)[0]
    got = list(decode.add_prefilled_request("r", prompt, first, params).new_token_ids)
    while decode.has_unfinished():
        for d in decode.step():
            got += d.new_token_ids
    assert got == expect.token_ids
    assert decode.block_manager.num_free == decode.block_manager.num_blocks and not decode.constrained
