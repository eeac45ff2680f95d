"""Parity of the engine's model with transformers on tiny random-weight models (llama, qwen2, llama3).

What holds: float32 prefill logits of every position within 1e-4 of transformers'
forward, for >= 4 different-length prompts in ONE prefill; a greedy loop over the runner (>= 4 prompts
decoded together, >= 64 decode steps) gives exactly transformers' ``generate`` tokens, batch 1 each.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.model_runner import DecodeItem, ModelRunner, PrefillItem
from tests.tiny_models import load_reference

PROMPT_LENS = (7, 23, 1, 40, 16)
DECODE_STEPS = 64
# Triton's interpreter (CI, no GPU) runs each kernel program in numpy: a shorter greedy run there; on the
# GPU the full 64 steps.
INTERPRETED_DECODE_STEPS = 8
# ... and fewer prompts (still a partial block, several blocks and a single token, at block size 4).
INTERPRETED_PROMPT_LENS = (7, 23, 1)


def _interpreted(backend: str, runner: ModelRunner) -> bool:
    return backend == "triton" and runner.device.type == "cpu"


# Triton in its interpreter is this file's slow part: `make test` runs it, `make test-fast` skips it.
BACKENDS = ["torch", "cpu_kernels", pytest.param("triton", marks=pytest.mark.slow)]


@pytest.fixture(scope="session", params=BACKENDS)
def backend(request) -> str:
    """Every implementation of the non-matmul ops: portable torch, the C kernels (their native build: the
    other ISA builds meet the torch oracle op by op in test_cpu_kernels and test_linear_pack), and the CUDA
    backend's Triton kernels (on the GPU when there is one, else in Triton's interpreter on CPU)."""
    if request.param == "cpu_kernels":
        request.getfixturevalue("native_kernels")  # skips where the kernels cannot be built
    if request.param == "triton":
        pytest.importorskip("triton", reason="Triton is not installed")
    return request.param


def make_runner(model_dir, backend: str, **kw) -> ModelRunner:
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    return ModelRunner(model_dir, backend=backend, device=device, kernel_isa="native", **kw)


def _prompts(lens: tuple[int, ...], seed: int, vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Ids from 3 up: 0-2 are pad/bos/eos in the tiny configs.
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def _scattered_manager(num_blocks: int, block_size: int, seed: int) -> BlockManager:
    """A block manager whose free list is shuffled, so tables come out non-contiguous and out of order."""
    bm = BlockManager(num_blocks, block_size)
    for b in range(num_blocks):  # sequence ("fill", b) holds block b
        bm.allocate(("fill", b), block_size)
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)
    for b in order:
        bm.free(("fill", b))
    return bm


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return load_reference(tiny_model_dir)


def test_prefill_logits_match_transformers(tiny_model_dir, reference, backend):
    runner = make_runner(tiny_model_dir, backend, block_size=4, num_blocks=64)
    bm = _scattered_manager(runner.num_blocks, runner.block_size, seed=1)
    lens = INTERPRETED_PROMPT_LENS if _interpreted(backend, runner) else PROMPT_LENS
    prompts = _prompts(lens, seed=2)
    items = [PrefillItem(p, bm.allocate(i, len(p))) for i, p in enumerate(prompts)]
    assert any(sorted(it.block_table) != list(it.block_table) for it in items), "tables should be scattered"

    got = runner.prefill(items, all_logits=True).cpu()  # [T_total, V]
    assert got.dtype == torch.float32 and got.shape == (sum(lens), runner.config.vocab_size)
    with torch.inference_mode():
        want = torch.cat([reference(torch.tensor([p])).logits[0].float() for p in prompts])
    assert (got - want).abs().max().item() <= 1e-4

    last = runner.prefill(items)  # last-token logits, same cache slots rewritten with the same values
    ends = torch.tensor(lens).cumsum(0) - 1
    # Not bitwise: the lm_head matmul runs with M = len(prompts) rows here and M = T_total above, and BLAS
    # may block (and so round) differently by M (seen on AMD Zen CPUs; Intel gave equal bits).
    last = last.cpu()
    torch.testing.assert_close(last, got[ends], rtol=0, atol=1e-5)
    assert torch.equal(last.argmax(-1), got[ends].argmax(-1))


def test_greedy_generation_matches_transformers(tiny_model_dir, reference, backend):
    runner = make_runner(tiny_model_dir, backend, block_size=4, num_blocks=256)
    bm = _scattered_manager(runner.num_blocks, runner.block_size, seed=3)
    interpreted = _interpreted(backend, runner)
    prompts = _prompts(INTERPRETED_PROMPT_LENS if interpreted else PROMPT_LENS, seed=4)

    steps = INTERPRETED_DECODE_STEPS if interpreted else DECODE_STEPS
    tokens: list[list[int]] = [[] for _ in prompts]
    items = [PrefillItem(p, bm.allocate(i, len(p))) for i, p in enumerate(prompts)]
    next_ids = runner.prefill(items).argmax(-1).tolist()
    for _ in range(steps):
        step = []
        for i, p in enumerate(prompts):
            tokens[i].append(next_ids[i])
            pos = len(p) + len(tokens[i]) - 1
            bm.grow(i, pos + 1)
            step.append(DecodeItem(next_ids[i], pos, bm.block_table(i)))
        next_ids = runner.decode(step).argmax(-1).tolist()
    for i in range(len(prompts)):
        tokens[i].append(next_ids[i])
        bm.free(i)
    assert bm.num_free == bm.num_blocks

    reference.generation_config.eos_token_id = None  # compare full length: no early stop on eos
    for p, got in zip(prompts, tokens, strict=True):
        with torch.inference_mode():
            out = reference.generate(
                torch.tensor([p]), max_new_tokens=steps + 1, do_sample=False, pad_token_id=0
            )
        assert got == out[0, len(p) :].tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_stays_close(tiny_llama_dir, dtype, backend):
    """Half-precision prefill and teacher-forced decode track float32 within a few percent of logit scale."""
    ref = ModelRunner(tiny_llama_dir, block_size=4, num_blocks=64, backend="torch")
    half = make_runner(tiny_llama_dir, backend, dtype=dtype, block_size=4, num_blocks=64)
    assert half.kv.dtype == dtype
    prompts = _prompts((9, 30, 2, 17), seed=5)
    tables = [list(range(i * 16, i * 16 + 16)) for i in range(len(prompts))]
    items = [PrefillItem(p, t) for p, t in zip(prompts, tables, strict=True)]
    want, got = ref.prefill(items, all_logits=True), half.prefill(items, all_logits=True).cpu()
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 0.05 * scale
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9

    next_ids = want.argmax(-1)[torch.tensor([len(p) for p in prompts]).cumsum(0) - 1].tolist()
    for step in range(3 if _interpreted(backend, half) else 8):
        dec = [DecodeItem(t, len(p) + step, tab) for t, p, tab in zip(next_ids, prompts, tables, strict=True)]
        want, got = ref.decode(dec), half.decode(dec).cpu()
        assert torch.isfinite(got).all()
        assert (got - want).abs().max().item() <= 0.05 * want.abs().max().item()
        next_ids = want.argmax(-1).tolist()
