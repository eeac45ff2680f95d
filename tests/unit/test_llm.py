"""The offline LLM API and LLMEngine: parity with transformers, batch invariance, validation,
continuous batching, the decode-worker hand-off, and a leak check after everything that generates."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.engine.model_runner import ModelRunner, PrefillItem
from pdserve.engine.sampler import Sampler, SampleRow
from tests.tiny_models import load_reference

GREEDY64 = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
_REFS: dict = {}


def prompts_of(lengths, seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    # Skip ids 0-2 (pad/bos/eos) so prompts look like text.
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model_dir: Path, prompt: list[int], n: int, min_new: bool = False) -> list[int]:
    """transformers' greedy tokens, batch 1, exactly n new tokens (cached).

    Default: eos does not stop generation (``eos_token_id=[]``), our ``ignore_eos=True``.
    ``min_new``: ``min_new_tokens=n``, which masks eos, our ``min_tokens=n``.
    """
    key = (str(model_dir), tuple(prompt), n, min_new)
    if key not in _REFS:
        mkey = ("model", str(model_dir))
        if mkey not in _REFS:
            _REFS[mkey] = load_reference(model_dir)
        ref = _REFS[mkey]
        kw = {"min_new_tokens": n} if min_new else {"eos_token_id": []}
        with torch.inference_mode():
            out = ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, **kw)
        _REFS[key] = out[0, len(prompt) :].tolist()
        assert len(_REFS[key]) == n
    return _REFS[key]


def assert_no_leak(llm_or_engine) -> None:
    engine = getattr(llm_or_engine, "engine", llm_or_engine)
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
    engine.block_manager.check_invariants()


# -- parity with transformers ------------------------------------------------------------------------------
def test_greedy_batch_equals_transformers(tiny_model_dir):
    llm = LLM(tiny_model_dir, dtype="float32")
    prompts = prompts_of([1, 5, 17, 33, 70])
    outs = llm.generate(prompts, GREEDY64)
    for p, o in zip(prompts, outs, strict=True):
        assert o.prompt_token_ids == p
        assert o.token_ids == hf_greedy(tiny_model_dir, p, 64)
        assert o.finish_reason == "length" and o.text == ""
    # transformers' min_new_tokens masks eos; so does min_tokens (the streams differ where eos is argmax).
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, min_tokens=64))
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == hf_greedy(tiny_model_dir, p, 64, min_new=True)
    assert_no_leak(llm)


# -- batch invariance ------------------------------------------------------------------------------------
def test_batch_invariance_greedy_and_seeded(tiny_model_dir):
    llm = LLM(tiny_model_dir, dtype="float32")
    batch = prompts_of([9, 2, 31, 4, 57, 13, 1, 22], seed=1)
    target = batch[4]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llm.generate([target], greedy)[0].token_ids
    together = llm.generate(batch, greedy)
    assert together[4].token_ids == alone

    seeded = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=42, max_tokens=24, ignore_eos=True)
    alone = llm.generate(target, seeded)[0].token_ids
    mixed = [
        SamplingParams(max_tokens=24, ignore_eos=True),
        greedy,
        SamplingParams(seed=7, max_tokens=10, ignore_eos=True),
    ] * 3
    mixed[4] = seeded
    assert llm.generate(batch, mixed[:8])[4].token_ids == alone
    assert llm.generate(target, seeded)[0].token_ids == alone  # and again, after other work
    assert llm.generate(target, SamplingParams(temperature=0.9, seed=43, max_tokens=24))[0].token_ids != alone
    assert_no_leak(llm)


# -- continuous batching -----------------------------------------------------------------------------------
@pytest.mark.parametrize("mixed", [False, True], ids=["prefill_first", "mixed_steps"])
def test_continuous_batching_chunking_and_preemption_keep_parity(tiny_llama_dir, mixed):
    # 14 blocks of 8 tokens: far fewer than the batch needs at once, so sequences are preempted
    # and recomputed; a budget of 16 tokens chunks every prompt longer than that.
    llm = LLM(
        tiny_llama_dir,
        dtype="float32",
        block_size=8,
        num_blocks=14,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        mixed_steps=mixed,
    )
    runner, mixed_calls = llm.engine.runner, []
    step = runner.step
    runner.step = lambda pre, dec: mixed_calls.append(len(dec)) or step(pre, dec)  # type: ignore[method-assign]
    prompts = prompts_of([3, 40, 11, 25, 7, 60], seed=2)
    max_tokens = [30, 12, 45, 20, 50, 8]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate(prompts, params)
    for p, m, o in zip(prompts, max_tokens, outs, strict=True):
        assert o.token_ids == hf_greedy(tiny_llama_dir, p, 64)[:m]
        assert o.finish_reason == "length"
    assert llm.engine.stats().num_preemptions > 0
    assert bool(mixed_calls) == mixed  # decodes rode along with prefill chunks only when asked
    assert_no_leak(llm)


def test_sequences_finish_at_different_times_and_free_blocks_at_once(tiny_llama_dir):
    engine = LLMEngine(tiny_llama_dir, None, EngineConfig(block_size=4, dtype="float32"))
    bm = engine.block_manager
    prompts = prompts_of([6, 6, 6], seed=3)
    for i, (p, m) in enumerate(zip(prompts, [2, 9, 5], strict=True)):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
    finished_at: dict[str, int] = {}
    for step in range(50):
        for d in engine.step():
            if d.finish_reason is not None:
                finished_at[d.request_id] = step
                # The finished request's blocks are back immediately; the others keep theirs.
                live = [s for s in engine.scheduler.running]
                assert bm.num_used == sum(len(bm.block_table(s.seq_id)) for s in live)
        if not engine.has_unfinished():
            break
    assert finished_at["r0"] < finished_at["r2"] < finished_at["r1"]
    assert_no_leak(engine)


def test_abort_mid_generation_frees_blocks(tiny_llama_dir):
    engine = LLMEngine(tiny_llama_dir, None, EngineConfig(dtype="float32"))
    for i, p in enumerate(prompts_of([5, 30, 12], seed=4)):
        engine.add_request(i, p, SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.block_manager.num_used > 0
    assert engine.abort(1) and not engine.abort(1)
    for i in (0, 2):
        engine.abort(i)
    assert engine.step() == []
    assert_no_leak(engine)


def test_stream_yields_the_same_tokens_and_closing_it_aborts(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32")
    prompt = prompts_of([12], seed=5)[0]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    deltas = list(llm.stream(prompt, params))
    assert [t for d in deltas for t in d.new_token_ids] == llm.generate(prompt, params)[0].token_ids
    assert [d.finish_reason for d in deltas] == [None] * 19 + ["length"]
    it = llm.stream(prompt, params)
    next(it)
    it.close()
    assert_no_leak(llm)


def test_streams_and_generate_open_at_once_each_get_all_their_tokens(tiny_llama_dir):
    """Exploratory testing: a second stream, or a generate call, stepping the same engine took the first
    stream's deltas (dropped: the stream ended without its tokens or its finish; generate raised KeyError).
    Every request's deltas now go to its own consumer, whoever steps the engine."""
    llm = LLM(tiny_llama_dir, dtype="float32")
    a_prompt, b_prompt = prompts_of([12, 7], seed=6)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want_a, want_b = (o.token_ids for o in llm.generate([a_prompt, b_prompt], params))
    a, b = llm.stream(a_prompt, params), llm.stream(b_prompt, params)
    got_a, got_b = [next(a)], [next(b)]
    got_a += list(a)  # steps the engine to a's end: b's deltas wait for b
    got_b += list(b)
    for got, want in ((got_a, want_a), (got_b, want_b)):
        assert [t for d in got for t in d.new_token_ids] == want
        assert got[-1].finish_reason == "length"
    s = llm.stream(a_prompt, params)
    first = next(s)
    assert llm.generate([b_prompt], params)[0].token_ids == want_b  # steps s's request too
    assert [t for d in [first, *s] for t in d.new_token_ids] == want_a
    assert_no_leak(llm)


