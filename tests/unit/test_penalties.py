"""Penalties and logit_bias: the sampler's adjusted logits equal transformers' logits processors (and
OpenAI's presence/frequency formula) in a batch mixing settings, rows without them are untouched, and the
engine's greedy output with them equals transformers' ``generate`` with the same processors."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from pdserve.engine import LLM
from pdserve.engine.params import SamplingParams
from pdserve.engine.penalties import adjust_logits, token_counts
from pdserve.engine.sampler import Sampler, SampleRow
from tests.tiny_models import load_reference

V = 300
TOL = 1e-5


def presence_frequency_reference(logits: torch.Tensor, outputs: list[int], presence: float, frequency: float):
    """OpenAI's (and vLLM's) definition, token by token: ``logit - frequency * c - presence * (c > 0)``."""
    out = logits.clone()
    for t, c in collections.Counter(outputs).items():
        out[t] -= frequency * c + presence
    return out


def reference(logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
    """One row's adjusted logits through transformers' processors, in vLLM's order (bias, repetition, then
    presence and frequency); ``output_offset`` tokens of the prompt's tail are outputs."""
    p = row.params
    cut = len(row.prompt_token_ids) - row.output_offset
    outputs = list(row.prompt_token_ids[cut:]) + list(row.output_token_ids)
    ids = torch.tensor([list(row.prompt_token_ids) + list(row.output_token_ids)])  # [1, L]
    scores = logits.clone().unsqueeze(0)  # [1, V]
    if p.logit_bias:
        bias = SequenceBiasLogitsProcessor(sequence_bias=[[[t], v] for t, v in p.logit_bias])
        scores = bias(ids, scores)
    if p.repetition_penalty != 1:
        scores = RepetitionPenaltyLogitsProcessor(penalty=p.repetition_penalty)(ids, scores)
    return presence_frequency_reference(scores[0], outputs, p.presence_penalty, p.frequency_penalty)


def random_ids(g: torch.Generator, n: int) -> list[int]:
    # Few distinct ids, so tokens repeat and counts above 1 occur.
    return torch.randint(0, 40, (n,), generator=g).tolist()


def mixed_rows(g: torch.Generator) -> list[SampleRow]:
    P = SamplingParams
    settings = [
        P(temperature=0),  # none: greedy
        P(temperature=0, repetition_penalty=1.3),
        P(seed=4, repetition_penalty=0.7),
        P(presence_penalty=0.5, frequency_penalty=0.3),
        P(temperature=0),  # none
        P(
            presence_penalty=-1.0,
            frequency_penalty=-2.0,
            repetition_penalty=1.2,
            logit_bias={3: 5.0, 299: -7.5},
        ),
        P(temperature=0.8, top_k=5, logit_bias={0: -100, 17: 100, 250: 0.25}),
        P(seed=1),  # none: seeded
        P(frequency_penalty=2.0, presence_penalty=2.0),  # a migrated stream (offset below)
    ]
    rows = []
    for i, p in enumerate(settings):
        prompt = random_ids(g, 12)
        outputs = random_ids(g, 2 * i)
        rows.append(SampleRow(p, len(outputs), 5 if i == 8 else 0, prompt, outputs))
    return rows


def test_adjusted_logits_match_transformers_processors_in_a_mixed_batch():
    g = torch.Generator().manual_seed(0)
    rows = mixed_rows(g)
    logits = torch.randn(len(rows), V, generator=g) * 4  # [n, V], both signs
    before = logits.clone()
    which = [i for i, r in enumerate(rows) if r.params.adjusts_logits]
    assert which == [1, 2, 3, 5, 6, 8]
    out = adjust_logits(logits, rows, which)
    assert torch.equal(logits, before)  # the caller's logits are untouched
    for i, r in enumerate(rows):
        if i in which:
            want = reference(before[i], r)
            assert not torch.equal(out[i], before[i])
            torch.testing.assert_close(out[i], want, atol=TOL, rtol=0)
        else:
            assert torch.equal(out[i], before[i])  # bit for bit


def test_a_row_alone_and_in_the_batch_is_adjusted_alike():
    g = torch.Generator().manual_seed(1)
    rows = mixed_rows(g)
    logits = torch.randn(len(rows), V, generator=g)
    together = adjust_logits(logits, rows, [1, 3, 5, 8])
    for i in (1, 3, 5, 8):
        alone = adjust_logits(logits[i : i + 1], [rows[i]], [0])
        assert torch.equal(together[i], alone[0])


def test_token_counts_are_a_scatter_of_each_rows_ids():
    counts = token_counts([[1, 1, 4], [], [0, 4, 4, 4]], 6, torch.float32, torch.device("cpu"))
    assert counts.tolist() == [[0, 2, 0, 0, 1, 0], [0] * 6, [1, 0, 0, 0, 3, 0]]


