"""A decode worker's engine thread never ends silently (``decode_pool.engine_loop``).

A worker whose engine thread died used to keep heartbeating READY: every request sent to it hung until its
deadline, and ``stop()`` never returned. Now an error outside a step, or ``MAX_FAILED_STEPS`` failed steps
in a row, fails every request and call with ``EngineDied``, later ones at once, and the pool begins the
shell's drain (the process then exits non-zero, to be replaced).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from pdserve.decode_pool import engine_loop
from pdserve.decode_pool.app import DecodePool
from pdserve.decode_pool.engine_loop import EngineDied
from pdserve.engine.params import SamplingParams
from pdserve.worker.args import WorkerArgs
from pdserve.worker.role import Role
from pdserve.worker.shell import ShellState, WorkerShell

LONG = SamplingParams(max_tokens=2000, ignore_eos=True)  # still decoding when the engine breaks


def _pool(model: Path) -> tuple[DecodePool, WorkerShell]:
    args = WorkerArgs(
        role=Role.BOTH, router="r:1", worker_id="w", model=str(model), dtype="float32", kv_blocks=160
    )
    shell = WorkerShell(args.shell_config())
    return DecodePool(args, shell, CollectorRegistry()), shell


async def _drain(q: asyncio.Queue) -> list:
    items = []
    while True:
        item = await asyncio.wait_for(q.get(), 60)
        items.append(item)
        if item is None or isinstance(item, BaseException):
            return items


def test_a_failing_step_callback_is_logged_once_and_the_engine_goes_on(tiny_llama_dir, caplog) -> None:
    async def main() -> None:
        pool, _ = _pool(tiny_llama_dir)
        await pool.load(Path(tiny_llama_dir))
        assert pool.loop is not None
        try:

            def broken(_s, _b):  # type: ignore[no-untyped-def]
                raise ValueError("a metric bug")

            pool.loop.on_step(broken)
            items = await _drain(
                pool.loop.submit("r", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
            )
            assert items[-1] is None and sum(len(d.new_token_ids) for d in items[:-1]) == 5
            assert pool.failure is None
        finally:
            await pool.close()

    with caplog.at_level(logging.ERROR, logger=engine_loop.__name__):
        asyncio.run(main())
    assert sum("step callback failed" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("how", ["outside_a_step", "steps_keep_failing"])
def test_an_engine_that_dies_fails_everything_at_once_and_drains_the_worker(tiny_llama_dir, how) -> None:
    async def main() -> None:
        pool, shell = _pool(tiny_llama_dir)
        await shell.start(lambda _server: None)
        await shell.set_serving()
        await pool.load(Path(tiny_llama_dir))
        loop = pool.loop
        assert loop is not None
        running = loop.submit("running", [1, 2, 3], LONG)
        assert not isinstance(await asyncio.wait_for(running.get(), 60), BaseException)  # it decodes
        if how == "outside_a_step":

            def abort(_rid):  # type: ignore[no-untyped-def]
                raise KeyError("a bug in abort")

            loop.engine.abort = abort  # type: ignore[method-assign]
            loop.abort("someone-else")
        else:

            def step():  # type: ignore[no-untyped-def]
                raise RuntimeError("device lost")

            loop.engine.step = step  # type: ignore[method-assign]
            # A failed step fails its requests only; the engine dies at the MAX_FAILED_STEPS-th in a row.
            for i in range(engine_loop.MAX_FAILED_STEPS - 1):
                items = await _drain(running)
                assert isinstance(items[-1], RuntimeError) and not isinstance(items[-1], EngineDied)
                assert pool.failure is None
                running = loop.submit(f"again-{i}", [1, 2, 3], LONG)
        items = await _drain(running)
        assert isinstance(items[-1], EngineDied)
        failed = pool.registry.get_sample_value("pdserve_failed_steps_total", {"role": "both"})
        assert failed == (0 if how == "outside_a_step" else engine_loop.MAX_FAILED_STEPS)
        async with asyncio.timeout(10):
            while pool.failure is None:
                await asyncio.sleep(0.01)
        assert isinstance(pool.failure, EngineDied)
        assert shell.state in (ShellState.DRAINING, ShellState.STOPPED)  # the worker leaves the cluster
        # Everything after the death fails at once instead of hanging.
        later = await asyncio.wait_for(loop.submit("later", [1, 2], LONG).get(), 5)
        assert isinstance(later, EngineDied)
        with pytest.raises(EngineDied):
            await asyncio.wait_for(loop.call(lambda e: e.block_manager.num_used), 5)
        await asyncio.wait_for(pool.close(), 10)  # stop() returns
        await asyncio.wait_for(shell.stop(), 10)

    asyncio.run(main())


def test_an_ended_request_never_takes_the_queue_of_a_newer_one_with_its_id() -> None:
    """A client retrying its own request id at once: the old request's end (queued to the event loop by the
    engine thread) must not drop the new request's queue, submitted in between."""

    async def main() -> None:
        loop = engine_loop.EngineLoop(object(), asyncio.get_running_loop())  # type: ignore[arg-type]
        old: asyncio.Queue = asyncio.Queue()
        loop._queues["r"] = loop._owners["r"] = old
        loop._put("r", None)  # (from the engine thread) the old one ended
        new: asyncio.Queue = asyncio.Queue()
        loop._queues["r"] = new  # the retry, submitted before the loop ran the end's callbacks
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert old.get_nowait() is None and loop._queues.get("r") is new

    asyncio.run(main())


