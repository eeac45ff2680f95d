"""The decode worker's stall watch over a remote prefill (``decode_pool.remote.RemotePrefill._watch``):
a started transfer that makes no progress for the stall timeout is aborted; one that moves (landed
layers, or an RMA sender's Progress reports) or still queues for prefill is left alone."""

from __future__ import annotations

import asyncio
import types

from pdserve.decode_pool.remote import RemotePrefill
from pdserve.kv_transfer.reservation import RxState

STALL_S = 0.3


class FakeReceiver:
    def __init__(self, state: RxState = RxState.OPEN) -> None:
        self.st, self.n, self.aborted = state, 0, ""

    def state(self, rid: str) -> RxState:
        return self.st

    def progress(self, rid: str) -> int:
        return self.n

    def abort(self, rid: str, reason: str) -> bool:
        self.aborted = reason
        return True


async def _watch_for(rx: FakeReceiver, seconds: float, moving: bool = False) -> str:
    """Run the watch for ``seconds`` (the receiver's progress growing every 0.1 s when ``moving``), then
    adopt; the watch's result."""
    adoption: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    watcher = types.SimpleNamespace(receiver=rx, stall_timeout_s=STALL_S)
    task = asyncio.create_task(RemotePrefill._watch(watcher, "r", adoption))  # type: ignore[arg-type]
    end = asyncio.get_running_loop().time() + seconds
    while asyncio.get_running_loop().time() < end:
        await asyncio.sleep(0.1)
        rx.n += moving
    adoption.set_result("adopted")
    return await task


def test_a_started_transfer_without_progress_is_aborted_after_the_stall_timeout():
    rx = FakeReceiver()
    assert asyncio.run(_watch_for(rx, 4 * STALL_S)) == "adopted"
    assert "made no progress for 0.3s" in rx.aborted


def test_a_transfer_that_keeps_moving_is_left_alone_however_long_it_takes():
    rx = FakeReceiver()
    asyncio.run(_watch_for(rx, 4 * STALL_S, moving=True))
    assert rx.aborted == "" and rx.n >= 10


def test_a_reservation_whose_prompt_still_queues_is_left_alone():
    rx = FakeReceiver(RxState.RESERVED)
    asyncio.run(_watch_for(rx, 4 * STALL_S))
    assert rx.aborted == ""
