"""Sender/receiver logic over the in-process transport: lifecycle, aborts, deadlines,
mismatches, peer death, scattered blocks, concurrency, metrics. Every test ends
with a leak check on both sides."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import pytest
import torch
import uvloop
from prometheus_client import CollectorRegistry

from pdserve.engine.block_manager import BlockManager, OutOfBlocksError
from pdserve.kv_transfer import (
    AbortedError,
    ChecksumError,
    DeadlineError,
    FaultConfig,
    IncompatibleError,
    KVReceiver,
    KVSender,
    PeerDiedError,
    RejectedError,
    TransferConfig,
    compat_for,
)
from pdserve.kv_transfer.handle import SenderHandle
from pdserve.kv_transfer.testing import scatter_allocate

L, N, B, H, D = 4, 48, 4, 2, 8  # small layout: fast, same code paths
CONFIG = TransferConfig(backend="inproc", deadline_s=10.0, settle_timeout_s=0.5)


@dataclass
class Side:
    kv: torch.Tensor
    blocks: BlockManager

    def leak_check(self) -> None:
        self.blocks.check_invariants()
        assert self.blocks.num_free == self.blocks.num_blocks, f"{self.blocks.num_used} blocks leaked"


def make_side(dtype: torch.dtype = torch.bfloat16, seed: int = 0, num_blocks: int = N) -> Side:
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(L, num_blocks, 2, B, H, D, generator=gen).to(dtype)  # [L, N, 2, B, Hkv, D]
    return Side(kv, BlockManager(num_blocks, B))


def run(coro_fn: Callable[[], Awaitable[Any]], use_uvloop: bool = False) -> Any:
    if use_uvloop:
        return uvloop.run(asyncio.wait_for(coro_fn(), 30))
    return asyncio.run(asyncio.wait_for(coro_fn(), 30))


async def start_receiver(side: Side, config: TransferConfig = CONFIG, **kw: Any) -> KVReceiver:
    rx = KVReceiver(side.kv, side.blocks, compat_for(side.kv, "tiny"), config, **kw)
    await rx.start()
    return rx


def push_from_thread(handle: SenderHandle, layers: range) -> None:
    """The model's forward thread: push each layer right after it was 'computed'."""
    thread = threading.Thread(target=lambda: [handle.push_layer(layer) for layer in layers])
    thread.start()
    thread.join()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


async def settle(*sides: Side, rounds: int = 200) -> None:
    for _ in range(rounds):
        if all(s.blocks.num_free == s.blocks.num_blocks for s in sides):
            return
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scattered", [False, True])
@pytest.mark.parametrize("burst", [False, True], ids=["by-layer", "burst"])
def test_lifecycle_bit_exact_and_handover(dtype: torch.dtype, scattered: bool, burst: bool) -> None:
    dec, pre = make_side(dtype, seed=1), make_side(dtype, seed=2)

    async def main() -> None:
        registry = CollectorRegistry()
        rx = await start_receiver(dec, registry=registry)
        tx = KVSender(pre.kv, compat_for(pre.kv, "tiny"), CONFIG, registry=registry)
        if scattered:
            dec.blocks.allocate("other", 6)  # the reservation starts mid-cache
            src = scatter_allocate(pre.blocks, "r1", 37, keep_every=2)
        else:
            src = pre.blocks.allocate("r1", 37)
        ticket = rx.reserve("r1", 37)
        handle = await tx.open(ticket.encode(), src)
        if burst:  # a prefill under a CUDA graph: every layer written before the hooks run
            thread = threading.Thread(target=handle.push_layers, args=(0, L))
            thread.start()
            thread.join()
        else:
            push_from_thread(handle, range(L))
        choices = (7, 8) if scattered else ()  # an n = 3 request's other choices' first tokens ride along
        stats = await handle.complete(first_token_id=4242, choice_token_ids=choices)
        result = await rx.wait("r1")
        assert result.first_token_id == 4242 and result.num_tokens == 37
        assert result.choice_token_ids == choices
        assert list(result.block_ids) == list(ticket.block_ids)
        assert same_bytes(dec.kv[:, list(result.block_ids)], pre.kv[:, src])
        nbytes = L * len(src) * dec.kv[0, 0].numel() * dec.kv.element_size()
        assert stats.bytes == result.bytes == nbytes
        assert len(stats.layer_seconds) == L and all(s > 0 for s in stats.layer_seconds)
        # Hand-over: the blocks stay allocated under the request id for the decode engine.
        assert "r1" in dec.blocks and dec.blocks.block_table("r1") == list(result.block_ids)
        assert rx.abort("r1") is False  # no longer the receiver's to abort
        value = registry.get_sample_value
        assert value("pdserve_kv_transfer_bytes_total", {"role": "decode"}) == nbytes
        assert value("pdserve_kv_transfer_bytes_total", {"role": "prefill"}) == nbytes
        assert value("pdserve_kv_transfer_seconds_count", {"role": "decode"}) == 1
        assert value("pdserve_kv_transfer_seconds_count", {"role": "prefill"}) == 1
        assert value("pdserve_kv_transfer_layer_seconds_count", {"role": "prefill"}) == L
        assert value("pdserve_kv_transfer_failures_total", {"role": "decode", "reason": "aborted"}) == 0
        assert value("pdserve_kv_transfer_inflight", {"role": "decode"}) == 0
        dec.blocks.free("r1")  # the decode engine, when the request ends
        dec.blocks.free("other")
        pre.blocks.free("r1")  # the prefill worker, after complete() returned
        await tx.close()
        await rx.close()

    run(main)
    dec.leak_check()
    pre.leak_check()


