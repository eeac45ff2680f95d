"""KV transfer of CUDA memory between processes over real UCX (``gpu``: skipped without a CUDA device).

Both peers hold SmolLM2-135M's KV layout on GPU 0 with UCX's CUDA transports; each transfer is checked
byte for byte on the decode side (through a host copy). Also a CUDA sender beside a host-memory receiver
of the same host, which offers cross-memory attach: the sender must not take it (it copies host memory
only), and its bytes must still land. Every process is stopped by its fixture, even when a test fails.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.testing import PeerProcess, PeerSpec, running_peers

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(240)]

CUDA_TLS = "tcp,cuda_copy,cuda_ipc,sm,self"
CALL_S = 60.0
BLOCK_BYTES = 2 * 16 * 3 * 64 * 2  # K and V of one bfloat16 block


def _spec(device: str, rma: bool, same_host: bool = False) -> PeerSpec:
    config = TransferConfig(deadline_s=30.0, same_host=same_host, rma=rma, rma_over_tcp=rma)
    return PeerSpec(num_blocks=160, config=config, env=(("UCX_TLS", CUDA_TLS),), device=device)


@pytest.fixture(params=["rma", "tagged"], scope="module")
def cuda_pair(request: pytest.FixtureRequest) -> Iterator[tuple[PeerProcess, PeerProcess]]:
    spec = _spec("cuda", rma=request.param == "rma")
    with running_peers([("decode-cuda", spec), ("prefill-cuda", spec)]) as (decode, prefill):
        yield decode, prefill


def _transfer(decode: PeerProcess, prefill: PeerProcess, rid: str, tokens: int, seed: int, **kw: int) -> str:
    """One checked transfer; returns how its KV moved (puts, cross_memory, tagged)."""
    ticket = decode.call("reserve", request_id=rid, num_tokens=tokens, keep_every=kw.pop("decode_keep", 0))
    out = prefill.call("transfer", ticket=ticket, seed=seed, first_token_id=seed + 1, timeout=CALL_S, **kw)
    assert out["bytes"] == 30 * -(-tokens // 16) * BLOCK_BYTES
    assert decode.call("wait", request_id=rid)["first_token_id"] == seed + 1
    assert decode.call("verify", request_id=rid, seed=seed), "received KV differs from the source"
    assert decode.call("release", request_id=rid)
    blocks = decode.call("blocks")
    assert blocks["free"] == blocks["total"]
    return str(out["path"])


@pytest.mark.parametrize("layout", ["contiguous", "scattered-both"])
def test_cuda_kv_arrives_bit_exact(cuda_pair: tuple[PeerProcess, PeerProcess], layout: str) -> None:
    decode, prefill = cuda_pair
    kw = {"decode_keep": 3, "keep_every": 2} if layout == "scattered-both" else {}
    path = _transfer(decode, prefill, f"cuda-{layout}", 1000, seed=31, **kw)
    assert path != "cross_memory"  # device memory is never written by process_vm_writev


def test_cuda_sender_to_a_host_receiver_does_not_use_cross_memory_attach() -> None:
    decode = _spec("cpu", rma=True, same_host=True)  # offers its pid: a host sender would use cma
    prefill = _spec("cuda", rma=True, same_host=True)
    with running_peers([("decode-cuda", decode), ("prefill-cuda", prefill)]) as (d, p):
        assert _transfer(d, p, "mixed", 1000, seed=41) != "cross_memory"
