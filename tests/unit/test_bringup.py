"""A worker process's bring-up (``worker.bringup.run_pool``) around a pool that does nothing real."""

from __future__ import annotations

import asyncio
from pathlib import Path

from pdserve.proto import worker_pb2_grpc
from pdserve.worker import agent as agent_mod
from pdserve.worker import bringup
from pdserve.worker.args import WorkerArgs
from pdserve.worker.bringup import Capacity
from pdserve.worker.role import Role
from pdserve.worker.shell import ShellState, WorkerShell


class _SlowPool:
    """``load`` waits until released; records that it was closed."""

    def __init__(self, shell: WorkerShell) -> None:
        self.shell = shell
        self.servicer = worker_pb2_grpc.WorkerServicer()
        self.servicer.load = lambda: None  # type: ignore[attr-defined]
        self.loading = asyncio.Event()
        self.release = asyncio.Event()
        self.closed = False
        self.failure = None

    async def load(self, model_dir: Path) -> Capacity:
        self.loading.set()
        await self.release.wait()
        return Capacity(kv_blocks_total=8, context_length=64, dtype="float32", device="cpu")

    async def close(self) -> None:
        self.closed = True


def test_a_worker_told_to_stop_while_it_loads_never_joins(monkeypatch, tmp_path) -> None:
    """A SIGTERM (``pdserve down``, a deleted pod) during the model load: once the load returns the worker
    stops; it does not register with the router and serve for an instant first."""
    registered: list[object] = []

    async def register(self) -> None:  # type: ignore[no-untyped-def]
        registered.append(self)

    monkeypatch.setattr(agent_mod.RouterAgent, "register", register)
    monkeypatch.setattr(bringup, "resolve_model", lambda model, cache_dir=None: tmp_path)
    args = WorkerArgs(role=Role.DECODE, router="127.0.0.1:1", worker_id="w", model=str(tmp_path), port=0)
    pools: list[_SlowPool] = []

    def build(shell: WorkerShell, _registry: object) -> _SlowPool:
        pools.append(_SlowPool(shell))
        return pools[0]

    async def main() -> None:
        run = asyncio.create_task(bringup.run_pool(args, build))
        while not pools or not pools[0].loading.is_set():
            await asyncio.sleep(0.01)
        pool = pools[0]
        pool.shell._on_signal()  # what SIGTERM runs
        assert pool.shell.state in (ShellState.DRAINING, ShellState.STOPPED)
        pool.release.set()
        await asyncio.wait_for(run, 30)
        assert pool.closed and pool.shell.state is ShellState.STOPPED

    asyncio.run(main())
    assert registered == []
