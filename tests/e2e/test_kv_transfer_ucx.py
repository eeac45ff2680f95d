"""KV transfer over real UCX between processes on loopback (one-sided puts, which every
transfer here uses unless its transport is ``tcp-tagged``).

Peers are separate processes (kv_transfer.testing.PeerProcess) running uvloop,
with SmolLM2-135M's KV layout (30 layers, 3 KV heads, head dim 64, block 16).
Every fault test ends with a leak check on both sides; every process is
stopped (or killed) by its fixture even when a test fails.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from pdserve.kv_transfer.config import FaultConfig, TransferConfig
from pdserve.kv_transfer.testing import PeerCallError, PeerProcess, PeerSpec, running_peers
from pdserve.kv_transfer.wire import TransferTicket

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

CONFIG = TransferConfig(deadline_s=30.0, settle_timeout_s=1.0)
CALL_S = 60.0  # bound on any single command


# name -> (UCX_TLS, same_host: one-sided writes by cross-memory attach, one-sided writes at all)
TRANSPORTS = {
    "tcp": ("tcp", False, True),  # UCX's puts (emulated over tcp)
    "cma": ("tcp,sm,self", True, True),
    "tcp-tagged": ("tcp", False, False),
    "shm": ("tcp,sm,self", True, True),  # the decode side's KV in shared memory: plain copies into it
}


def spec(dtype: str = "bfloat16", num_blocks: int = 192, transport: str = "tcp") -> PeerSpec:
    tls, same_host, rma = TRANSPORTS[transport]
    config = replace(CONFIG, same_host=same_host, rma=rma, rma_over_tcp=rma)  # puts also over tcp
    env = (("UCX_TLS", tls),)
    return PeerSpec(dtype=dtype, num_blocks=num_blocks, config=config, env=env, kv_shared=transport == "shm")


def assert_no_leak(*peers: PeerProcess) -> None:
    for peer in peers:
        blocks = peer.call("blocks", timeout=CALL_S)
        assert blocks["free"] == blocks["total"], (
            f"{peer.name}: {blocks['total'] - blocks['free']} blocks leaked"
        )


def settle_timeouts(peer: PeerProcess) -> float:
    """The peer's count of transfers whose sends or receives it cancelled after the settle timeout."""
    metrics = peer.call("metrics")
    counts = re.findall(r"^pdserve_kv_transfer_settle_timeouts_total\{[^}]*\} (\S+)$", metrics, re.M)
    return sum(map(float, counts))


def wait_free(peer: PeerProcess, within_s: float) -> None:
    """Poll until every block of ``peer`` is free, for at most ``within_s`` seconds."""
    end = time.monotonic() + within_s
    while True:
        blocks = peer.call("blocks", timeout=CALL_S)
        if blocks["free"] == blocks["total"]:
            return
        if time.monotonic() > end:
            raise AssertionError(f"{peer.name}: {blocks['total'] - blocks['free']} blocks still held")
        time.sleep(0.05)


def wait_drained(decode: PeerProcess, within_s: float = 5.0) -> None:
    """Poll until the receiver drains no refused transfer into scratch memory any more."""
    end = time.monotonic() + within_s
    while decode.call("blocks")["draining"]:
        assert time.monotonic() < end, "the drain of the refused transfer never ended"
        time.sleep(0.02)


def wait_progress(prefill: PeerProcess, request_id: str, layers: int) -> None:
    """Until the sender has sent ``layers`` layers (puts leave no count at the receiver)."""
    end = time.monotonic() + 30
    while prefill.call("sent", request_id=request_id) < layers:
        assert time.monotonic() < end, "the transfer never got going"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def bf16() -> Iterator[tuple[PeerProcess, PeerProcess, PeerProcess]]:
    """Two decode receivers and one prefill sender, bfloat16."""
    sizes = {"decode-a": 256, "decode-b": 256, "prefill": 512}  # 32 transfers in flight at once
    with running_peers([(name, spec(num_blocks=n)) for name, n in sizes.items()], receivers=2) as peers:
        yield peers[0], peers[1], peers[2]


