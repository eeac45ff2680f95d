"""The parent side of the harness: :class:`PeerProcess` starts a peer, forked from a server that has
imported torch, and calls it over a pipe; the child runs an event loop (uvloop by default) with a KV tensor
and a BlockManager and hands each command to ``child.PeerState``. The parent always stops its peers (a
context manager, or ``stop()``/``kill()``); a child also exits when the parent's pipe closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from pdserve.kv_transfer.testing.spec import PeerCallError, PeerSpec


class PeerProcess:
    def __init__(self, spec: PeerSpec, name: str = "peer") -> None:
        ctx = _context()
        self._conn, child = ctx.Pipe()
        self.name = name
        self.proc = ctx.Process(target=_child_main, args=(child, spec), name=name, daemon=True)
        self.proc.start()
        child.close()
        self._ids = iter(range(1, 1 << 62))
        self._replies: dict[int, tuple[bool, Any]] = {}
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, name=f"{name}-replies", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                msg_id, ok, value = self._conn.recv()
            except (EOFError, OSError):
                break
            with self._cond:
                self._replies[msg_id] = (ok, value)
                self._cond.notify_all()
        with self._cond:
            self._replies[-1] = (False, ("EOFError", "peer process exited"))
            self._cond.notify_all()

    def submit(self, command: str, **kwargs: Any) -> int:
        msg_id = next(self._ids)
        self._conn.send((msg_id, command, kwargs))
        return msg_id

    def result(self, msg_id: int, timeout: float = 60.0) -> Any:
        end = time.monotonic() + timeout
        with self._cond:
            while msg_id not in self._replies:
                if -1 in self._replies:
                    raise PeerCallError(*self._replies[-1][1])
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.name}: no reply to call {msg_id} within {timeout}s")
                self._cond.wait(left)
            ok, value = self._replies.pop(msg_id)
        if not ok:
            raise PeerCallError(*value)
        return value

    def call(self, command: str, timeout: float = 60.0, **kwargs: Any) -> Any:
        return self.result(self.submit(command, **kwargs), timeout)

    def kill(self) -> None:
        if self.proc.is_alive() and self.proc.pid is not None:
            # A forkserver reaps the peer before it reports the exit: "alive" may name a pid already gone.
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.is_alive():
            try:
                self.call("shutdown", timeout=timeout)
            except Exception:  # dead, stuck or already gone: kill below
                pass
            self.proc.join(timeout)
        self.kill()
        self._conn.close()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


_PRELOAD = ["torch", "pdserve.kv_transfer.testing.child"]


def _context() -> Any:
    """Peers fork from one server process that has imported torch and the child's modules already (a
    spawned peer spent seconds importing them, most of a short test on a small CPU). The server does
    nothing else: no UCX context, no CUDA, no torch thread pool exist before a peer forks."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


@contextmanager
def running_peers(peers: Sequence[tuple[str, PeerSpec]], receivers: int = 1) -> Iterator[list[PeerProcess]]:
    """Spawn a peer per (name, spec); the first ``receivers`` start their receiver, the others have
    answered once. Every peer is stopped on exit, whatever happened."""
    procs: list[PeerProcess] = []
    try:
        for name, spec in peers:
            procs.append(PeerProcess(spec, name))
        for i, p in enumerate(procs):
            p.call("start_receiver" if i < receivers else "blocks", timeout=120)
        yield procs
    finally:
        for p in procs:
            p.stop()


# -- child side ----------------------------------------------------------------


def _child_main(conn: Any, spec: PeerSpec) -> None:
    os.environ.update(dict(spec.env))
    torch.set_num_threads(spec.threads)
    if spec.use_uvloop:
        import uvloop

        uvloop.run(_serve(conn, spec))
    else:
        asyncio.run(_serve(conn, spec))


async def _serve(conn: Any, spec: PeerSpec) -> None:
    from pdserve.kv_transfer.testing.child import PeerState

    loop = asyncio.get_running_loop()
    state = PeerState(spec)
    stop = asyncio.Event()
    send_lock = threading.Lock()

    def reply(msg_id: int, ok: bool, value: Any) -> None:
        with send_lock:
            try:
                conn.send((msg_id, ok, value))
            except (OSError, BrokenPipeError):
                stop.set()

    async def run(msg_id: int, command: str, kwargs: dict[str, Any]) -> None:
        if command == "shutdown":
            await state.close()
            reply(msg_id, True, None)
            stop.set()
            return
        try:
            value = await state.dispatch(command, kwargs)
        except Exception as exc:
            detail = str(exc)
            if not type(exc).__module__.startswith("pdserve.kv_transfer"):  # unexpected: keep the trace
                detail += "\n" + traceback.format_exc(limit=5)
            reply(msg_id, False, (type(exc).__name__, detail))
        else:
            reply(msg_id, True, value)

    running: set[asyncio.Task[None]] = set()  # the loop keeps only weak references to tasks

    def spawn(coro: Any) -> None:
        task = loop.create_task(coro)
        running.add(task)
        task.add_done_callback(running.discard)

    def read() -> None:
        while True:
            try:
                msg_id, command, kwargs = conn.recv()
            except (EOFError, OSError):
                loop.call_soon_threadsafe(stop.set)
                return
            loop.call_soon_threadsafe(spawn, run(msg_id, command, kwargs))

    threading.Thread(target=read, name="commands", daemon=True).start()
    await stop.wait()
    await state.close()