# -- stopping ---------------------------------------------------------------------------------------------
def test_stop_token_ids_min_tokens_and_context_limit(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32")
    prompt = prompts_of([10], seed=6)[0]
    ref = hf_greedy(tiny_llama_dir, prompt, 64)
    stop_id = ref[5]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=64, stop_token_ids=[stop_id]))[0]
    assert out.token_ids == ref[: ref.index(stop_id) + 1] and out.finish_reason == "stop"
    # min_tokens masks the stop id until it has been reached, so the stream cannot end early.
    out = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=64, min_tokens=20, stop_token_ids=[stop_id])
    )[0]
    assert len(out.token_ids) >= 20 and stop_id not in out.token_ids[:20]
    # The model's context (2048) ends generation with "length".
    long_prompt = prompts_of([2040], seed=7)[0]
    out = llm.generate(long_prompt, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"
    assert_no_leak(llm)


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tiny_llama_dir, tmp_path_factory):
    """The tiny llama with SmolLM2's tokenizer files: text in and out without loading a real model."""
    from pdserve.engine.registry import resolve_model

    src = resolve_model("smollm2-135m-instruct")
    dst = tmp_path_factory.mktemp("tiny-tok")
    for f in tiny_llama_dir.iterdir():
        shutil.copy(f, dst / f.name)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    return dst


