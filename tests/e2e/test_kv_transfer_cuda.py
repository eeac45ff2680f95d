"""KV transfer of CUDA memory between processes (``gpu``: skipped without a CUDA device).

Both peers hold SmolLM2-135M's KV layout on GPU 0 with UCX's CUDA transports; each transfer is checked
byte for byte on the decode side (through a host copy). Through UCX (``same_host`` off: puts or tagged
messages), and on one host by CUDA IPC (writers/cuda_ipc.py), where one-sided writes also meet an
abort with the blocks reused at once, and either peer killed mid-transfer. Also a CUDA sender beside a
host-memory receiver of the same host, which offers cross-memory attach: the sender must not take it (it
copies host memory only), and its bytes must still land. Every process is stopped by its fixture, even
when a test fails.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.testing import PeerCallError, PeerProcess, PeerSpec, running_peers
from tests.e2e.test_kv_transfer_ucx import (
    assert_every_block_holds_only_new_bytes,
    assert_no_leak,
    wait_free,
    wait_progress,
)

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


@pytest.fixture
def ipc_pair() -> Iterator[tuple[PeerProcess, PeerProcess]]:
    """A decode and a prefill process of their own on one GPU, one host: CUDA IPC writes."""
    spec = _spec("cuda", rma=True, same_host=True)
    with running_peers([("decode-ipc", spec), ("prefill-ipc", spec)]) as (decode, prefill):
        yield decode, prefill


def test_cuda_ipc_kv_arrives_bit_exact_then_an_abort_frees_blocks_reused_at_once(
    ipc_pair: tuple[PeerProcess, PeerProcess],
) -> None:
    decode, prefill = ipc_pair
    assert _transfer(decode, prefill, "ipc-c", 1000, seed=51) == "cuda_ipc"
    assert _transfer(decode, prefill, "ipc-s", 1000, seed=52, decode_keep=3, keep_every=2) == "cuda_ipc"
    # Layers pushed together (a prefill under a CUDA graph): one 2D copy per run for all 30, then 7 at a time.
    for burst in (30, 7):
        kw = {"decode_keep": 3, "keep_every": 2, "burst": burst}
        assert _transfer(decode, prefill, f"ipc-b{burst}", 1000, seed=55 + burst, **kw) == "cuda_ipc"
    total = decode.call("blocks")["total"]
    ticket = decode.call("reserve", request_id="old", num_tokens=500)
    old = prefill.submit("transfer", ticket=ticket, seed=53, layer_interval_s=0.02)
    wait_progress(prefill, "old", 4)
    assert decode.call("abort", request_id="old", reason="client cancelled")
    wait_free(decode, within_s=5.0)  # the sender flushed its copies before it said it stopped
    with pytest.raises(PeerCallError) as err:
        prefill.result(old, timeout=CALL_S)
    assert err.value.kind == "AbortedError"
    assert_every_block_holds_only_new_bytes(decode, prefill, "new", total, seed=54)
    assert_no_leak(decode, prefill)


@pytest.mark.parametrize("victim", ["decode", "prefill"])
def test_cuda_ipc_peer_killed_mid_transfer(ipc_pair: tuple[PeerProcess, PeerProcess], victim: str) -> None:
    """kill -9 of either side while copies go into the decode side's memory: the survivor gets a
    PeerDiedError and strands no block."""
    decode, prefill = ipc_pair
    assert _transfer(decode, prefill, "warm", 200, seed=61) == "cuda_ipc"
    ticket = decode.call("reserve", request_id="k", num_tokens=500)
    call = prefill.submit("transfer", ticket=ticket, seed=62, layer_interval_s=0.1)
    wait_progress(prefill, "k", 3)
    if victim == "decode":
        decode.kill()
        with pytest.raises(PeerCallError) as err:
            prefill.result(call, timeout=10)
        assert err.value.kind == "PeerDiedError"
        assert_no_leak(prefill)
    else:
        prefill.kill()
        with pytest.raises(PeerCallError) as err:
            decode.call("wait", request_id="k", timeout=10)
        assert err.value.kind == "PeerDiedError"
        wait_free(decode, within_s=5.0)
        assert_no_leak(decode)
