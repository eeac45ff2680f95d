"""Migrating a stream off a failed worker: the engine continues a request from an output offset.

The router re-submits a request whose worker died with the prompt plus every token already sent, what is
left of max_tokens / min_tokens, and ``output_offset`` = tokens sent. Greedy and seeded sampling then give
exactly the tokens an undisturbed run gives (seeded noise depends on (seed, output index) only).
"""

from __future__ import annotations

import pytest

from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.engine.params import SamplingParams

PROMPT = [5, 9, 33, 7, 100, 41]
N = 12


def _run(engine: LLMEngine, rid, prompt, params, offset=0):
    engine.add_request(rid, prompt, params, output_offset=offset)
    toks, counts = [], []
    while engine.has_unfinished():
        for d in engine.step():
            toks.extend(d.new_token_ids)
            counts.append(d.num_output_tokens)
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
    return toks, counts


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=N, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=7, max_tokens=N, min_tokens=N, ignore_eos=False),
    ],
    ids=["greedy", "seeded", "seeded-min-tokens"],
)
@pytest.mark.parametrize("k", [1, 5, N - 1])
def test_continuing_from_an_offset_gives_the_undisturbed_tokens(tiny_llama_dir, params, k):
    eng = LLMEngine(tiny_llama_dir, None, EngineConfig(dtype="float32", num_blocks=64))
    want, counts = _run(eng, "a", PROMPT, params)
    assert len(want) == N and counts == list(range(1, N + 1))
    rest = SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        seed=params.seed,
        max_tokens=N - k,
        min_tokens=max(0, params.min_tokens - k),
        ignore_eos=params.ignore_eos,
    )
    got, counts = _run(eng, "b", PROMPT + want[:k], rest, offset=k)
    assert got == want[k:]
    assert counts == list(range(k + 1, N + 1))  # counts continue: the stream's output indices


def test_offset_past_the_prompt_is_refused(tiny_llama_dir):
    eng = LLMEngine(tiny_llama_dir, None, EngineConfig(dtype="float32", num_blocks=16))
    with pytest.raises(ValueError, match="output_offset"):
        eng.add_request("x", [1, 2], SamplingParams(), output_offset=3)
    assert not eng.has_unfinished()
