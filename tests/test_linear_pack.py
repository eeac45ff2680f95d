"""Pre-packed matmul weights (``engine.weights.Linear.pack``) against the torch oracle, on this host's ISA.

oneDNN picks its kernel for the CPU it runs on (AVX2, AVX-512, AMX, NEON), so whichever path this host
takes is the one tested here; ``cpu_isa`` names it in the test ids' output when run with ``-s``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.cpu_kernels import cpu_isa
from pdserve.engine.env import EngineEnv
from pdserve.engine.weights import Linear, can_pack

CPU = torch.device("cpu")


def test_cpu_isa_names_the_host() -> None:
    info = cpu_isa()
    assert info["isa"] in {"amx_bf16", "avx512_bf16", "avx512f", "avx2", "asimd", "sve", "portable"}
    assert isinstance(info["flags"], list)
    print(info)


@pytest.mark.skipif(not can_pack(torch.float32, CPU, EngineEnv()), reason="oneDNN packing unavailable here")
@pytest.mark.parametrize("rows", [1, 3, 8, 33, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_float32_matches_f_linear(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 96, generator=g) * 0.1  # out, in: not multiples of any vector width
    b = torch.randn(200, generator=g) if bias else None
    x = torch.randn(rows, 96, generator=g)
    packed = Linear.pack(w, b)
    assert packed.packed and packed.out_features == 200
    got, want = packed(x), F.linear(x, w, b)
    assert got.shape == want.shape == (rows, 200)
    # Same products, summed in another order: float32 rounding apart, never more.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(
    not can_pack(torch.bfloat16, CPU, EngineEnv()), reason="oneDNN bfloat16 unavailable on this CPU"
)
def test_packed_bfloat16_is_bitwise_f_linear() -> None:
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(128, 64, generator=g) * 0.1).to(torch.bfloat16)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    assert torch.equal(Linear.pack(w)(x), F.linear(x, w))


def test_pack_linear_env_switch() -> None:
    assert EngineEnv.from_environ({}).pack_linear is None
    assert EngineEnv.from_environ({"PDSERVE_PACK_LINEAR": "0"}).pack_linear is False
    assert EngineEnv.from_environ({"PDSERVE_PACK_LINEAR": " On "}).pack_linear is True
    with pytest.raises(ValueError, match="PDSERVE_PACK_LINEAR"):
        EngineEnv.from_environ({"PDSERVE_PACK_LINEAR": "maybe"})
    off = EngineEnv(pack_linear=False)
    assert not can_pack(torch.float32, CPU, off)
    assert not can_pack(torch.bfloat16, CPU, off)
    # Never on a device oneDNN does not run on, whatever the switch says.
    assert not can_pack(torch.float32, torch.device("meta"), EngineEnv(pack_linear=True))
