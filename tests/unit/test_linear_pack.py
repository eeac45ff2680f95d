"""The matmul paths of ``engine.weights`` (``LinearKind``) against the torch oracle, on every ISA path.

The C kernels are built with ``-march=native`` (8-float vectors on AVX2/NEON, 16 on AVX-512) and, through
the ``kernels_every_isa`` fixture, once more per other build whose paths differ here
(``kernel_isas_to_check``: the AVX2 and generic builds on an AVX-512 host; the generic build and SIMDe's
AVX-512 on an AVX2 one). oneDNN dispatches on the CPU it finds.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine import cpu_kernels
from pdserve.engine.cpu_kernels import cpu_isa, kernel_isas_to_check
from pdserve.engine.env import KERNEL_ISAS, EngineEnv
from pdserve.engine.weights import Linear, LinearKind, choose_linear, onednn_runs

CPU = torch.device("cpu")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def test_cpu_isa_names_the_host() -> None:
    info = cpu_isa()
    assert info["isa"] in {"amx_bf16", "avx512_bf16", "avx512f", "avx2", "asimd", "sve", "portable"}
    assert isinstance(info["flags"], list)


def _case(n: int, k: int, rows: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed + rows)
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    x = torch.randn(rows, k, generator=g).to(dtype)
    return w, b, x


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    scale = max(1.0, want.float().abs().max().item())
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=TOL[dtype] * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 8, 13, 16, 33, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_panels_match_f_linear(kernels_every_isa, dtype: torch.dtype, rows: int, bias: bool) -> None:
    # 200 outputs: not a multiple of any panel width, so the partial last panel is exercised.
    w, b, x = _case(200, 96, rows, dtype, bias)
    lin = Linear.build(w, b, LinearKind.PANELS, kernels_every_isa)
    assert lin.packed and lin.out_features == 200
    got = lin(x)
    assert got.shape == (rows, 200) and got.dtype == dtype
    # Reference in float32 from the same (rounded) inputs, rounded once: what the kernel promises.
    want = F.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype)
    _close(got, want, dtype)


def test_panels_on_model_sized_shapes(kernels_every_isa) -> None:
    for n, k in ((960, 576), (576, 1536), (49152 + 5, 64)):
        w, b, x = _case(n, k, 8, torch.float32, bias=False, seed=n)
        _close(Linear.build(w, b, LinearKind.PANELS, kernels_every_isa)(x), F.linear(x, w), torch.float32)


def _panels(w: torch.Tensor, p: int, pairs: bool) -> torch.Tensor:
    """What pack_linear_weight promises, built with torch: [ceil(N / P), K, P], or k pairs side by side."""
    n, k = w.shape
    padded = torch.zeros(-(-n // p) * p, k, dtype=w.dtype)
    padded[:n] = w
    panels = padded.view(-1, p, k)
    if pairs:
        return panels.view(-1, p, k // 2, 2).permute(0, 2, 1, 3).reshape(-1, k, p)
    return panels.transpose(1, 2).contiguous()


def test_bfloat16_pair_layout_where_the_build_has_bf16_dot_products(kernels_every_isa) -> None:
    """AVX512-BF16 builds pack bfloat16 of even K in pairs (the dot-product kernel reads them); odd K, other
    dtypes and other builds keep the plain panels. Either way the layout is exactly the promised one, and
    the products match F.linear on model-sized shapes and on an odd K."""
    pairs = kernels_every_isa.bf16_pairs(96)
    if kernels_every_isa.isa == "native":
        assert pairs == ("avx512_bf16" in cpu_isa()["flags"])  # type: ignore[operator]
    else:  # the emulated build compiles the BF16 paths; the capped ones never do
        assert pairs == (kernels_every_isa.isa == "simde-avx512")
    assert not kernels_every_isa.bf16_pairs(95)
    p = kernels_every_isa.panel_width()
    for n, k, dtype in ((200, 96, torch.bfloat16), (200, 95, torch.bfloat16), (200, 96, torch.float16)):
        w = torch.randn(n, k).to(dtype)
        want = _panels(w, p, pairs and dtype == torch.bfloat16 and k % 2 == 0)
        assert torch.equal(kernels_every_isa.pack_linear_weight(w), want), (n, k, dtype)
    for n, k in ((960, 576), (576, 1536), (49152 + 5, 64), (40, 95)):
        w, b, x = _case(n, k, 16, torch.bfloat16, bias=True, seed=n)
        got = Linear.build(w, b, LinearKind.PANELS, kernels_every_isa)(x)
        _close(got, F.linear(x.float(), w.float(), b.float()).to(torch.bfloat16), torch.bfloat16)


def test_panels_take_strided_inputs(kernels_every_isa) -> None:
    w, _, x = _case(40, 32, 6, torch.float32, bias=False)
    wide = torch.randn(6, 64)
    wide[:, :32] = x
    lin = Linear.build(w, None, LinearKind.PANELS, kernels_every_isa)
    _close(lin(wide[:, :32]), F.linear(x, w), torch.float32)
    with pytest.raises(ValueError, match="linear"):
        lin(torch.randn(6, 31))


@pytest.mark.skipif(not onednn_runs(torch.float32, CPU), reason="oneDNN unavailable here")
@pytest.mark.parametrize("rows", [1, 8, 33])
def test_onednn_float32_matches_f_linear(rows: int) -> None:
    w, b, x = _case(200, 96, rows, torch.float32, bias=True)
    _close(Linear.pack(w, b)(x), F.linear(x, w, b), torch.float32)


@pytest.mark.skipif(not onednn_runs(torch.bfloat16, CPU), reason="oneDNN bfloat16 unavailable on this CPU")
def test_onednn_bfloat16_is_bitwise_f_linear() -> None:
    w, _, x = _case(128, 64, 5, torch.bfloat16, bias=False)
    assert torch.equal(Linear.pack(w)(x), F.linear(x, w))


def test_choose_linear(kernels_every_isa) -> None:
    auto = EngineEnv()
    assert choose_linear(torch.float32, CPU, kernels_every_isa, auto) is LinearKind.PANELS
    half = choose_linear(torch.bfloat16, CPU, kernels_every_isa, auto)
    if kernels_every_isa.bf16_pairs(2):  # AVX512-BF16 dot products in the build: its own pair-layout panels
        assert half is LinearKind.PANELS
    else:
        assert half is (LinearKind.ONEDNN if onednn_runs(torch.bfloat16, CPU) else LinearKind.PANELS)
    assert choose_linear(torch.bfloat16, CPU, None, auto) in (LinearKind.ONEDNN, LinearKind.PLAIN)
    assert choose_linear(torch.float32, CPU, None, auto) in (LinearKind.ONEDNN, LinearKind.PLAIN)
    assert choose_linear(torch.float32, torch.device("meta"), kernels_every_isa, auto) is LinearKind.PLAIN
    assert choose_linear(torch.float32, CPU, kernels_every_isa, EngineEnv(linear="plain")) is LinearKind.PLAIN
    with pytest.raises(ValueError, match="panels"):
        choose_linear(torch.float32, CPU, None, EngineEnv(linear="panels"))


def test_linear_env_switch() -> None:
    assert EngineEnv.from_environ({}).linear is None
    assert EngineEnv.from_environ({"PDSERVE_LINEAR": " Panels "}).linear == "panels"
    with pytest.raises(ValueError, match="PDSERVE_LINEAR"):
        EngineEnv.from_environ({"PDSERVE_LINEAR": "fast"})


def test_kernel_builds_run_the_vector_width_they_stand_for(kernels_every_isa) -> None:
    """Panels are two vectors wide: 16-float vectors (P = 32) in native AVX-512 builds and SIMDe's, else 8."""
    wide = kernels_every_isa.isa == "simde-avx512" or (
        kernels_every_isa.isa == "native" and "avx512f" in cpu_isa()["flags"]
    )
    assert kernels_every_isa.panel_width() == (32 if wide else 16)