def test_transfer_seconds_are_finer_than_uvloops_clock() -> None:
    """pdserve_kv_transfer_seconds on both sides: not uvloop's ``loop.time()``, which moves in whole
    milliseconds (exploratory testing: every sum a whole number of ms, the 0.5 ms bucket never used)."""
    dec, pre = make_side(seed=1), make_side(seed=2)

    async def main() -> tuple[float, float]:
        rx = await start_receiver(dec)
        tx = KVSender(pre.kv, compat_for(pre.kv, "tiny"), CONFIG)
        src = pre.blocks.allocate("r1", 9)
        handle = await tx.open(rx.reserve("r1", 9).encode(), src)
        push_from_thread(handle, range(L))
        stats = await handle.complete(first_token_id=1)
        result = await rx.wait("r1")
        dec.blocks.free("r1")
        pre.blocks.free("r1")
        await tx.close()
        await rx.close()
        return stats.seconds, result.seconds

    for seconds in run(main, use_uvloop=True):
        ms = seconds * 1000
        assert seconds > 0 and abs(ms - round(ms)) > 1e-6, seconds
    dec.leak_check()
    pre.leak_check()


def test_reserve_out_of_blocks_reserves_nothing() -> None:
    dec = make_side(num_blocks=8)

    async def main() -> None:
        rx = await start_receiver(dec)
        with pytest.raises(OutOfBlocksError):
            rx.reserve("big", 8 * B + 1)
        assert dec.blocks.num_free == 8 and rx.state("big") is None
        with pytest.raises(KeyError):
            await rx.wait("big")
        with pytest.raises(ValueError, match="num_tokens"):
            rx.reserve("empty", 0)
        assert dec.blocks.num_free == 8
        await rx.close()

    run(main)
    dec.leak_check()


def test_decode_abort_before_open_refuses_the_sender() -> None:
    dec, pre = make_side(), make_side(seed=3)

    async def main() -> None:
        rx = await start_receiver(dec)
        tx = KVSender(pre.kv, compat_for(pre.kv, "tiny"), CONFIG)
        ticket = rx.reserve("r", 10)
        assert rx.abort("r", "client cancelled")
        with pytest.raises(AbortedError, match="client cancelled"):
            await rx.wait("r")
        assert dec.blocks.num_free == N
        src = pre.blocks.allocate("r", 10)
        handle = await tx.open(ticket, src)
        push_from_thread(handle, range(L))  # a no-op once refused
        with pytest.raises(AbortedError, match="client cancelled"):
            await handle.complete(1)
        pre.blocks.free("r")
        await tx.close()
        await rx.close()

    run(main)
    dec.leak_check()
    pre.leak_check()