def test_stop_strings_without_text_are_refused(tiny_with_tokenizer):
    """``detokenize=False``: no text to look for stop strings in (they were accepted and ignored)."""
    llm = LLM(tiny_with_tokenizer, dtype="float32", detokenize=False)
    with pytest.raises(ValueError, match="detokenize=False"):
        llm.generate([[5, 6]], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="detokenize=False"):
        next(llm.stream([5, 6], SamplingParams(stop=["x"])))
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=2))[0].finish_reason == "length"
    assert_no_leak(llm)


def test_stop_strings_cut_the_text_and_never_leak(tiny_with_tokenizer):
    llm = LLM(tiny_with_tokenizer, dtype="float32")
    prompt = prompts_of([8], seed=8)[0]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = llm.generate(prompt, params)[0]
    assert full.text == llm.tokenizer.decode(full.token_ids) and len(full.text) > 20
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    cut = full.text.index(stop)
    out = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop, "\x00"])
    )[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[:cut] and stop not in out.text
    # Generation ends at the token that completed the stop string.
    n = len(out.token_ids)
    assert out.token_ids == full.token_ids[:n]
    assert stop in llm.tokenizer.decode(full.token_ids[:n]) and stop not in llm.tokenizer.decode(
        full.token_ids[: n - 1]
    )
    assert_no_leak(llm)


# -- validation before any work --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def strict_llm(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", num_blocks=64, block_size=16)
    yield llm
    assert_no_leak(llm)


@pytest.mark.parametrize(
    ("prompts", "params", "match"),
    [
        ([[5, 6], []], None, "prompt 1: prompt is empty"),
        ([[]], None, "empty"),
        ([list(range(3, 500)) * 5], None, "context is 2048"),
        ([[5, 512]], None, "outside the vocabulary"),
        ([[5, -1]], None, "outside the vocabulary"),
        (["hello"], None, "no tokenizer"),
        ([[5, 6]], SamplingParams(stop=["x"]), "tokenizer"),
        ([[5, 6]], SamplingParams(stop_token_ids=[600]), "stop_token_ids"),
        ([[5, 6], [7]], [SamplingParams()], "2 prompts"),
        ([[5, 6]], [{"max_tokens": 3}], "SamplingParams"),
        ([[5, 6]], {"max_tokens": 3}, "got dict"),
        ([[5, 6]], SamplingParams(max_tokens=2000), "KV blocks"),
        (42, None, "prompts must be"),
    ],
)
def test_bad_input_raises_before_any_work(strict_llm, monkeypatch, prompts, params, match):
    def no_work(*a, **k):
        raise AssertionError("the model ran before validation finished")

    monkeypatch.setattr(strict_llm.engine.runner, "prefill", no_work)
    monkeypatch.setattr(strict_llm.engine.runner, "decode", no_work)
    with pytest.raises(ValueError, match=match):
        strict_llm.generate(prompts, params)
    assert_no_leak(strict_llm)


def test_bad_sampling_params_and_options_name_the_problem(tiny_llama_dir):
    for kwargs, field in [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -3}, "top_k"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)
    with pytest.raises(ValueError, match="no-such-model"):
        LLM("no-such-model")
    with pytest.raises(ValueError, match="does-not-exist"):
        LLM("/tmp/does-not-exist/model")
    with pytest.raises(ValueError, match="dtype"):
        LLM(tiny_llama_dir, dtype="int8")
    with pytest.raises(ValueError, match="max_num_seq"):
        LLM(tiny_llama_dir, max_num_seq=3)
    llm = LLM(tiny_llama_dir, dtype="float32", num_blocks=8)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}])
    assert llm.generate([]) == []
    assert_no_leak(llm)