@pytest.fixture(scope="module")
def fp32() -> Iterator[tuple[PeerProcess, PeerProcess]]:
    with running_peers([(name, spec("float32", 160)) for name in ("decode-f32", "prefill-f32")]) as peers:
        yield peers[0], peers[1]


def _transport_pair(transport: str) -> Iterator[tuple[PeerProcess, PeerProcess]]:
    """A decode and a prefill process on ``transport``, its data path checked before it is handed out."""
    peer_spec = spec(num_blocks=96, transport=transport)
    with running_peers([(n, peer_spec) for n in ("decode-x", "prefill-x")]) as peers:
        # The data path of this transport works before we break it.
        transfer(peers[0], peers[1], "warm", 1000, seed=21)
        yield peers[0], peers[1]


@pytest.fixture(params=list(TRANSPORTS))
def fresh(request: pytest.FixtureRequest) -> Iterator[tuple[PeerProcess, PeerProcess]]:
    """A decode and a prefill process of their own, for tests that kill one; TCP or shared memory."""
    yield from _transport_pair(request.param)


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[PeerProcess, PeerProcess]]:
    """A decode and a prefill process per transport, shared by the tests that abort, refuse or revoke
    transfers but kill nothing; each of them ends with both sides' leak check, so the next one starts
    with every block free."""
    yield from _transport_pair(request.param)


