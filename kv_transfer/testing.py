"""Two-process harness for the KV transfer tests and benchmark.

A :class:`PeerProcess` is a spawned process running an event loop (uvloop by
default, like the serving path) with a KV tensor and a BlockManager. It can
act as a decode receiver, a prefill sender (a fake forward thread pushes the
layers), or a raw-ucxx baseline, and answers commands sent over a pipe.
KV contents are seeded random bytes, so both sides can check bit-exactness
without shipping tensors: the sender writes ``expected_bytes(seed)`` into its
blocks and the receiver compares its blocks with the same bytes.

The parent always stops its peers: use it as a context manager, or call
``stop()``/``kill()``; the child also exits when the parent's pipe closes.
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.block_manager import BlockManager
from kv_transfer.config import TransferConfig


@dataclass(frozen=True)
class PeerSpec:
    num_layers: int = 30  # SmolLM2-135M
    num_kv_heads: int = 3
    head_dim: int = 64
    block_size: int = 16
    num_blocks: int = 256
    dtype: str = "bfloat16"
    model_id: str = "smollm2-135m"
    config: TransferConfig = field(default_factory=TransferConfig)
    env: tuple[tuple[str, str], ...] = ()  # e.g. (("UCX_TLS", "tcp"),), applied before ucxx loads
    threads: int = 1
    use_uvloop: bool = True
    huge_pages: bool = True  # back the KV tensor with transparent huge pages (kvbuf.advise_huge_pages)


class PeerCallError(RuntimeError):
    """The peer raised; ``kind`` is the exception's class name (e.g. "PeerDiedError")."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


def expected_bytes(seed: int, num_layers: int, num_blocks: int, block_bytes: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_layers, num_blocks, block_bytes), dtype=torch.uint8, generator=gen)


def scatter_allocate(bm: BlockManager, seq_id: str, num_tokens: int, keep_every: int) -> list[int]:
    """Allocate with non-contiguous block ids: take every free block, give back a pattern, allocate.

    Of the free blocks (in free-list order) every ``keep_every``-th stays taken
    while the request allocates, so its runs have length ``keep_every - 1``
    (2: every other block). Needs about ``keep_every / (keep_every - 1)`` times
    the request's blocks free.
    """
    fillers = [f"__filler_{seq_id}_{i}" for i in range(bm.num_free)]
    for f in fillers:
        bm.allocate(f, 1)
    for i, f in enumerate(fillers):
        if i % keep_every != 0:
            bm.free(f)
    try:
        return bm.allocate(seq_id, num_tokens)
    finally:
        for f in fillers:
            bm.free(f)


class PeerProcess:
    def __init__(self, spec: PeerSpec, name: str = "peer") -> None:
        ctx = mp.get_context("spawn")
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
    from kv_transfer.peer_commands import PeerState

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
            if not type(exc).__module__.startswith("kv_transfer"):  # unexpected: keep the trace
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


def fingerprint(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
