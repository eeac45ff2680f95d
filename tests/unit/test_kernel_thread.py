"""One thread per worker process makes every parallel CPU call (the C kernels' and torch's OpenMP regions).

Why: both run on the libgomp torch loads, whose pools belong to the thread that opens a parallel region.
Once the threads libgomp manages outnumber the CPUs, its idle workers stop spinning and sleep, and every
region (a decode step has ~150) pays a wake-up: on a 2-core host the kernels ran at half speed, and a
colocated worker's single-stream TPOT was 15.9 ms against 9.7 ms with the rule kept (the engine had been
built on asyncio's executor thread and stepped on another). No timing here: these tests check the rule.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from pdserve.decode_pool import app as decode_app
from pdserve.decode_pool.engine_loop import EngineLoop
from pdserve.engine.params import SamplingParams
from pdserve.prefill_pool import app as prefill_app
from pdserve.worker.args import WorkerArgs
from pdserve.worker.role import Role
from pdserve.worker.shell import WorkerShell


def _args(role: Role, model: Path) -> WorkerArgs:
    return WorkerArgs(role=role, router="r:1", worker_id="w", model=str(model), dtype="float32", kv_blocks=32)


def test_a_colocated_worker_builds_and_steps_its_engine_on_one_thread(tiny_llama_dir, monkeypatch) -> None:
    seen: dict[str, set[int]] = {"build": set(), "step": set()}
    real = decode_app.LLMEngine

    def build(*a, **kw):
        seen["build"].add(threading.get_ident())
        return real(*a, **kw)

    monkeypatch.setattr(decode_app, "LLMEngine", build)

    async def main() -> None:
        args = _args(Role.BOTH, tiny_llama_dir)
        pool = decode_app.DecodePool(args, WorkerShell(args.shell_config()), CollectorRegistry())
        await pool.load(Path(tiny_llama_dir))
        assert pool.loop is not None
        try:
            pool.loop.on_step(lambda _s, _n: seen["step"].add(threading.get_ident()))
            q = pool.loop.submit("r", [1, 2, 3, 4], SamplingParams(max_tokens=4, ignore_eos=True))
            while (item := await asyncio.wait_for(q.get(), 60)) is not None:
                assert not isinstance(item, BaseException), item
            assert await pool.loop.call(lambda e: e.block_manager.num_used) == 0
        finally:
            await pool.close()

    asyncio.run(main())
    assert len(seen["build"]) == 1 and seen["build"] == seen["step"]
    assert threading.get_ident() not in seen["build"]  # not the event loop's thread either


def test_engine_loop_build_hands_back_a_failed_build() -> None:
    def broken():
        raise RuntimeError("no model here")

    async def main() -> None:
        with pytest.raises(RuntimeError, match="no model here"):
            await EngineLoop.build(broken)

    asyncio.run(main())


def test_a_prefill_worker_builds_its_runner_on_its_forward_thread(tiny_llama_dir, monkeypatch) -> None:
    built: set[int] = set()
    real = prefill_app.build_runner

    def build(*a, **kw):
        built.add(threading.get_ident())
        return real(*a, **kw)

    monkeypatch.setattr(prefill_app, "build_runner", build)

    async def main() -> None:
        args = _args(Role.PREFILL, tiny_llama_dir)
        pool = prefill_app.PrefillPool(args, WorkerShell(args.shell_config()), CollectorRegistry())
        try:
            await pool.load(Path(tiny_llama_dir))
            forward = pool.forward_thread.submit(threading.get_ident).result()
            assert built == {forward} and forward != threading.get_ident()
            # The loop runs every forward (and the sampling after it) on that same executor.
            assert pool.loop is not None and pool.loop._forward_thread is pool.forward_thread
        finally:
            await pool.close()

    asyncio.run(main())