def test_failures_hours_apart_are_no_streak(monkeypatch) -> None:
    """Three failed steps on an idle worker an hour apart (three arrivals of a prompt that breaks a
    forward) must not kill it; three within the window do, and a success between them resets the count."""
    from pdserve.worker import failures

    now = [1000.0]
    monkeypatch.setattr(failures.time, "monotonic", lambda: now[0])
    streak = failures.FailureStreak(limit=3, window_s=60.0)
    for _ in range(5):
        assert not streak.failed()
        now[0] += 3600.0
    assert not streak.failed() and not streak.failed()
    streak.succeeded()
    assert not streak.failed() and not streak.failed()
    assert streak.failed()  # the third within a minute, none succeeding between


def test_the_abort_after_a_finish_leaves_a_retry_of_the_same_id_alone() -> None:
    """A stream's end is followed by an abort (idempotent cleanup) that waits behind the engine's current
    step; the client retries its id meanwhile: that abort must not end or abort the new request, whichever
    of the two commands the engine thread sees first."""

    class Eng:
        def __init__(self) -> None:
            self.aborted: list = []
            self.added: list = []

        def abort(self, rid) -> None:  # type: ignore[no-untyped-def]
            self.aborted.append(rid)

        def add_request(self, rid, *_args) -> None:  # type: ignore[no-untyped-def]
            self.added.append(rid)

    async def main(abort_first: bool) -> None:
        eng = Eng()
        loop = engine_loop.EngineLoop(eng, asyncio.get_running_loop())  # type: ignore[arg-type]
        old = loop.submit("r", [1, 2], LONG)
        loop._apply(loop._cmds.get_nowait())  # the engine adds it
        loop._put("r", None)  # the old request finished
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert old.get_nowait() is None
        if abort_first:
            loop.abort("r", old)  # the servicer's cleanup, queued for the engine thread
            new = loop.submit("r", [1, 2], LONG)  # the retry
        else:
            new = loop.submit("r", [1, 2], LONG)
            loop.abort("r", old)
        while not loop._cmds.empty():  # the engine thread, between steps
            loop._apply(loop._cmds.get_nowait())
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert new.empty() and loop._queues.get("r") is new and eng.aborted == []
        assert eng.added == ["r", "r"]
        loop.abort("r", new)  # its own abort still works
        loop._apply(loop._cmds.get_nowait())
        await asyncio.sleep(0)
        assert new.get_nowait() is None and eng.aborted == ["r"]

    asyncio.run(main(True))
    asyncio.run(main(False))


def test_a_retry_of_an_id_whose_earlier_attempt_is_still_queued_streams(tiny_llama_dir) -> None:
    """Code review: the earlier attempt of an id waits in the engine (max_num_seqs full), holding no
    blocks, when the router's retry of the id arrives (the earlier stream's own abort still on its way).
    The retry's ADD failed ("request id is already in use"): it was INVALID_ARGUMENT to the client. The
    servicer now ends the earlier attempt first; and the earlier attempt's late abort or deltas never
    reach the retry."""
    from pdserve.engine.llm_engine import EngineConfig, LLMEngine

    async def main() -> None:
        cfg = EngineConfig(dtype="float32", num_blocks=64, max_num_seqs=1, detokenize=False)
        loop = await engine_loop.EngineLoop.build(lambda: LLMEngine(tiny_llama_dir, None, cfg))
        busy = loop.submit("busy", [5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True))
        old = loop.submit("x", [9, 10, 11], SamplingParams(max_tokens=8, ignore_eos=True))  # queued
        assert not isinstance(await asyncio.wait_for(busy.get(), 30), BaseException)
        assert await loop.call(lambda e: e.scheduler.get("x") is not None and "x" not in e.block_manager)
        loop.end_earlier_attempt("x")  # what the servicer does first for a new attempt of an id
        new = loop.submit("x", [9, 10, 11], SamplingParams(max_tokens=8, ignore_eos=True))
        loop.abort("x", old)  # the earlier stream's own cleanup, late
        assert await asyncio.wait_for(old.get(), 10) is None
        loop.abort("busy", busy)  # room for the retry
        items = await _drain(new)
        assert items[-1] is None and sum(len(d.new_token_ids) for d in items[:-1]) == 8
        assert await loop.call(lambda e: e.block_manager.num_used) == 0
        await loop.stop()

    asyncio.run(main())