def test_kernel_isas_to_check_follow_the_host(monkeypatch) -> None:
    isas = kernel_isas_to_check()
    assert isas[0] == "native" and len(set(isas)) == len(isas) and set(isas) <= set(KERNEL_ISAS)
    flags = set(cpu_isa()["flags"])  # type: ignore[call-overload]
    if cpu_isa()["machine"] == "x86_64":
        assert ("avx2" in isas) == ("avx512f" in flags)
        assert "generic" in isas
        # The test extras install SIMDe, so a host without AVX512-BF16 always checks those paths.
        assert ("simde-avx512" in isas) == ("avx512_bf16" not in flags)
    monkeypatch.setattr(cpu_kernels, "_simde_include", lambda: None)
    assert "simde-avx512" not in kernel_isas_to_check()


def test_kernel_isa_switch(monkeypatch) -> None:
    assert EngineEnv.from_environ({}).kernel_isa is None
    assert EngineEnv.from_environ({"PDSERVE_KERNEL_ISA": " SIMDe-AVX512 "}).kernel_isa == "simde-avx512"
    with pytest.raises(ValueError, match="PDSERVE_KERNEL_ISA must be one of native, avx2"):
        EngineEnv.from_environ({"PDSERVE_KERNEL_ISA": "avx1024"})
    with pytest.raises(ValueError, match="unknown kernel ISA"):
        cpu_kernels.load_cpu_kernels(cpu_kernels.kernel_cache_dir(), "avx1024")
    monkeypatch.setattr(cpu_kernels, "_simde_include", lambda: None)
    if cpu_isa()["machine"] == "x86_64":
        with pytest.raises(ValueError, match="pip install simde-py"):
            cpu_kernels.load_cpu_kernels(cpu_kernels.kernel_cache_dir(), "simde-avx512")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 33])
