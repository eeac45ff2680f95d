"""Prefill scheduler (pure): batching under the token budget, and a request sent again while its
first attempt still holds blocks (the router's retry after a decode worker died)."""

from __future__ import annotations

from pdserve.engine.block_manager import BlockManager
from pdserve.prefill_pool.scheduler import PrefillJob, PrefillScheduler, Stage


def test_a_retry_of_a_request_whose_first_attempt_still_holds_blocks_is_scheduled() -> None:
    bm = BlockManager(64, 16)
    sched = PrefillScheduler(bm, 2048)
    first = PrefillJob("r", list(range(100)))
    sched.add(first)
    assert sched.schedule() == [first]
    retry = PrefillJob("r", list(range(100)))  # same id: the first attempt's transfer is still aborting
    sched.add(retry)
    assert sched.schedule() == [retry]
    assert set(first.block_table).isdisjoint(retry.block_table)
    sched.finish(first)
    assert bm.num_free == 64 - len(retry.block_table)  # only the first attempt's blocks came back
    sched.finish(retry)
    assert bm.num_free == 64 and retry.stage is Stage.DONE


def test_budget_and_fifo() -> None:
    bm = BlockManager(16, 16)
    sched = PrefillScheduler(bm, 200)
    jobs = [PrefillJob(i, list(range(120))) for i in range(3)]
    for j in jobs:
        sched.add(j)
    assert sched.schedule() == [jobs[0]]  # the second would pass the 200-token budget
    assert sched.schedule() == [jobs[1]]
    sched.cancel(jobs[2])
    assert sched.schedule() == [] and sched.num_queued == 0
    for j in jobs[:2]:
        sched.finish(j)
    assert bm.num_free == 16


def test_a_stopped_prefill_loop_fails_queued_prompts_and_refuses_new_ones() -> None:
    import asyncio
    from types import SimpleNamespace

    from pdserve.engine.params import SamplingParams
    from pdserve.prefill_pool.loop import PrefillLoop

    async def main() -> None:
        runner = SimpleNamespace(num_blocks=8, block_size=16)
        loop = PrefillLoop(runner, None, None, 256, None)  # type: ignore[arg-type]
        _, queued = loop.submit("a", [1, 2, 3], SamplingParams(), None)  # type: ignore[arg-type]

        def broken() -> list[PrefillJob]:
            raise AssertionError("scheduler bug")

        loop.sched.schedule = broken  # type: ignore[method-assign]
        loop.start()
        try:
            await asyncio.wait_for(asyncio.shield(queued), 5)
        except RuntimeError as e:
            assert "prefill loop stopped" in str(e)
        else:
            raise AssertionError("a queued prompt outlived the loop")
        try:
            loop.submit("b", [1], SamplingParams(), None)  # type: ignore[arg-type]
        except RuntimeError as e:
            assert "scheduler bug" in str(e)
        else:
            raise AssertionError("a stopped loop took a prompt")
        await loop.close()

    asyncio.run(main())