@pytest.mark.parametrize("who", ["decode", "prefill"])
def test_abort_mid_transfer_frees_both_sides(who: str) -> None:
    dec, pre = make_side(), make_side(seed=4)

    async def main() -> None:
        registry = CollectorRegistry()
        rx = await start_receiver(dec, registry=registry)
        tx = KVSender(pre.kv, compat_for(pre.kv, "tiny"), CONFIG, registry=registry)
        ticket = rx.reserve("r", 30)
        src = pre.blocks.allocate("r", 30)
        handle = await tx.open(ticket, src)
        push_from_thread(handle, range(2))
        for _ in range(100):
            if rx.layers_received("r") == 2:
                break
            await asyncio.sleep(0.01)
        assert rx.layers_received("r") == 2
        if who == "decode":
            assert rx.abort("r", "client cancelled")
            push_from_thread(handle, range(2, L))  # the forward does not know yet
            with pytest.raises(AbortedError, match="aborted by decode"):
                await handle.complete(5)
        else:
            await handle.abort("prefill OOM")
        pre.blocks.free("r")  # complete()/abort() returned: P may free
        with pytest.raises(AbortedError):
            await rx.wait("r")
        await settle(dec)
        reason = {"reason": "aborted"}
        assert (
            registry.get_sample_value("pdserve_kv_transfer_failures_total", {"role": "decode", **reason}) == 1
        )
        assert (
            registry.get_sample_value("pdserve_kv_transfer_failures_total", {"role": "prefill", **reason})
            == 1
        )
        await tx.close()
        await rx.close()

    run(main)
    dec.leak_check()
    pre.leak_check()


async def end_reuse_case(rx: KVReceiver, tx: KVSender, dec: Side, pre: Side) -> None:
    """Teardown of the cases where a new reservation ("new") reuses an aborted one's blocks ("old")
    while "filler" holds the rest of the decode cache."""
    rx.abort("new")
    dec.blocks.free("filler")
    pre.blocks.free("old")
    await settle(dec)
    await tx.close()
    await rx.close()