@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_gate_up_with_silu_mul_in_the_epilogue_equals_the_product_then_silu_mul(
    kernels_every_isa, dtype: torch.dtype, rows: int, quantization: str
) -> None:
    """A fused [gate; up] built with gate_up=True returns silu(gate) * up from the product's epilogue: what
    the plain-order product followed by the silu_mul kernel gives (bit for bit but for the product's ulp)."""
    inter = 3 * kernels_every_isa.panel_width()  # a multiple of half a panel: the fused path
    w, b, x = _case(2 * inter, 96, rows, dtype, bias=True)
    fused = Linear.build(w, b, LinearKind.PANELS, kernels_every_isa, quantization, gate_up=True)
    plain = Linear.build(w, b, LinearKind.PANELS, kernels_every_isa, quantization)
    assert fused.silu_mul and not plain.silu_mul
    got = fused(x)
    assert got.shape == (rows, inter) and got.dtype == dtype
    unfused = kernels_every_isa.silu_mul(plain(x))
    # Tiles of 1-3 rows split k over several accumulators, and -ffast-math may sum the splits in a different
    # order for the two halves of a panel: a column's float32 product can move by an ulp with its position in
    # the panel, which the gate/up order changes. Everything after the product is the same arithmetic.
    ulp = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[dtype]
    torch.testing.assert_close(got.float(), unfused.float(), rtol=2 * ulp, atol=1e-6)
    if quantization == "none":  # and both match the float32 reference to the dtype's rounding
        gu = F.linear(x.float(), w.float(), b.float()).to(dtype).float()
        _close(got, (F.silu(gu[:, :inter]) * gu[:, inter:]).to(dtype), dtype)


def test_gate_up_order_and_its_limits(kernels_every_isa) -> None:
    half = kernels_every_isa.panel_width() // 2
    order = kernels_every_isa.gate_up_panel_order(2 * half)
    assert order is not None
    assert order.tolist() == [
        *range(half),
        *range(2 * half, 3 * half),
        *range(half, 2 * half),
        *range(3 * half, 4 * half),
    ]
    assert kernels_every_isa.gate_up_panel_order(half + 1) is None
    w, _, x = _case(2 * (half + 1), 32, 4, torch.float32, bias=False)
    lin = Linear.build(
        w, None, LinearKind.PANELS, kernels_every_isa, gate_up=True
    )  # falls back: product, then silu_mul
    assert not lin.silu_mul and lin(x).shape == (4, 2 * (half + 1))
    packed = kernels_every_isa.pack_linear_weight(w)
    with pytest.raises(ValueError, match="silu_mul needs n a multiple"):
        kernels_every_isa.linear(x, packed, w.shape[0], None, silu_mul=True)
