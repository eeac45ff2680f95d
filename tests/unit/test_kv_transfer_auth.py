"""The cluster token in the KV handshake (``kv_transfer/auth.py``), over the in-process transport.

Without the token a prefill side cannot open a transfer into a decode worker's blocks (nor even learn
whether its layout matches), a decode side without it gets no prompt's KV, a replayed Hello is refused,
and a refused connection cannot abort anyone's reservation. Every test ends with a leak check.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from pdserve.kv_transfer import DeadlineError, KVSender, UnauthenticatedError, compat_for, wire
from pdserve.kv_transfer.auth import hello_proof
from pdserve.kv_transfer.transports.inproc import InprocTransport
from tests.unit.test_kv_transfer_inproc import (
    CONFIG,
    L,
    make_side,
    push_from_thread,
    run,
    same_bytes,
    start_receiver,
)

TOKEN = "k" * 24
WITH_TOKEN = replace(CONFIG, cluster_token=TOKEN)


@pytest.mark.parametrize(
    ("decode_token", "prefill_token", "refused_by"),
    [
        (TOKEN, "", "decode"),  # a prefill process without the token
        (TOKEN, "w" * 24, "decode"),  # ... or with another cluster's
        ("", TOKEN, "prefill"),  # a decode process that cannot prove it: no KV goes to it
    ],
)
def test_a_side_without_the_token_is_refused(decode_token: str, prefill_token: str, refused_by: str) -> None:
    dec, pre = make_side(seed=1), make_side(seed=2)

    async def main() -> None:
        registry = CollectorRegistry()
        rx = await start_receiver(dec, replace(CONFIG, cluster_token=decode_token), registry=registry)
        tx = KVSender(pre.kv, compat_for(pre.kv, "tiny"), replace(CONFIG, cluster_token=prefill_token))
        src = pre.blocks.allocate("r1", 9)
        ticket = rx.reserve("r1", 9, deadline_s=0.5)
        with pytest.raises(UnauthenticatedError, match="did not prove the cluster token"):
            await tx.open(ticket.encode(), src)
        pre.blocks.free("r1")
        failures = registry.get_sample_value(
            "pdserve_kv_transfer_failures_total", {"role": "decode", "reason": "unauthenticated"}
        )
        assert failures == (1 if refused_by == "decode" else 0)
        # Nothing landed. Refused by D: the reservation ends at its deadline (an unproven connection may
        # not abort it). Refused by P: P tells D at once why.
        expected = DeadlineError if refused_by == "decode" else UnauthenticatedError
        with pytest.raises(expected):
            await rx.wait("r1")
        await _settle(dec)
        await tx.close()
        await rx.close()

    run(main)
    dec.leak_check()
    pre.leak_check()


def test_both_sides_with_the_token_transfer_bit_exact() -> None:
    dec, pre = make_side(seed=3), make_side(seed=4)

    async def main() -> None:
        rx = await start_receiver(dec, WITH_TOKEN)
        tx = KVSender(pre.kv, compat_for(pre.kv, "tiny"), WITH_TOKEN)
        src = pre.blocks.allocate("r1", 21)
        ticket = rx.reserve("r1", 21)
        handle = await tx.open(ticket.encode(), src)
        push_from_thread(handle, range(L))
        await handle.complete(first_token_id=7)
        result = await rx.wait("r1")
        assert same_bytes(dec.kv[:, list(result.block_ids)], pre.kv[:, src])
        dec.blocks.free("r1")
        pre.blocks.free("r1")
        await tx.close()
        await rx.close()

    run(main)
    dec.leak_check()
    pre.leak_check()


def test_a_replayed_hello_is_refused_and_an_unproven_connection_cannot_abort() -> None:
    dec = make_side(seed=5)

    async def main() -> None:
        rx = await start_receiver(dec, WITH_TOKEN)
        ticket = rx.reserve("victim", 5)
        compat = compat_for(dec.kv, "tiny")
        nonce = "n" * 32
        hello = wire.Hello(
            compat.protocol_version,
            compat.hash(),
            "p1",
            nonce=nonce,
            proof=hello_proof(TOKEN, compat.protocol_version, compat.hash(), "p1", nonce),
        )
        replies: list[wire.HelloReply] = []
        transport = InprocTransport()
        for want in (1, 2):  # the genuine Hello, then a copy of it on another connection
            conn = await transport.connect(rx.address)
            conn.set_handlers(lambda b: replies.append(wire.decode_message(b)), lambda exc: None)
            conn.post_message(wire.encode_message(hello))
            await _until(lambda want=want: len(replies) >= want)
        assert replies[0].ok and not replies[1].ok and replies[1].code == "unauthenticated"
        # The replaying connection tries to fail the victim's reservation: it is closed unheard.
        conn.post_message(wire.encode_message(wire.Abort(ticket.transfer_id, "aborted", "evil", ())))
        await _until(lambda: not conn.alive)
        assert rx.state("victim") is not None and rx.abort("victim")
        await _settle(dec)
        await transport.close()
        await rx.close()

    run(main)
    dec.leak_check()


async def _until(predicate, rounds: int = 300) -> None:
    for _ in range(rounds):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


async def _settle(side) -> None:
    await _until(lambda: side.blocks.num_free == side.blocks.num_blocks)