def test_bfloat16_runs_and_frees_everything(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="bfloat16", num_blocks=32)
    assert llm.engine.runner.kv.dtype == torch.bfloat16
    outs = llm.generate(prompts_of([4, 19], seed=11), SamplingParams(max_tokens=9, ignore_eos=True, seed=1))
    assert [len(o.token_ids) for o in outs] == [9, 9]
    assert all(0 <= t < 512 for o in outs for t in o.token_ids)
    assert_no_leak(llm)


# -- the decode-worker hand-off -----------------------------------------------------------------------------
def _prefill_remotely(prefill: ModelRunner, decode: LLMEngine, rid: str, prompt, params) -> int:
    """A prefill worker: run the prompt on its own runner, push each layer's K/V into the decode
    engine's blocks (what kv_transfer does over the network), and sample token 0 with its own sampler."""
    table = decode.block_manager.allocate(rid, len(prompt))
    B = decode.runner.block_size
    pos = torch.arange(len(prompt))
    blocks, offs = torch.tensor(table)[pos // B], pos % B  # [T], [T]
    own = list(range(-(-len(prompt) // prefill.block_size)))  # the prefill side's scratch blocks

    def push(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:  # k, v: [T, Hkv, D]
        decode.runner.kv[layer, blocks, 0, offs] = k
        decode.runner.kv[layer, blocks, 1, offs] = v

    logits = prefill.prefill([PrefillItem(prompt, own)], layer_hook=push)  # [1, V]
    return Sampler(decode.eos_token_ids, seed=1234)(logits, [SampleRow(params, 0)])[0]


def test_add_prefilled_request_equals_the_colocated_engine(tiny_llama_dir):
    colocated = LLM(tiny_llama_dir, dtype="float32")
    decode = LLMEngine(tiny_llama_dir, None, EngineConfig(block_size=4, seed=99, dtype="float32"))
    prefill = ModelRunner(tiny_llama_dir, block_size=16, num_blocks=8)
    prompts = prompts_of([13, 29, 4], seed=9)
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=40, seed=5, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=6, max_tokens=1),
    ]
    expect = colocated.generate(prompts, params)
    got: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        first = _prefill_remotely(prefill, decode, f"r{i}", p, sp)
        d = decode.add_prefilled_request(f"r{i}", p, first, sp)
        got[d.request_id] = list(d.new_token_ids)
        if d.finish_reason:
            reasons[d.request_id] = d.finish_reason
    assert reasons == {"r2": "length"} and "r2" not in decode.block_manager  # max_tokens=1: done at once
    for _ in range(100):
        for d in decode.step():
            got[d.request_id] += d.new_token_ids
            if d.finish_reason:
                reasons[d.request_id] = d.finish_reason
        if not decode.has_unfinished():
            break
    for i, e in enumerate(expect):
        assert got[f"r{i}"] == e.token_ids and reasons[f"r{i}"] == e.finish_reason
    assert_no_leak(decode)
    assert_no_leak(colocated)


def test_prefilled_request_errors_and_aborts_leave_no_blocks(tiny_llama_dir):
    engine = LLMEngine(tiny_llama_dir, None, EngineConfig(num_blocks=16, dtype="float32"))
    bm = engine.block_manager
    with pytest.raises(ValueError, match="holds no blocks"):
        engine.add_prefilled_request("x", [5, 6, 7], 9, SamplingParams())
    bm.allocate("y", 3)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_prefilled_request("y", [5, 6, 7], 9999, SamplingParams())
    assert "y" in bm  # on error the caller keeps its blocks ...
    assert engine.abort("y") and "y" not in bm  # ... and abort frees a reservation never adopted
    bm.allocate("z", 3)
    d = engine.add_prefilled_request("z", [5, 6, 7], 2, SamplingParams(max_tokens=5))  # 2 is eos
    assert d.finish_reason == "stop" and d.new_token_ids == (2,)
    bm.allocate("w", 3)
    engine.add_prefilled_request("w", [5, 6, 7], 9, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.abort("w")
    assert_no_leak(engine)


# -- the real model (slow: one load per session) ---------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2():
    torch.set_num_threads(2)
    llm = LLM("smollm2-135m-instruct", dtype="float32", num_blocks=256, block_size=16)
    yield llm
    assert_no_leak(llm)


QUESTIONS = [
    "What is the capital of France?",
    "Hi",
    "Explain in detail how a transformer language model turns a prompt into its next token, "
    "covering tokenization, embeddings, attention and sampling.",
    "Name three colors.",
    "Write a short poem about the sea and the wind and the long grey evening light over the harbour.",
    "2+2=?",
    "Translate 'good morning' into French, German and Spanish.",
    "Why is the sky blue?",
]


@pytest.mark.slow
def test_smollm2_batch_invariance_and_streamed_text(smollm2):
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=24)
    together = smollm2.chat(convs, params)
    lengths = {len(o.prompt_token_ids) for o in together}
    assert len(lengths) >= 6  # mixed lengths
    for i in (2, 5):
        alone = smollm2.chat(convs[i], params)[0]
        assert alone.token_ids == together[i].token_ids
    for o in together:
        assert o.text == smollm2.tokenizer.decode(o.token_ids)  # incremental text == full decode
        assert o.finish_reason in ("stop", "length")
    assert "Paris" in together[0].text
    seeded = SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=16)
    alone = smollm2.chat(convs[7], seeded)[0].token_ids
    batch = smollm2.chat(convs, [seeded if i == 7 else SamplingParams(max_tokens=16) for i in range(8)])
    assert batch[7].token_ids == alone
    assert_no_leak(smollm2)


def _metaspace_tokenizer(vocab_size: int):
    """A SentencePiece-style word tokenizer ("▁w7" -> " w7"): decoding drops a leading word's space."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    from pdserve.engine.tokenizer import Tokenizer

    vocab = {f"▁w{i}": i for i in range(vocab_size)}
    backend = Backend(models.WordLevel(vocab, unk_token="▁w0"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    return Tokenizer(backend, special_tokens={})


def test_streamed_text_continues_the_prompt(tiny_llama_dir):
    """The text stream is primed with the prompt's tail (as vLLM does), so the first word keeps its space,
    on the colocated path and on the decode-worker path alike."""
    tok = _metaspace_tokenizer(512)
    engine = LLMEngine(tiny_llama_dir, tok, EngineConfig(num_blocks=32, dtype="float32"))
    prompt = prompts_of([6], seed=10)[0]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request("a", prompt, params)
    text, ids = "", []
    while engine.has_unfinished():
        for d in engine.step():
            text += d.new_text
            ids += d.new_token_ids
    assert text == tok.decode(prompt + ids)[len(tok.decode(prompt)) :]
    assert text.startswith(" w") and text != tok.decode(ids)
    engine.block_manager.allocate("b", len(prompt))
    engine.runner.prefill([PrefillItem(prompt, engine.block_manager.block_table("b"))])
    d = engine.add_prefilled_request("b", prompt, ids[0], params)
    text_b = d.new_text
    while engine.has_unfinished():
        text_b += "".join(x.new_text for x in engine.step())
    assert text_b == text
    assert_no_leak(engine)