def transfer(
    decode: PeerProcess, prefill: PeerProcess, rid: str, tokens: int, seed: int, **kw: object
) -> None:
    keep = kw.pop("decode_keep", 0)
    ticket = decode.call("reserve", request_id=rid, num_tokens=tokens, keep_every=keep, track=True)
    out = prefill.call("transfer", ticket=ticket, seed=seed, first_token_id=seed + 1, timeout=CALL_S, **kw)
    assert out["bytes"] == 30 * -(-tokens // 16) * decode_block_bytes(decode)
    done = decode.call("wait", request_id=rid)
    assert done["first_token_id"] == seed + 1
    assert done["landed_at"] > out["started_at"]  # one clock on one host (the benchmark subtracts them)
    assert decode.call("verify", request_id=rid, seed=seed), "received KV differs from the source"
    assert decode.call("release", request_id=rid)


def assert_every_block_holds_only_new_bytes(
    decode: PeerProcess, prefill: PeerProcess, rid: str, total: int, seed: int
) -> None:
    """A request taking every block of ``decode`` (an ended transfer's included) gets exactly its own
    bytes, also once an old sender's forward had time to push its remaining layers; then no leak."""
    ticket = decode.call("reserve", request_id=rid, num_tokens=total * 16)
    prefill.call("transfer", ticket=ticket, seed=seed, timeout=CALL_S)
    decode.call("wait", request_id=rid)
    time.sleep(0.3)  # longer than an old forward's remaining layers would take to be pushed
    assert decode.call("verify", request_id=rid, seed=seed), "bytes of an ended transfer landed"
    assert decode.call("release", request_id=rid)
    assert_no_leak(decode, prefill)


_BLOCK_BYTES = {"bfloat16": 2 * 16 * 3 * 64 * 2, "float32": 2 * 16 * 3 * 64 * 4}


def decode_block_bytes(decode: PeerProcess) -> int:
    return _BLOCK_BYTES["float32" if decode.name.endswith("f32") else "bfloat16"]


@pytest.mark.parametrize("layout", ["contiguous", "scattered-decode", "scattered-both"])
def test_1000_tokens_bit_exact_bf16(bf16: tuple[PeerProcess, ...], layout: str) -> None:
    decode, _, prefill = bf16
    kw = {
        "contiguous": {},
        "scattered-decode": {"decode_keep": 3},
        "scattered-both": {"decode_keep": 3, "keep_every": 2},
    }
    transfer(decode, prefill, f"bit-{layout}", 1000, seed=11, **kw[layout])
    assert_no_leak(decode, prefill)


@pytest.mark.parametrize("layout", ["contiguous", "scattered-both"])
def test_1000_tokens_bit_exact_fp32(fp32: tuple[PeerProcess, PeerProcess], layout: str) -> None:
    decode, prefill = fp32
    kw = {"contiguous": {}, "scattered-both": {"decode_keep": 2, "keep_every": 3}}
    transfer(decode, prefill, f"f32-{layout}", 1000, seed=12, **kw[layout])
    assert_no_leak(decode, prefill)


def test_layers_pushed_together_land_bit_exact(pair: tuple[PeerProcess, PeerProcess]) -> None:
    """``push_layers`` (a prefill under a CUDA graph pushes every layer at once): one call per group of
    layers on each path (UCX puts, cross-memory writes, tagged messages), scattered blocks on both sides."""
    decode, prefill = pair
    for burst in (30, 7):  # all at once; groups of 7 and the 2 left
        transfer(
            decode, prefill, f"burst-{burst}", 600, seed=31 + burst, decode_keep=3, keep_every=2, burst=burst
        )
    assert_no_leak(decode, prefill)


def test_a_shared_kv_cache_is_written_by_plain_copies() -> None:
    """A decode side whose KV is in shared memory (``--kv-shared-memory``) is written by plain copies into
    its memfd, bit-exact, scattered blocks included; a host-memory decode side without it by cross-memory
    attach. (Kills, aborts and revokes run on this path too: the ``fresh`` and ``pair`` fixtures' "shm".)"""
    peers = [("decode-shm", spec(num_blocks=160, transport="shm")), ("prefill-shm", spec(transport="cma"))]
    with running_peers(peers) as (decode, prefill):
        for rid, kw in (("c", {}), ("s", {"keep_every": 2})):
            ticket = decode.call("reserve", request_id=rid, num_tokens=1000, keep_every=3 if kw else 0)
            out = prefill.call("transfer", ticket=ticket, seed=71, timeout=CALL_S, **kw)
            assert out["path"] == "shared_memory"
            decode.call("wait", request_id=rid)
            assert decode.call("verify", request_id=rid, seed=71), "received KV differs from the source"
            assert decode.call("release", request_id=rid)
        assert_no_leak(decode, prefill)


def test_32_concurrent_transfers_to_two_receivers(bf16: tuple[PeerProcess, ...]) -> None:
    decode_a, decode_b, prefill = bf16
    calls = []
    for i in range(32):
        decode = (decode_a, decode_b)[i % 2]
        tokens = 40 + 37 * (i % 5)
        ticket = decode.call(
            "reserve", request_id=f"c{i}", num_tokens=tokens, keep_every=3 if i % 4 == 0 else 0
        )
        kw = {"keep_every": 2} if i % 3 == 0 else {}
        calls.append(
            (decode, i, prefill.submit("transfer", ticket=ticket, seed=100 + i, first_token_id=i, **kw))
        )
    for decode, i, call in calls:
        prefill.result(call, timeout=CALL_S)
        assert decode.call("wait", request_id=f"c{i}")["first_token_id"] == i
        assert decode.call("verify", request_id=f"c{i}", seed=100 + i), f"transfer {i} differs"
        decode.call("release", request_id=f"c{i}")
    assert_no_leak(decode_a, decode_b, prefill)


def test_kill_sender_mid_transfer(fresh: tuple[PeerProcess, PeerProcess]) -> None:
    decode, prefill = fresh
    ticket = decode.call("reserve", request_id="k", num_tokens=500)
    prefill.submit("transfer", ticket=ticket, seed=1, layer_interval_s=0.1)
    wait_progress(prefill, "k", 3)
    prefill.kill()
    with pytest.raises(PeerCallError) as err:
        decode.call("wait", request_id="k", timeout=5)  # from UCX's endpoint error: the deadline is 30 s away
    assert err.value.kind == "PeerDiedError"
    wait_free(decode, within_s=5.0)
    assert_no_leak(decode)
    wait_no_control_requests(decode)  # the dead sender's connection: its posted receive was cancelled


def wait_no_control_requests(peer: PeerProcess, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while (left := peer.call("control_requests")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == 0, f"{left} control-frame requests of a broken connection were never freed"


@pytest.mark.parametrize(
    ("tls", "segment", "same_host", "rma", "rma_over_tcp", "path"),
    [
        ("tcp", "", False, True, None, "puts"),
        ("tcp", "8K", False, True, None, "tagged"),
        ("tcp", "", False, True, False, "tagged"),
        ("tcp", "8K", False, True, True, "puts"),
        ("tcp,sm,self", "", True, True, False, "cross_memory"),
        ("tcp,sm,self", "", True, False, None, "tagged"),
    ],
    ids=[
        "tcp-default-puts",
        "tcp-8k-segments-tagged",
        "tcp-puts-off",
        "tcp-puts-forced",
        "one-host-cma",
        "no-rma",
    ],
)
def test_puts_over_tcp_follow_the_segment_size_unless_told(
    tls: str, segment: str, same_host: bool, rma: bool, rma_over_tcp: bool | None, path: str
) -> None:
    """A connection whose every UCX lane is tcp moves KV by puts with pdserve's 64 KB tcp segments and
    as tagged messages with UCX's own 8 KB ones (each put then goes as ~100 fragments per layer,
    measured slower); ``rma_over_tcp`` (a worker's --kv-puts always / never) overrides either way;
    cross-memory writes on one host are unaffected; with rma off everything is tagged. The sender's
    metrics say which path ran."""
    config = replace(CONFIG, same_host=same_host, rma=rma, rma_over_tcp=rma_over_tcp)
    env = (("UCX_TLS", tls), *((("UCX_TCP_TX_SEG_SIZE", segment),) if segment else ()))
    peers = [
        PeerProcess(PeerSpec(num_blocks=96, config=config, env=env), n) for n in ("decode-m", "prefill-m")
    ]
    try:
        decode, prefill = peers
        decode.call("start_receiver", timeout=120)
        ticket = decode.call("reserve", request_id="m", num_tokens=200)
        out = prefill.call("transfer", ticket=ticket, seed=5, first_token_id=6, timeout=CALL_S)
        assert out["rma"] is (path != "tagged")
        metrics = prefill.call("metrics")
        for p in ("puts", "cross_memory", "tagged"):
            want = 1.0 if p == path else 0.0
            assert f'pdserve_kv_transfer_opened_total{{path="{p}",role="prefill"}} {want}' in metrics, metrics
        assert decode.call("wait", request_id="m")["first_token_id"] == 6
        assert decode.call("verify", request_id="m", seed=5), "received KV differs from the source"
        assert decode.call("release", request_id="m")
        assert_no_leak(decode, prefill)
    finally:
        for p in peers:
            p.stop()


def test_puts_are_reported_to_the_receiver_while_a_long_forward_runs(
    bf16: tuple[PeerProcess, PeerProcess, PeerProcess],
) -> None:
    """One-sided puts leave no trace at the receiver before Complete: the sender reports how many layers
    it has put (wire.Progress, at most every PROGRESS_INTERVAL_S), which the decode worker's stall watch
    reads, so a forward longer than the stall timeout is not taken for a hung prefill."""
    decode, _, prefill = bf16
    ticket = decode.call("reserve", request_id="prog", num_tokens=200)
    call = prefill.submit("transfer", ticket=ticket, seed=8, first_token_id=9, layer_interval_s=0.06)
    seen: list[int] = []
    end = time.monotonic() + 30
    while prefill.call("sent", request_id="prog") < 30 and time.monotonic() < end:
        seen.append(decode.call("progress", request_id="prog"))
        time.sleep(0.05)
    out = prefill.result(call, timeout=CALL_S)
    assert out["rma"], "the bf16 pair moves KV by puts"
    reported = sorted(set(seen) - {0})
    assert len(reported) >= 2 and reported[-1] < 30, f"progress seen before the last layer: {reported}"
    assert seen == sorted(seen), "progress only grows"
    assert decode.call("wait", request_id="prog")["first_token_id"] == 9
    assert decode.call("verify", request_id="prog", seed=8)
    assert decode.call("release", request_id="prog")
    assert_no_leak(decode, prefill)


def test_kill_receiver_mid_transfer(fresh: tuple[PeerProcess, PeerProcess]) -> None:
    decode, prefill = fresh
    ticket = decode.call("reserve", request_id="k", num_tokens=500)
    call = prefill.submit("transfer", ticket=ticket, seed=1, layer_interval_s=0.1)
    wait_progress(prefill, "k", 3)
    decode.kill()
    with pytest.raises(PeerCallError) as err:
        prefill.result(call, timeout=5)
    assert err.value.kind == "PeerDiedError"
    assert_no_leak(prefill)
    wait_no_control_requests(prefill)


@pytest.mark.parametrize("mismatch", ["hash", "version"])
def test_mismatch_is_a_clear_error_and_writes_nothing(
    bf16: tuple[PeerProcess, ...], fp32: tuple[PeerProcess, PeerProcess], mismatch: str
) -> None:
    decode, _, prefill_bf16 = bf16
    _, prefill_fp32 = fp32
    ticket = decode.call("reserve", request_id=f"mm-{mismatch}", num_tokens=300)
    if mismatch == "hash":  # a float32 sender against a bfloat16 receiver
        call = prefill_fp32.submit("transfer", ticket=ticket, seed=3)
        prefill = prefill_fp32
    else:
        call = prefill_bf16.submit("transfer", ticket=ticket, seed=3, protocol_version=99)
        prefill = prefill_bf16
    with pytest.raises(PeerCallError) as err:
        prefill.result(call, timeout=CALL_S)
    assert err.value.kind == "IncompatibleError"
    assert ("hash" if mismatch == "hash" else "protocol version") in str(err.value)
    with pytest.raises(PeerCallError) as err:
        decode.call("wait", request_id=f"mm-{mismatch}", timeout=10)
    assert err.value.kind == "IncompatibleError"
    assert decode.call("untouched", request_id=f"mm-{mismatch}")
    assert_no_leak(decode, prefill)


def test_deadline_expiry_frees_the_reservation(bf16: tuple[PeerProcess, ...]) -> None:
    decode, _, prefill = bf16
    # No sender ever comes.
    decode.call("reserve", request_id="dl-idle", num_tokens=200, deadline_s=0.5)
    with pytest.raises(PeerCallError) as err:
        decode.call("wait", request_id="dl-idle", timeout=10)
    assert err.value.kind == "DeadlineError"
    # A sender that loses a layer on the way.
    ticket = decode.call("reserve", request_id="dl-drop", num_tokens=200, deadline_s=1.0)
    faults = FaultConfig(drop_layers=frozenset({7}))
    with pytest.raises(PeerCallError) as err:
        prefill.call("transfer", ticket=ticket, seed=4, faults=faults, timeout=CALL_S)
    assert err.value.kind == "DeadlineError"
    with pytest.raises(PeerCallError) as err:
        decode.call("wait", request_id="dl-drop", timeout=10)
    assert err.value.kind == "DeadlineError"
    wait_free(decode, within_s=5.0)
    assert_no_leak(decode, prefill)


def test_abort_from_decode(bf16: tuple[PeerProcess, ...]) -> None:
    decode, _, prefill = bf16
    ticket = decode.call("reserve", request_id="ab-d", num_tokens=400)
    call = prefill.submit("transfer", ticket=ticket, seed=5, layer_interval_s=0.05)
    wait_progress(prefill, "ab-d", 2)
    assert decode.call("abort", request_id="ab-d", reason="client cancelled")
    with pytest.raises(PeerCallError) as err:
        prefill.result(call, timeout=CALL_S)
    assert err.value.kind == "AbortedError" and "client cancelled" in str(err.value)
    with pytest.raises(PeerCallError) as err:
        decode.call("wait", request_id="ab-d", timeout=10)
    assert err.value.kind == "AbortedError"
    wait_free(decode, within_s=5.0)
    assert_no_leak(decode, prefill)


def test_abort_from_prefill(bf16: tuple[PeerProcess, ...]) -> None:
    decode, _, prefill = bf16
    ticket = decode.call("reserve", request_id="ab-p", num_tokens=400)
    assert prefill.call("transfer", ticket=ticket, seed=6, abort_after_layers=5, timeout=CALL_S) == {
        "aborted": True
    }
    with pytest.raises(PeerCallError) as err:
        decode.call("wait", request_id="ab-p", timeout=10)
    assert err.value.kind == "AbortedError"
    wait_free(decode, within_s=5.0)
    assert_no_leak(decode, prefill)
    metrics = decode.call("metrics")
    assert 'pdserve_kv_transfer_failures_total{reason="aborted",role="decode"}' in metrics


def test_refused_open_with_data_already_pushed(
    pair: tuple[PeerProcess, PeerProcess], request: pytest.FixtureRequest
) -> None:
    """Tagged: the sender pushes right after Open (no round trip): when the reservation is
    already gone, its messages wait in UCX until the receiver refuses and drains them into
    scratch memory, and no KV block is written. RMA: the ticket is newer than the connection,
    so the sender puts at once too; the receiver revoked it and holds its blocks until the
    sender's AbortAck (after its flush), so whatever landed landed in blocks nobody else had
    (test_aborted_blocks_reused_at_once_hold_none_of_the_old_kv checks the reuse).
    Either way the sender learns at once (no settle timeout)."""
    decode, prefill = pair
    timeouts_before = settle_timeouts(prefill), settle_timeouts(decode)
    ticket = decode.call("reserve", request_id="refused", num_tokens=600)
    assert decode.call("abort", request_id="refused", reason="client cancelled")
    with pytest.raises(PeerCallError) as err:
        prefill.call("transfer", ticket=ticket, seed=8, timeout=CALL_S)
    assert err.value.kind == "AbortedError" and "client cancelled" in str(err.value)
    if not TRANSPORTS[request.node.callspec.params["pair"]][2]:
        assert decode.call("untouched", request_id="refused")
    wait_free(decode, within_s=CONFIG.settle_timeout_s + 10.0)
    wait_drained(decode)
    # Neither side had to give up waiting on a send or a receive (a count, not a clock: hosts are slow).
    timeouts_after = settle_timeouts(prefill), settle_timeouts(decode)
    assert timeouts_after == timeouts_before, "sends waited for a timeout"
    assert_no_leak(decode, prefill)
    transfer(decode, prefill, "after-refused", 600, seed=9)  # the connection is still good


def test_second_sender_of_a_ticket_never_writes(bf16: tuple[PeerProcess, ...]) -> None:
    """Data tags carry the receiver's id for the sending connection: a second sender holding
    the same ticket is refused, and its bytes (pushed at once) never reach the blocks."""
    decode, _, prefill = bf16
    ticket = decode.call("reserve", request_id="twice", num_tokens=400)
    first = prefill.submit("transfer", ticket=ticket, seed=10, first_token_id=11, layer_interval_s=0.05)
    wait_progress(prefill, "twice", 2)
    with pytest.raises(PeerCallError) as err:
        prefill.call("transfer", ticket=ticket, seed=99, sender_name="second", timeout=CALL_S)
    assert err.value.kind == "RejectedError"
    prefill.result(first, timeout=CALL_S)
    assert decode.call("wait", request_id="twice")["first_token_id"] == 11
    assert decode.call("verify", request_id="twice", seed=10), "the second sender's bytes landed"
    assert decode.call("release", request_id="twice")
    wait_drained(decode)
    assert_no_leak(decode, prefill)


def test_aborted_blocks_reused_at_once_hold_none_of_the_old_kv(
    pair: tuple[PeerProcess, PeerProcess],
) -> None:
    """One-sided writes' danger: a put still in flight after an abort lands in blocks that
    already belong to the next request. The receiver frees an aborted transfer's blocks only
    once the sender flushed and said it stopped; the next request, which takes every block
    (the aborted one's included) at once, then holds its own bytes and nothing else, also
    after the old sender's forward has gone on pushing layers."""
    decode, prefill = pair
    total = decode.call("blocks")["total"]
    ticket = decode.call("reserve", request_id="old", num_tokens=500)
    old = prefill.submit("transfer", ticket=ticket, seed=31, layer_interval_s=0.02)
    wait_progress(prefill, "old", 4)
    assert decode.call("abort", request_id="old", reason="client cancelled")
    wait_free(decode, within_s=5.0)  # at once: the sender's AbortAck follows its flush
    with pytest.raises(PeerCallError) as err:
        prefill.result(old, timeout=CALL_S)
    assert err.value.kind == "AbortedError"
    assert_every_block_holds_only_new_bytes(decode, prefill, "new", total, seed=32)


def test_revoke_waits_for_a_sender_that_does_not_answer(bf16: tuple[PeerProcess, ...]) -> None:
    """A reservation that ends before any Open is revoked on every connection older than it (each
    may be putting into it already, without an Accept). Here one is: its Open is delayed, and it
    ignores the revoke and goes on putting. The receiver closes that connection after the settle
    timeout and holds the blocks one more; a request that then takes every block holds its own
    bytes only."""
    decode, _, prefill = bf16
    probe = decode.call("reserve", request_id="rv-probe", num_tokens=16)
    address = TransferTicket.decode(probe).address
    assert decode.call("abort", request_id="rv-probe")
    wait_free(decode, within_s=5.0)
    total = decode.call("blocks")["total"]
    frozen = FaultConfig(ignore_revokes=True, open_delay_s=30.0)
    prefill.call("connect", address=address, faults=frozen, sender_name="frozen", timeout=CALL_S)
    ticket = decode.call("reserve", request_id="rv", num_tokens=300)
    old = prefill.submit(
        "transfer", ticket=ticket, seed=41, faults=frozen, sender_name="frozen", layer_interval_s=0.05
    )
    wait_progress(prefill, "rv", 2)
    timeouts_before = settle_timeouts(decode)
    t0 = time.monotonic()
    assert decode.call("abort", request_id="rv", reason="client cancelled")
    wait_free(decode, within_s=4 * CONFIG.settle_timeout_s + 5.0)
    held = time.monotonic() - t0
    assert held >= 2 * CONFIG.settle_timeout_s * 0.95, f"freed after {held:.2f}s, before the sender stopped"
    assert settle_timeouts(decode) == timeouts_before + 1  # the receiver gave up on the silent sender
    with pytest.raises(PeerCallError) as err:
        prefill.result(old, timeout=CALL_S)
    assert err.value.kind == "PeerDiedError"  # its connection was closed under it
    assert_every_block_holds_only_new_bytes(decode, prefill, "rv-new", total, seed=42)


@pytest.mark.parametrize("pair", ["tcp", "cma", "shm"], indirect=True)
def test_revoked_while_eager_puts_land_then_reused_at_once(pair: tuple[PeerProcess, PeerProcess]) -> None:
    """The race eager puts open: the sender is putting into a reservation whose Open has not
    reached the receiver (delayed here) when the receiver aborts it. The revoke reaches the
    sender, which stops, flushes and acks; only then are the blocks freed, so a request that
    takes every block at once holds its own bytes only, also after the old forward pushed on."""
    decode, prefill = pair
    total = decode.call("blocks")["total"]
    address = TransferTicket.decode(decode.call("reserve", request_id="race-probe", num_tokens=16)).address
    assert decode.call("abort", request_id="race-probe")
    wait_free(decode, within_s=5.0)
    slow = FaultConfig(open_delay_s=0.5)
    prefill.call("connect", address=address, faults=slow, sender_name="slow-open", timeout=CALL_S)
    ticket = decode.call("reserve", request_id="race", num_tokens=500)
    old = prefill.submit(
        "transfer", ticket=ticket, seed=51, faults=slow, sender_name="slow-open", layer_interval_s=0.02
    )
    wait_progress(prefill, "race", 4)
    assert decode.call("abort", request_id="race", reason="client cancelled")
    with pytest.raises(PeerCallError) as err:
        prefill.result(old, timeout=CALL_S)
    assert err.value.kind == "AbortedError"
    wait_free(decode, within_s=5.0)
    assert_every_block_holds_only_new_bytes(decode, prefill, "race-new", total, seed=52)
