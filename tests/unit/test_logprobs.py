"""Generated-token and prompt logprobs of the engine against transformers' log-softmax of the same tiny
model (float32, within 1e-4): alone and batched with requests that do not ask, through chunked prefill,
mixed steps and prefix caching (a prompt that asks is computed whole), on the prefill worker's
``prefill_keeping`` path as on the engine's; and requests that do not ask cost nothing."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.logprobs import TokenLogprob, prompt_targets, token_logprobs
from pdserve.engine.model_runner import ModelRunner, PrefillItem
from tests.tiny_models import load_reference

TOL = 1e-4
TOP = 5


@functools.cache
def _reference(model_dir):
    return load_reference(model_dir)


def ref_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    """transformers' ``[len(ids), V]`` log-softmax of the logits at every position of ``ids``."""
    ref = _reference(model_dir)
    with torch.inference_mode():
        return ref(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def assert_entry(entry: TokenLogprob, ref_row: torch.Tensor, token: int, top: int) -> None:
    assert entry.token_id == token
    assert abs(entry.logprob - ref_row[token].item()) < TOL
    assert len(entry.top_ids) == len(entry.top_logprobs) == top
    want_vals, want_ids = ref_row.topk(top)
    assert all(abs(a - b) < TOL for a, b in zip(entry.top_logprobs, want_vals.tolist(), strict=True))
    # Ids agree wherever the reference's neighbours are not within the tolerance (a tie may swap them).
    for i, (got, want) in enumerate(zip(entry.top_ids, want_ids.tolist(), strict=True)):
        if got != want:
            assert abs(ref_row[got].item() - ref_row[want].item()) < TOL, i


def prompts_of(lengths, seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def check_output(model_dir, prompt: list[int], out, top: int, prompt_top: int | None) -> None:
    ids = prompt + out.token_ids
    ref = ref_logprobs(model_dir, ids)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for i, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert_entry(entry, ref[len(prompt) + i - 1], tok, top)
    if prompt_top is None:
        assert out.prompt_logprobs is None
        return
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    for p, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert entry is not None
        assert_entry(entry, ref[p - 1], prompt[p], prompt_top)


@pytest.mark.parametrize("mixed", [False, True], ids=["split-steps", "mixed-steps"])
def test_logprobs_equal_transformers_through_chunks_cache_and_batches(tiny_llama_dir, mixed):
    # A budget of 16 tokens chunks the 40-token prompts; the shared 32-token prefix is cached by the first
    # request, and the second, which asks for prompt logprobs, computes its prompt whole all the same.
    llm = LLM(tiny_llama_dir, dtype="float32", max_num_batched_tokens=16, block_size=8, mixed_steps=mixed)
    shared, tails = prompts_of([32]), prompts_of([8, 8, 5], seed=1)
    plain, asks, short = shared[0] + tails[0], shared[0] + tails[1], tails[2]
    llm.generate([plain], SamplingParams(temperature=0, max_tokens=2))  # caches the shared prefix
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    both = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=TOP, prompt_logprobs=3)
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=6, ignore_eos=True, logprobs=0)
    outs = llm.generate([plain, asks, short], [greedy, both, sampled])
    assert outs[0].logprobs is None and outs[0].prompt_logprobs is None
    assert outs[0].num_cached_tokens == 32 and outs[1].num_cached_tokens == 0
    check_output(tiny_llama_dir, asks, outs[1], TOP, 3)
    check_output(tiny_llama_dir, short, outs[2], 0, None)
    # Asking changes no token: the same requests without logprobs sample the same.
    again = llm.generate([asks, short], [greedy, SamplingParams(temperature=0.8, seed=7, max_tokens=6)])
    assert [o.token_ids for o in again] == [outs[1].token_ids, outs[2].token_ids]
    engine = llm.engine
    assert not engine._logprobs.ids and not engine._logprobs.prompt
    assert engine.block_manager.num_free == engine.block_manager.num_blocks


def test_requests_that_do_not_ask_never_take_the_logprobs_path(tiny_llama_dir, monkeypatch):
    llm = LLM(tiny_llama_dir, dtype="float32")
    for name in ("prefill_keeping", "step_keeping"):
        monkeypatch.setattr(llm.engine.runner, name, None)  # would fail if called
    monkeypatch.setattr(llm.engine, "_logprob_step", None)
    out = llm.generate(prompts_of([9]), SamplingParams(temperature=0, max_tokens=3))[0]
    assert len(out.token_ids) == 3 and out.logprobs is None and out.prompt_logprobs is None