def test_layers_not_yet_written_on_the_device_wait_for_their_marker(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA a pushed layer may still be queued on the GPU: the send waits until its ready marker says
    the writes finished, re-checking on the loop's next iterations (then on a timer), and every layer
    still lands exactly once. A stand-in marker answers "not yet" a few times per layer."""
    from pdserve.kv_transfer import handle as handle_mod

    polls: list[int] = []

    def marker_for(device: torch.device) -> Any:
        left = [4]

        def ready() -> bool:
            polls.append(1)
            left[0] -= 1
            return left[0] < 0

        return ready

    monkeypatch.setattr(handle_mod, "ready_marker", marker_for)
    dec, pre = make_side(seed=21), make_side(seed=22)

    async def main() -> None:
        rx = await start_receiver(dec)
        tx = KVSender(pre.kv, compat_for(pre.kv, "tiny"), CONFIG)
        src = pre.blocks.allocate("m", 20)
        ticket = rx.reserve("m", 20)
        handle = await tx.open(ticket.encode(), src)
        push_from_thread(handle, range(L))
        await handle.complete(first_token_id=5)
        result = await rx.wait("m")
        assert same_bytes(dec.kv[:, list(result.block_ids)], pre.kv[:, src])
        assert len(polls) == 5 * L  # four "not yet" and the "ready" of each layer
        dec.blocks.free("m")
        pre.blocks.free("m")
        await tx.close()
        await rx.close()

    run(main)
    dec.leak_check()
    pre.leak_check()


def test_late_layers_never_write_reused_blocks() -> None:
    """After a decode abort the blocks go back only when nothing can write them, so a
    new reservation on the same blocks keeps its contents while the old sender finishes."""
    dec, pre = make_side(), make_side(seed=5)

    async def main() -> None:
        rx = await start_receiver(dec)
        tx = KVSender(pre.kv, compat_for(pre.kv, "tiny"), CONFIG)
        ticket = rx.reserve("old", 4 * B)
        dec.blocks.allocate("filler", (N - 4) * B)  # once freed, the old blocks are the only free ones
        src = pre.blocks.allocate("old", 4 * B)
        handle = await tx.open(ticket, src)
        await asyncio.sleep(0.01)  # the Open reply arrives: sends go out at once
        # Pushed in the same loop iteration as the abort: these sends race the Abort message.
        for layer in range(L):
            handle.push_layer(layer)
        rx.abort("old")
        for _ in range(200):
            if "old" not in dec.blocks:
                break
            await asyncio.sleep(0.01)
        assert dec.blocks.num_free == 4
        new = rx.reserve("new", 4 * B)
        assert sorted(new.block_ids) == sorted(ticket.block_ids)
        dec.kv[:, list(new.block_ids)] = 7.0
        with pytest.raises(AbortedError):
            await handle.complete(1)
        await asyncio.sleep(0.05)
        sent = tx.metrics.registry.get_sample_value("pdserve_kv_transfer_bytes_total", {"role": "prefill"})
        assert sent and sent > 0, "the race did not happen: no layer left P after the abort"
        assert bool((dec.kv[:, list(new.block_ids)] == 7.0).all())
        await end_reuse_case(rx, tx, dec, pre)

    run(main)
    dec.leak_check()
    pre.leak_check()


def test_deadline_with_a_dropped_layer() -> None:
    dec, pre = make_side(), make_side(seed=6)
    faulty = replace(CONFIG, faults=FaultConfig(drop_layers=frozenset({2})))

    async def main() -> None:
        registry = CollectorRegistry()
        rx = await start_receiver(dec, registry=registry)
        tx = KVSender(pre.kv, compat_for(pre.kv, "tiny"), faulty)
        ticket = rx.reserve("r", 20, deadline_s=0.3)
        src = pre.blocks.allocate("r", 20)
        handle = await tx.open(ticket, src)
        push_from_thread(handle, range(L))
        with pytest.raises(DeadlineError):
            await handle.complete(3)
        pre.blocks.free("r")
        with pytest.raises(DeadlineError, match="not complete after 0.3s"):
            await rx.wait("r")
        await settle(dec)
        assert (
            registry.get_sample_value(
                "pdserve_kv_transfer_failures_total", {"role": "decode", "reason": "deadline"}
            )
            == 1
        )
        await tx.close()
        await rx.close()

    run(main)
    dec.leak_check()
    pre.leak_check()


@pytest.mark.parametrize("digest", [True, False])
def test_a_byte_flipped_in_flight_fails_the_checksum(digest: bool) -> None:
    """The sender's first transfer gets one byte flipped after its digest was taken: the receiver's check
    fails it on both sides (reason checksum) and frees the blocks; the next transfer lands intact. Without
    digests the same flip goes unseen (what the check is for)."""
    dec, pre = make_side(seed=11), make_side(seed=12)
    faulty = replace(CONFIG, digest=digest, faults=FaultConfig(corrupt_transfers=1))

    async def main() -> None:
        registry = CollectorRegistry()
        rx = await start_receiver(dec, registry=registry)
        tx = KVSender(pre.kv, compat_for(pre.kv, "tiny"), faulty, registry=registry)
        src = pre.blocks.allocate("r", 21)
        for rid in ("bad", "good"):
            ticket = rx.reserve(rid, 21)
            handle = await tx.open(ticket, src)
            push_from_thread(handle, range(L))
            if rid == "bad" and digest:
                with pytest.raises(ChecksumError):
                    await handle.complete(5)
                with pytest.raises(ChecksumError, match="does not match its writer's digest"):
                    await rx.wait(rid)
                await settle(dec)
                assert rid not in dec.blocks
                continue
            await handle.complete(5)
            result = await rx.wait(rid)
            intact = same_bytes(dec.kv[:, list(result.block_ids)], pre.kv[:, src])
            assert intact is (rid == "good"), "the fault flipped nothing" if rid == "bad" else "corrupted"
            dec.blocks.free(rid)
        for role in ("prefill", "decode"):
            failed = registry.get_sample_value(
                "pdserve_kv_transfer_failures_total", {"role": role, "reason": "checksum"}
            )
            assert failed == (1 if digest else 0), role
        pre.blocks.free("r")
        await tx.close()
        await rx.close()

    run(main)
    dec.leak_check()
    pre.leak_check()


def test_deadline_without_sender_and_expired_ticket() -> None:
    dec, pre = make_side(), make_side(seed=7)

    async def main() -> None:
        rx = await start_receiver(dec)
        tx = KVSender(pre.kv, compat_for(pre.kv, "tiny"), CONFIG)
        ticket = rx.reserve("r", 20, deadline_s=0.1)
        with pytest.raises(DeadlineError):
            await rx.wait("r")
        assert dec.blocks.num_free == N
        with pytest.raises(DeadlineError, match="expired"):
            await tx.open(ticket, list(range(5)))
        await tx.close()
        await rx.close()

    run(main)
    dec.leak_check()


@pytest.mark.parametrize("mismatch", ["dtype", "layout", "version"])
def test_incompatible_sender_is_refused_before_any_data(mismatch: str) -> None:
    dec = make_side()
    if mismatch == "dtype":
        pre = make_side(torch.float32, seed=8)
        compat = compat_for(pre.kv, "tiny")
    elif mismatch == "layout":
        pre = make_side(seed=8)
        compat = compat_for(pre.kv, "another-model")
    else:
        pre = make_side(seed=8)
        compat = msgspec.structs.replace(compat_for(pre.kv, "tiny"), protocol_version=99)

    async def main() -> None:
        rx = await start_receiver(dec)
        tx = KVSender(pre.kv, compat, CONFIG)
        ticket = rx.reserve("r", 20)
        blocks = list(ticket.block_ids)
        before = dec.kv[:, blocks].clone()
        src = pre.blocks.allocate("r", 20)
        with pytest.raises(IncompatibleError):
            await tx.open(ticket, src)
        pre.blocks.free("r")
        with pytest.raises(IncompatibleError):  # told at once, not at the 10 s deadline
            await rx.wait("r")
        assert same_bytes(dec.kv[:, blocks], before)
        await tx.close()
        await rx.close()

    run(main)
    dec.leak_check()
    pre.leak_check()


@pytest.mark.parametrize("victim", ["prefill", "decode"])
def test_peer_death_fails_and_frees_the_survivor(victim: str) -> None:
    dec, pre = make_side(), make_side(seed=9)

    async def main() -> None:
        rx = await start_receiver(dec)
        tx = KVSender(pre.kv, compat_for(pre.kv, "tiny"), CONFIG)
        ticket = rx.reserve("r", 30)
        src = pre.blocks.allocate("r", 30)
        handle = await tx.open(ticket, src)
        push_from_thread(handle, range(2))
        await asyncio.sleep(0.02)
        dead = tx._transport if victim == "prefill" else rx._transport
        dead.kill()  # type: ignore[union-attr]
        if victim == "prefill":
            with pytest.raises(PeerDiedError):
                await rx.wait("r")
            await settle(dec)
        else:
            push_from_thread(handle, range(2, L))
            with pytest.raises(PeerDiedError):
                await handle.complete(1)
            await rx.close()
        pre.blocks.free("r")
        await tx.close()
        await rx.close()

    run(main)
    if victim == "prefill":
        dec.leak_check()
    pre.leak_check()


def test_32_concurrent_transfers_to_two_receivers_uvloop() -> None:
    decs = [make_side(num_blocks=160, seed=10), make_side(num_blocks=160, seed=11)]
    pre = make_side(num_blocks=320, seed=12)

    async def main() -> None:
        rxs = [await start_receiver(d) for d in decs]
        tx = KVSender(pre.kv, compat_for(pre.kv, "tiny"), CONFIG)

        async def one(i: int) -> None:
            rx, dec = rxs[i % 2], decs[i % 2]
            tokens = 3 + 5 * (i % 8)
            ticket = rx.reserve(f"r{i}", tokens)
            if i % 3 == 0:
                src = scatter_allocate(pre.blocks, f"r{i}", tokens, 2)
            else:
                src = pre.blocks.allocate(f"r{i}", tokens)
            handle = await tx.open(ticket, src)
            await asyncio.to_thread(lambda: [handle.push_layer(layer) for layer in range(L)])
            await handle.complete(i)
            result = await rx.wait(f"r{i}")
            assert result.first_token_id == i
            assert same_bytes(dec.kv[:, list(result.block_ids)], pre.kv[:, src])
            dec.blocks.free(f"r{i}")
            pre.blocks.free(f"r{i}")

        await asyncio.gather(*(one(i) for i in range(32)))
        await tx.close()
        for rx in rxs:
            await rx.close()

    run(main, use_uvloop=True)
    for side in (*decs, pre):
        side.leak_check()


def test_push_layer_misuse_is_reported() -> None:
    dec, pre = make_side(), make_side(seed=13)

    async def main() -> None:
        rx = await start_receiver(dec)
        tx = KVSender(pre.kv, compat_for(pre.kv, "tiny"), CONFIG)
        ticket = rx.reserve("r", 8)
        with pytest.raises(ValueError, match="source blocks"):
            await tx.open(ticket, [0])
        src = pre.blocks.allocate("r", 8)
        handle = await tx.open(ticket, src)
        handle.push_layer(0)
        with pytest.raises(ValueError, match="twice"):
            handle.push_layer(0)
        with pytest.raises(ValueError, match="outside"):
            handle.push_layer(L)
        handle.push_layers(1, 2)
        with pytest.raises(ValueError, match="layer 2 pushed twice"):  # and layer 3 is not pushed either
            handle.push_layers(2, 2)
        for first, count in ((3, 0), (3, 2), (-1, 1)):
            with pytest.raises(ValueError, match="outside"):
                handle.push_layers(first, count)
        with pytest.raises(ValueError, match=r"missing \[3\]"):
            await handle.complete(1)
        with pytest.raises(ValueError, match="missing"):
            await handle.complete(1)
        await handle.abort("test over")
        pre.blocks.free("r")
        with pytest.raises(AbortedError):
            await rx.wait("r")
        await settle(dec)
        await tx.close()
        await rx.close()

    run(main)
    dec.leak_check()
    pre.leak_check()


def test_data_pushed_into_a_refused_open_never_touches_blocks() -> None:
    """The sender pushes right after Open; a refused Open's data lands in scratch memory,
    and both sides finish at once (no settle timeout), freeing everything."""
    dec, pre = make_side(), make_side(seed=14)

    async def main() -> None:
        registry = CollectorRegistry()
        rx = await start_receiver(dec)
        tx = KVSender(pre.kv, compat_for(pre.kv, "tiny"), CONFIG, registry=registry)
        ticket = rx.reserve("old", 4 * B)
        dec.blocks.allocate("filler", (N - 4) * B)
        assert rx.abort("old", "client cancelled")  # before Open: the blocks are free at once
        new = rx.reserve("new", 4 * B)
        assert sorted(new.block_ids) == sorted(ticket.block_ids)
        dec.kv[:, list(new.block_ids)] = 7.0
        src = pre.blocks.allocate("old", 4 * B)
        handle = await tx.open(ticket, src)
        for layer in range(L):  # all sent before the receiver even sees Open
            handle.push_layer(layer)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(AbortedError, match="client cancelled"):
            await handle.complete(1)
        assert loop.time() - t0 < CONFIG.settle_timeout_s, "the refused sends waited for a timeout"
        sent = registry.get_sample_value("pdserve_kv_transfer_bytes_total", {"role": "prefill"})
        assert sent and sent > 0, "no data left P: the refusal path was not exercised"
        assert bool((dec.kv[:, list(new.block_ids)] == 7.0).all())
        for _ in range(100):  # the drain goes once the sender said what it sent
            if not rx.draining:
                break
            await asyncio.sleep(0.01)
        assert rx.draining == 0
        await end_reuse_case(rx, tx, dec, pre)

    run(main)
    dec.leak_check()
    pre.leak_check()


def test_one_ticket_two_senders_only_the_first_writes() -> None:
    """Data carries the sending connection's id: a second sender of the same ticket is
    refused and none of its bytes reach the blocks, even though it pushes at once."""
    dec, pre_a, pre_b = make_side(), make_side(seed=15), make_side(seed=16)

    async def main() -> None:
        rx = await start_receiver(dec)
        tx_a = KVSender(pre_a.kv, compat_for(pre_a.kv, "tiny"), CONFIG)
        tx_b = KVSender(pre_b.kv, compat_for(pre_b.kv, "tiny"), CONFIG)
        ticket = rx.reserve("r", 30)
        src_a, src_b = pre_a.blocks.allocate("r", 30), pre_b.blocks.allocate("r", 30)
        handle_a = await tx_a.open(ticket, src_a)
        push_from_thread(handle_a, range(2))
        for _ in range(100):
            if rx.layers_received("r") == 2:
                break
            await asyncio.sleep(0.01)
        handle_b = await tx_b.open(ticket, src_b)
        push_from_thread(handle_b, range(L))
        with pytest.raises(RejectedError, match="already open"):
            await handle_b.complete(2)
        push_from_thread(handle_a, range(2, L))
        await handle_a.complete(1)
        result = await rx.wait("r")
        assert same_bytes(dec.kv[:, list(result.block_ids)], pre_a.kv[:, src_a])
        dec.blocks.free("r")
        pre_a.blocks.free("r")
        pre_b.blocks.free("r")
        await tx_a.close()
        await tx_b.close()
        await rx.close()

    run(main)
    dec.leak_check()
    pre_a.leak_check()
    pre_b.leak_check()


def test_same_ticket_twice_on_one_sender_is_refused_locally() -> None:
    dec, pre = make_side(), make_side(seed=17)

    async def main() -> None:
        rx = await start_receiver(dec)
        tx = KVSender(pre.kv, compat_for(pre.kv, "tiny"), CONFIG)
        ticket = rx.reserve("r", 8)
        src = pre.blocks.allocate("r", 8)
        handle = await tx.open(ticket, src)
        with pytest.raises(ValueError, match="already being transferred"):
            await tx.open(ticket, src)
        push_from_thread(handle, range(L))
        await handle.complete(3)
        assert (await rx.wait("r")).first_token_id == 3
        dec.blocks.free("r")
        pre.blocks.free("r")
        await tx.close()
        await rx.close()

    run(main)
    dec.leak_check()
    pre.leak_check()
