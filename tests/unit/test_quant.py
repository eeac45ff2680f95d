"""Weight-only int8 (``engine.quant``, ``--quantization int8``): exact against its own dequantised reference.

The product kernels read int8 panels and apply per-row scales after the sum; the reference multiplies by
``q * scale`` in float32. They differ by summation order only, so logits agree to float32 rounding and the
greedy tokens of a whole run equal transformers' on the dequantised weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.engine_steps import greedy_tokens
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.env import EngineEnv
from pdserve.engine.llm_engine import EngineConfig
from pdserve.engine.model_runner import ModelRunner, PrefillItem
from pdserve.engine.quant import INT8_GROUP, check_quantization, dequantize_int8, quantize_int8
from pdserve.engine.weights import Linear, LinearKind, choose_linear
from tests.tiny_models import load_int8_reference, load_reference
from tests.unit.test_linear_pack import _case, _close

CPU = torch.device("cpu")


def test_quantize_int8_rounds_each_group_to_its_own_scale() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 50, generator=g) * torch.logspace(-3, 1, 37)[:, None]  # rows of very different size
    w[5] = 0.0
    w[3, 0] = 1000.0  # an outlier spoils only its own group's resolution
    q, s = quantize_int8(w, group=16)  # groups of 16, 16, 16 and a last one of 2
    assert q.dtype == torch.int8 and q.shape == (37, 50) and s.dtype == torch.float32 and s.shape == (37, 4)
    assert int(q.min()) >= -127
    assert torch.equal(q[5], torch.zeros(50, dtype=torch.int8)) and torch.equal(s[5], torch.ones(4))
    for grp, (a, b) in enumerate(((0, 16), (16, 32), (32, 48), (48, 50))):
        nonzero = [r for r in range(37) if r != 5]
        assert (q[nonzero, a:b].abs().amax(1) == 127).all()  # each group spans the full int8 range
        step = s[:, grp : grp + 1]
        assert (
            (dequantize_int8(q, s, 16)[:, a:b] - w[:, a:b]).abs() <= step / 2 + 1e-6 * w[:, a:b].abs()
        ).all()
    assert s[3, 0] > 1000 / 128 and s[3, 1] < 1.0
    # Row scales only: a fused matrix quantises as its parts do (the engine fuses q/k/v and gate/up).
    q_top, s_top = quantize_int8(w[:20], group=16)
    assert torch.equal(q_top, q[:20]) and torch.equal(s_top, s[:20])


def test_quantize_rejects_what_it_cannot_quantise() -> None:
    with pytest.raises(ValueError, match="2-D float"):
        quantize_int8(torch.zeros(3, 4, 5))
    with pytest.raises(ValueError, match="2-D float"):
        quantize_int8(torch.zeros(3, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="group"):
        quantize_int8(torch.zeros(3, 4), group=0)
    assert check_quantization("int8") == "int8"
    with pytest.raises(ValueError, match="none, int8"):
        check_quantization("int4")
    with pytest.raises(ValueError, match="int4"):
        EngineConfig(quantization="int4")


def _reference(w: torch.Tensor, b: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """float32 product with the dequantised weights, rounded once to x's dtype: what the kernel promises."""
    deq = dequantize_int8(*quantize_int8(w))
    return F.linear(x.float(), deq, None if b is None else b.float()).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_panels_match_the_dequantised_product(kernels_every_isa, dtype, rows, bias) -> None:
    # 200 outputs: the last panel is partial on every panel width (16 and 32 columns).
    w, b, x = _case(200, 96, rows, dtype, bias)
    lin = Linear.build(w, b, LinearKind.PANELS, kernels_every_isa, "int8")
    assert lin.weight.dtype == torch.int8 and lin.out_features == 200
    got = lin(x)
    assert got.shape == (rows, 200) and got.dtype == dtype
    _close(got, _reference(w, b, x), dtype)