def test_the_sampler_applies_them_and_leaves_other_rows_as_before():
    g = torch.Generator().manual_seed(2)
    rows = mixed_rows(g)
    logits = torch.randn(len(rows), V, generator=g) * 4
    plain = [
        r._replace(
            params=dataclasses.replace(
                r.params, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias=()
            )
        )
        for r in rows
    ]
    got = Sampler([2], seed=3)(logits, rows)
    before = Sampler([2], seed=3)(logits, plain)
    for i in (0, 4, 7):  # rows without options: the tokens they get without any adjusting row in the batch
        assert got[i] == before[i]
    assert got[0] == int(logits[0].argmax()) and got[4] == int(logits[4].argmax())
    # The greedy penalised row: the argmax of the reference's adjusted logits.
    assert got[1] == int(reference(logits[1], rows[1]).argmax())
    # logit_bias +100 on token 17 wins any top-k draw; -100 on 0 is never drawn.
    assert got[6] == 17


def test_a_strong_negative_bias_on_the_greedy_token_changes_it():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(5))
    top = int(logits[1].argmax())
    rows = [
        SampleRow(SamplingParams(temperature=0), 0),
        SampleRow(SamplingParams(temperature=0, logit_bias={top: -100}), 0),
        SampleRow(SamplingParams(temperature=0), 0),
    ]
    out = Sampler()(logits, rows)
    assert out[1] != top and out[1] == int(logits[1].topk(2).indices[1])
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())


def test_min_tokens_masking_holds_under_a_positive_bias():
    logits = torch.zeros(1, V)
    p = SamplingParams(temperature=0, min_tokens=2, logit_bias={2: 100}, repetition_penalty=2.0)
    assert Sampler([2])(logits, [SampleRow(p, 0, 0, [2, 2], [])])[0] != 2  # eos stays masked
    assert Sampler([2])(logits, [SampleRow(p, 2, 0, [2], [5, 6])])[0] == 2


class _PresenceFrequency(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the generated tokens, for ``generate``."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        out = scores.clone()
        for b in range(len(scores)):
            outputs = input_ids[b, self.prompt_len :].tolist()
            out[b] = presence_frequency_reference(scores[b], outputs, self.presence, self.frequency)
        return out


def test_engine_greedy_output_with_penalties_equals_transformers_generate(tiny_llama_dir):
    """End to end through the engine (prefill, then decode steps reading each sequence's tokens), requests
    with different settings and one without any in one batch. Random tiny weights keep the top-2 logits
    far apart, so the streams compare whole."""
    n = 24
    settings = [
        SamplingParams(repetition_penalty=1.8, logit_bias={7: 3.0, 100: -2.0}),
        SamplingParams(repetition_penalty=0.8, presence_penalty=1.5, frequency_penalty=0.7),
    ]
    settings = [dataclasses.replace(p, temperature=0, max_tokens=n, ignore_eos=True) for p in settings]
    plain = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    prompts = [[5, 9, 33, 7, 9, 41, 5], [100, 3, 3, 3]]
    cases = [(prompt, p) for p in settings for prompt in prompts] + [(prompts[0], plain)]
    llm = LLM(tiny_llama_dir, dtype="float32")
    outs = llm.generate([c[0] for c in cases], [c[1] for c in cases])
    ref = load_reference(tiny_llama_dir)
    for (prompt, params), out in zip(cases, outs, strict=True):
        procs = LogitsProcessorList(
            [_PresenceFrequency(len(prompt), params.presence_penalty, params.frequency_penalty)]
        )
        kw = {"sequence_bias": [[[t], v] for t, v in params.logit_bias]} if params.logit_bias else {}
        with torch.inference_mode():
            want = ref.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=n,
                eos_token_id=[],
                repetition_penalty=params.repetition_penalty,
                logits_processor=procs,
                **kw,
            )[0, len(prompt) :].tolist()
        assert out.token_ids == want, params
    assert outs[0].token_ids != outs[-1].token_ids != outs[2].token_ids  # the penalties changed the stream
    engine = llm.engine
    assert engine.block_manager.num_free == engine.block_manager.num_blocks


@pytest.mark.gpu
def test_adjusted_logits_on_cuda_match_the_cpus():
    g = torch.Generator().manual_seed(6)
    rows = mixed_rows(g)
    logits = torch.randn(len(rows), V, generator=g) * 4
    which = [i for i, r in enumerate(rows) if r.params.adjusts_logits]
    on_cuda = adjust_logits(logits.cuda(), rows, which).cpu()
    torch.testing.assert_close(on_cuda, adjust_logits(logits, rows, which), atol=TOL, rtol=0)
    assert Sampler([2], device="cuda")(logits.cuda(), rows)[1] == Sampler([2])(logits, rows)[1]  # greedy row
