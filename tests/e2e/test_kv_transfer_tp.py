"""KV transfer between tensor-parallel groups of different sizes (``kv_transfer.split``) over real UCX
between processes on loopback: each peer holds a group's rank caches (4 KV heads split 1, 2 or 4 ways;
``PeerSpec.tp_size``) and every head lands, bit-exact, in the decode ranks that hold it, by cross-memory
writes, plain copies into shared memory, or UCX puts over tcp; a connection without one-sided writes is
refused with a clear error. Writes per layer stay at most (source ranks x destination ranks x runs)
whatever the prompt's length. Every case ends with both sides' leak check."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.testing import PeerCallError, PeerProcess, PeerSpec, running_peers
from pdserve.kv_transfer.tp_plan import dst_runs
from pdserve.kv_transfer.wire import TransferTicket

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

CALL_S = 60.0
CONFIG = TransferConfig(deadline_s=30.0, settle_timeout_s=1.0)
SHAPE = {"num_layers": 4, "num_kv_heads": 4, "head_dim": 16, "num_blocks": 128, "dtype": "float32"}
TRANSPORTS = {  # name -> (UCX_TLS, same host, one-sided writes)
    "cma": ("tcp,sm,self", True, True),
    "tcp": ("tcp", False, True),  # UCX's puts, emulated over tcp
    "tagged": ("tcp", False, False),
}


def tp_spec(tp: int, transport: str = "cma", kv_shared: bool = False) -> PeerSpec:
    tls, same_host, rma = TRANSPORTS[transport]
    config = replace(CONFIG, same_host=same_host, rma=rma, rma_over_tcp=rma)
    return PeerSpec(**SHAPE, config=config, env=(("UCX_TLS", tls),), tp_size=tp, kv_shared=kv_shared)


@pytest.fixture(scope="module")
def peers() -> Iterator[dict[str, PeerProcess]]:
    specs = {
        "decode-1": tp_spec(1),
        "decode-2": tp_spec(2),
        "decode-2-shm": tp_spec(2, kv_shared=True),
        "decode-1-tcp": tp_spec(1, "tcp"),
        "prefill-1": tp_spec(1),
        "prefill-2": tp_spec(2),
        "prefill-4": tp_spec(4),
        "prefill-2-tcp": tp_spec(2, "tcp"),
        "prefill-2-tagged": tp_spec(2, "tagged"),
    }
    with running_peers(list(specs.items()), receivers=4) as procs:
        yield dict(zip(specs, procs, strict=True))


def assert_no_leak(*peers: PeerProcess, within_s: float = 10.0) -> None:
    """Every block of each peer free, polled (bounded): a failed reservation's blocks wait for the revoke's
    answer from every connection that may write it eagerly (docs/kv_transfer.md, "Eager writers")."""
    for peer in peers:
        end = time.monotonic() + within_s
        while (blocks := peer.call("blocks", timeout=CALL_S))["free"] != blocks["total"]:
            assert time.monotonic() < end, f"{peer.name}: {blocks['total'] - blocks['free']} leaked"
            time.sleep(0.05)


def move(decode: PeerProcess, prefill: PeerProcess, rid: str, tokens: int, seed: int, keep: int) -> dict:
    ticket = decode.call("reserve", request_id=rid, num_tokens=tokens, keep_every=keep)
    out = prefill.call("transfer", ticket=ticket, seed=seed, timeout=CALL_S)
    decode.call("wait", request_id=rid, timeout=CALL_S)
    assert decode.call("verify", request_id=rid, seed=seed), f"{rid}: a head landed wrong"
    assert decode.call("release", request_id=rid)
    out["runs"] = len(dst_runs(TransferTicket.decode(ticket).block_ids))
    return out


@pytest.mark.parametrize(
    "prefill,decode,path",
    [
        ("prefill-2", "decode-1", "cross_memory"),
        ("prefill-1", "decode-2", "cross_memory"),
        ("prefill-2", "decode-2", "cross_memory"),
        ("prefill-4", "decode-2", "cross_memory"),
        ("prefill-4", "decode-1", "cross_memory"),
        ("prefill-2", "decode-2-shm", "shared_memory"),
        ("prefill-2-tcp", "decode-1-tcp", "puts"),
    ],
)
def test_every_head_lands_in_its_ranks_in_few_writes(peers, prefill, decode, path):
    """A decode pool whose free blocks were scattered (runs of 2) against a contiguous prefill source, then
    a prompt twice as long: writes per layer follow the destination's runs, not the prompt's length."""
    p, d = peers[prefill], peers[decode]
    p_ranks, d_ranks = int(prefill.split("-")[1]), int(decode.split("-")[1])
    scattered = move(d, p, f"{prefill}>{decode}-s", 300, seed=5, keep=3)
    assert scattered["path"] == path and scattered["rma"]
    sources = min(p_ranks, 4)  # a replicated head is sent by its first holder only
    assert scattered["runs"] > 1
    assert scattered["writes_per_layer"] <= sources * d_ranks * scattered["runs"]
    assert scattered["messages"] == SHAPE["num_layers"] * scattered["writes_per_layer"]
    longer = move(d, p, f"{prefill}>{decode}-l", 600, seed=6, keep=0)
    assert longer["writes_per_layer"] <= sources * d_ranks * longer["runs"]
    print(
        f"\n{prefill} -> {decode} ({path}): {scattered['writes_per_layer']} writes a layer over "
        f"{scattered['runs']} runs (300 tokens), {longer['writes_per_layer']} over {longer['runs']} (600)"
    )
    assert_no_leak(p, d)


def test_a_group_without_one_sided_writes_is_refused_clearly(peers):
    decode, prefill = peers["decode-1-tcp"], peers["prefill-2-tagged"]
    ticket = decode.call("reserve", request_id="tagged", num_tokens=100)
    with pytest.raises(PeerCallError) as err:
        prefill.call("transfer", ticket=ticket, seed=3, timeout=CALL_S)
    assert err.value.kind == "IncompatibleError"
    assert "tensor-parallel KV (2 prefill ranks, 1 decode ranks) moves by one-sided writes only" in str(
        err.value
    )
    with pytest.raises(PeerCallError):
        decode.call("wait", request_id="tagged", timeout=10)
    assert_no_leak(decode, prefill)