@pytest.mark.parametrize("rows", [1, 2, 7])
def test_int8_panels_with_a_ragged_last_group(kernels_every_isa, rows) -> None:
    # k = 131: groups of 64, 64 and 3, none a multiple of the k-splits of small row counts.
    w, b, x = _case(45, 131, rows, torch.float32, bias=True)
    _close(
        Linear.build(w, b, LinearKind.PANELS, kernels_every_isa, "int8")(x),
        _reference(w, b, x),
        torch.float32,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_portable_path_matches_the_dequantised_product(dtype) -> None:
    w, b, x = _case(70, 48, 9, dtype, bias=True)
    lin = Linear.build(w, b, LinearKind.PLAIN, None, "int8")
    assert lin.weight.dtype == torch.int8 and lin.weight.shape == (70, 48)
    _close(lin(x), _reference(w, b, x), dtype)


def test_int8_weights_take_a_byte_each_plus_a_scale_per_group(kernels_every_isa) -> None:
    w, b, _ = _case(960, 576, 1, torch.float32, bias=False)
    fp = Linear.build(w, b, LinearKind.PANELS, kernels_every_isa)
    q8 = Linear.build(w, b, LinearKind.PANELS, kernels_every_isa, "int8")
    assert fp.num_bytes() == 960 * 576 * 4
    assert q8.num_bytes() == 960 * 576 + 960 * (576 // INT8_GROUP) * 4  # 3.76x fewer bytes


def test_choose_linear_for_int8(kernels_every_isa) -> None:
    env = EngineEnv.from_environ()
    for dtype in (torch.float32, torch.bfloat16):
        assert choose_linear(dtype, CPU, kernels_every_isa, env, "int8") is LinearKind.PANELS
        assert choose_linear(dtype, CPU, None, env, "int8") is LinearKind.PLAIN
    with pytest.raises(ValueError, match="onednn cannot run --quantization int8"):
        choose_linear(torch.float32, CPU, kernels_every_isa, EngineEnv(linear="onednn"), "int8")


@pytest.fixture(scope="module")
def int8_reference(tiny_model_dir):
    return load_int8_reference(tiny_model_dir)


PROMPT_LENS = (7, 23, 1, 40)
DECODE_STEPS = 64


@pytest.mark.parametrize("backend", ["torch", "cpu_kernels"])
def test_int8_runner_matches_transformers_on_dequantised_weights(
    tiny_model_dir, int8_reference, backend, native_kernels
) -> None:
    """Prefill logits within 1e-4, then >= 64 greedy steps of a mixed-length batch token for token."""
    runner = ModelRunner(
        tiny_model_dir,
        backend=backend,
        block_size=4,
        num_blocks=256,
        quantization="int8",
        kernel_isa=native_kernels.isa,
    )
    assert runner.quantization == "int8" and runner.weights.lm_head.weight.dtype == torch.int8
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]
    bm = BlockManager(runner.num_blocks, runner.block_size)
    items = [PrefillItem(p, bm.allocate(i, len(p))) for i, p in enumerate(prompts)]
    got = runner.prefill(items, all_logits=True)
    with torch.inference_mode():
        want = torch.cat([int8_reference(torch.tensor([p])).logits[0].float() for p in prompts])
    assert (got - want).abs().max().item() <= 1e-4

    tokens = greedy_tokens(runner, prompts, DECODE_STEPS + 1)  # token 0 from prefill, then 64 decode steps

    int8_reference.generation_config.eos_token_id = None
    for p, toks in zip(prompts, tokens, strict=True):
        with torch.inference_mode():
            out = int8_reference.generate(
                torch.tensor([p]), max_new_tokens=DECODE_STEPS + 1, do_sample=False, pad_token_id=0
            )
        assert toks == out[0, len(p) :].tolist()


def test_int8_is_not_the_float_model(tiny_llama_dir) -> None:
    """The oracle above would be vacuous if quantising changed nothing: on these random weights it moves
    the logits well past the parity tolerance."""
    runner = ModelRunner(tiny_llama_dir, block_size=4, num_blocks=16, quantization="int8")
    prompt = list(range(3, 40))
    bm = BlockManager(runner.num_blocks, runner.block_size)
    got = runner.prefill([PrefillItem(prompt, bm.allocate(0, len(prompt)))], all_logits=True)
    with torch.inference_mode():
        want = load_reference(tiny_llama_dir)(torch.tensor([prompt])).logits[0].float()
    assert (got - want).abs().max().item() > 1e-2