def test_prefill_keeping_gives_prefill_logits_and_every_kept_row(tiny_llama_dir):
    """The prefill worker's path: the same last-token logits as ``prefill``, and the kept item's rows."""
    runner = ModelRunner(tiny_llama_dir, num_blocks=16, block_size=8)
    a, b = prompts_of([7, 12], seed=3)
    items = [PrefillItem(a, [0]), PrefillItem(b, [1, 2])]
    want = runner.prefill(items)
    got, kept = runner.prefill_keeping(items, [False, True])
    assert torch.equal(got, want) and kept.num_rows == len(b)
    entries = token_logprobs(kept.logits, prompt_targets(b, 0, len(b)), [2] * (len(b) - 1))
    ref = ref_logprobs(tiny_llama_dir, b)
    for p, entry in enumerate(entries, start=1):
        assert_entry(entry, ref[p - 1], b[p], 2)


def test_logprob_bounds_name_the_field():
    for name in ("logprobs", "prompt_logprobs"):
        for bad in (-1, 21, 1.5, True):
            with pytest.raises(ValueError, match=rf"^{name} must be None or an integer in \[0, 20\]"):
                SamplingParams(**{name: bad})
    assert SamplingParams(logprobs=20, prompt_logprobs=0).logprobs == 20
    assert math.isclose(token_logprobs(torch.zeros(1, 4), [2], [0])[0].logprob, math.log(0.25), rel_tol=1e-6)


def test_prefill_worker_answers_first_token_and_prompt_logprobs_computing_the_prompt_whole(tiny_llama_dir):
    """The prefill worker's batch: a request that asks gets its first token's and its prompt's logprobs
    (computed whole though its prefix is cached); one that does not, batched with it, gets none."""
    import asyncio

    from tests.unit.test_prefill_loop import _loop, _until, _used

    runner = ModelRunner(tiny_llama_dir, block_size=4, num_blocks=64)
    prompt = prompts_of([21], seed=5)[0]

    async def main():
        loop, _ = _loop(runner)
        plain = SamplingParams(temperature=0, max_tokens=1)
        _, cached = loop.submit("warm", prompt, plain, None)
        await asyncio.wait_for(cached, 30)
        loop.attach("warm", None)  # no decode worker wants it: its blocks go back, cached
        await _until(lambda: _used(loop) == 0, 30)
        asks = SamplingParams(temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=3)
        job, result = loop.submit("asks", prompt, asks, None)
        other, other_result = loop.submit("other", prompt, plain, None)
        first, _ = await asyncio.wait_for(result, 30)
        await asyncio.wait_for(other_result, 30)
        for rid in ("asks", "other"):
            loop.attach(rid, None)
        await _until(lambda: _used(loop) == 0, 30)
        await loop.close()
        return first, job, other

    first, job, other = asyncio.run(main())
    assert job.cached_tokens == 0 and other.cached_tokens == 20  # (the last block is always computed)
    ref = ref_logprobs(tiny_llama_dir, prompt)
    assert_entry(job.payload.first_logprobs, ref[-1], first, 2)
    assert len(job.payload.prompt_logprobs) == len(prompt) - 1
    for p, entry in enumerate(job.payload.prompt_logprobs, start=1):
        assert_entry(entry, ref[p - 1], prompt[p], 3)
    assert other.payload.first_logprobs is None and other.payload.prompt_logprobs is None


@pytest.mark.slow  # Triton's interpreter: `make test` runs it, `make test-fast` skips it
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path (TRITON_INTERPRET, CPU tensors)")
def test_interpreted_triton_prefill_keeping_equals_the_torch_backend(tiny_llama_dir):
    pytest.importorskip("triton")
    a, b = prompts_of([6, 9], seed=4)
    items = [PrefillItem(a, [0, 1]), PrefillItem(b, [2, 3, 4])]
    out = {}
    for backend in ("triton", "torch"):
        runner = ModelRunner(tiny_llama_dir, backend=backend, block_size=4, num_blocks=8)
        logits, kept = runner.prefill_keeping(items, [True, False])
        out[backend] = (logits, kept.logits(0, kept.num_rows), runner.prefill(items))
    for got, want in zip(out["triton"], out["torch"], strict=True):
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    assert torch.equal(out["triton"][0], out["triton"][2]) and out["triton"][1].shape[0] == len(a)