def test_the_decode_servicer_tells_the_router_to_retry_a_failed_step_elsewhere() -> None:
    """StepFailed -> INTERNAL with the trailing metadata the router moves the request on; EngineDied ->
    UNAVAILABLE (a dead worker)."""
    from types import SimpleNamespace

    import grpc

    from pdserve.decode_pool.metrics import DecodeMetrics
    from pdserve.decode_pool.servicer import DecodeServicer
    from pdserve.kv_transfer import TransferConfig
    from pdserve.proto import worker_pb2
    from pdserve.worker.shell import RETRY_ELSEWHERE_KEY, ShellConfig
    from tests.unit.fake_grpc import Aborted, AbortingContext

    async def call(error: BaseException) -> tuple:
        def submit(*_a, **_k):  # type: ignore[no-untyped-def]
            q: asyncio.Queue = asyncio.Queue()
            q.put_nowait(error)
            return q

        fake = SimpleNamespace(
            engine=SimpleNamespace(block_manager=set()),
            submit=submit,
            abort=lambda _rid, _attempt=None: None,
            end_earlier_attempt=lambda _rid: None,
        )
        servicer = DecodeServicer(
            WorkerShell(ShellConfig()), TransferConfig(), DecodeMetrics(CollectorRegistry())
        )
        servicer.attach(fake, None)  # type: ignore[arg-type]
        ctx = AbortingContext()
        with pytest.raises(Aborted):
            async for _ in servicer.Generate(
                worker_pb2.WorkerGenerateRequest(request_id="r", prompt_token_ids=[1]), ctx
            ):
                pass
        return ctx.aborted

    async def main() -> None:
        code, _, trailing = await call(engine_loop.StepFailed("engine step failed: RuntimeError('x')"))
        assert code is grpc.StatusCode.INTERNAL and (RETRY_ELSEWHERE_KEY, "step_failed") in trailing
        code, _, trailing = await call(EngineDied("the engine thread died"))
        assert code is grpc.StatusCode.UNAVAILABLE and not trailing

    asyncio.run(main())


def test_work_no_step_can_schedule_waits_for_a_command_instead_of_spinning(tiny_llama_dir) -> None:
    """Code review: a request waiting for blocks that transfers' reservations hold, nothing running. The
    engine thread called ``step()`` (which scheduled nothing) back to back, some 400k times a second on
    one core, holding the GIL from the event loop that lands the very transfers it waits for. It now
    waits for a command (up to idle_wait_s) between such steps."""
    from pdserve.engine.llm_engine import EngineConfig, LLMEngine

    async def main() -> None:
        cfg = EngineConfig(dtype="float32", num_blocks=16, block_size=16, max_num_seqs=4, detokenize=False)
        loop = await engine_loop.EngineLoop.build(lambda: LLMEngine(tiny_llama_dir, None, cfg))
        eng = loop.engine
        calls = [0]
        step = eng.step

        def counted():  # type: ignore[no-untyped-def]
            calls[0] += 1
            return step()

        eng.step = counted  # type: ignore[method-assign]
        await loop.call(lambda e: e.block_manager.allocate("reservation", 15 * 16))  # a transfer's blocks
        out = loop.submit("local", list(range(5, 40)), SamplingParams(max_tokens=4, ignore_eos=True))
        await asyncio.sleep(0.5)
        assert 1 <= calls[0] <= 0.5 / 0.05 + 5  # a step per idle wait, not a spin
        assert out.empty()
        await loop.call(lambda e: e.block_manager.free("reservation"))  # the transfer gave up its blocks
        items = await _drain(out)
        assert items[-1] is None and sum(len(d.new_token_ids) for d in items[:-1]) == 4
        await loop.stop()

    asyncio.run(main())
