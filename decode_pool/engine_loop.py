"""The bridge between a decode worker's asyncio side (gRPC, KV receiver) and the one thread that owns and
steps its engine: commands run on that thread between steps, and each request's deltas come back through
an ``asyncio.Queue``. Which thread may touch the engine's blocks: ``kv_transfer/__init__.py``."""

from __future__ import annotations

import asyncio
import enum
import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pdserve.engine.llm_engine import LLMEngine, RequestOutputDelta
from pdserve.engine.params import SamplingParams
from pdserve.engine.scheduler import Batch
from pdserve.worker import failures
from pdserve.worker.failures import FailureStreak

T = TypeVar("T")
log = logging.getLogger(__name__)

MAX_FAILED_STEPS = failures.LIMIT  # failed steps in a row: the engine is broken, not one batch


class EngineDied(RuntimeError):
    """The engine thread ended on an error: this worker can serve nothing more."""


class StepFailed(RuntimeError):
    """A step failed: its requests (every request of the engine) end with this; another worker may serve
    them."""


class _Op(enum.Enum):
    ADD = "add"
    ADD_PREFILLED = "add_prefilled"
    ADD_CHOICES = "add_choices"  # an n > 1 request's open choices, moved here after some output
    ADD_MIGRATED = "add_migrated"  # a decoding stream moved here live, its KV in blocks it holds
    ABORT = "abort"
    CALL = "call"
    STOP = "stop"


@dataclass
class _Cmd:
    op: _Op
    request_id: Hashable = None
    args: tuple[Any, ...] = ()
    future: asyncio.Future[Any] | None = None
    queue: asyncio.Queue[QueueItem] | None = None  # the attempt an ADD or ABORT is of


# What a request's queue carries: deltas, then None when the request is gone, or
# an exception when the engine refused or failed it.
QueueItem = RequestOutputDelta | BaseException | None


class EngineLoop:
    """``LLMEngine`` is not thread-safe and its ``step()`` blocks for a whole forward, so one thread owns it
    and the asyncio side never touches it: it queues commands (add, add-prefilled, abort, call) and reads
    deltas fed with ``call_soon_threadsafe``."""

    def __init__(
        self,
        engine: LLMEngine,
        loop: asyncio.AbstractEventLoop,
        *,
        idle_wait_s: float = 0.05,
        step_delay_s: float = 0.0,
    ) -> None:
        self.engine = engine
        self._loop = loop
        self._idle_wait_s = idle_wait_s
        self._step_delay_s = step_delay_s  # failure injection for tests (WorkerArgs.fault_step_delay_s)
        self._cmds: queue.SimpleQueue[_Cmd] = queue.SimpleQueue()
        self._queues: dict[Hashable, asyncio.Queue[QueueItem]] = {}  # (event loop) the newest attempt's
        # (Engine thread) whose attempt the engine's request under an id is: its deltas go to that queue
        # only, whatever newer attempt of the id ``submit`` registered meanwhile (a retry of the id).
        self._owners: dict[Hashable, asyncio.Queue[QueueItem]] = {}
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.last_batch_size = 0
        self._on_step: Callable[[float, Batch], None] | None = None
        self._on_fatal: Callable[[EngineDied], None] | None = None
        self.failure: EngineDied | None = None  # set once the thread died
        self._failures = FailureStreak()  # failed steps in a row (worker.failures)
        self._step_hook_failed = False

    @classmethod
    async def build(
        cls,
        factory: Callable[[], LLMEngine],
        *,
        idle_wait_s: float = 0.05,
        step_delay_s: float = 0.0,
        on_fatal: Callable[[EngineDied], None] | None = None,
    ) -> EngineLoop:
        """Build the engine with ``factory()`` on the loop's own thread, then start stepping there. Use this
        rather than building the engine elsewhere: the CPU kernels' OpenMP pools belong to the thread that
        calls them (docs/engine.md, "One thread")."""
        loop = asyncio.get_running_loop()
        built: asyncio.Future[EngineLoop] = loop.create_future()

        def main() -> None:
            try:
                engine_loop = cls(factory(), loop, idle_wait_s=idle_wait_s, step_delay_s=step_delay_s)
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
                cls._resolve_on(loop, built, exc=e)
                return
            engine_loop._thread = threading.current_thread()
            engine_loop._on_fatal = on_fatal  # before the first step: a death then drains the worker too
            cls._resolve_on(loop, built, engine_loop)
            engine_loop._run()

        threading.Thread(target=main, name="engine-loop", daemon=True).start()
        return await built

    @staticmethod
    def _resolve_on(
        loop: asyncio.AbstractEventLoop,
        fut: asyncio.Future[Any],
        value: Any = None,
        exc: BaseException | None = None,
    ) -> None:
        def done() -> None:
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(value)

        loop.call_soon_threadsafe(done)

    # -- asyncio side ----------------------------------------------------------
    def start(self) -> None:
        """Start stepping an engine given to the constructor (``build`` starts its own)."""
        self._thread.start()

    async def stop(self) -> None:
        if self.failure is None:
            fut = self._loop.create_future()
            self._put_cmd(_Cmd(_Op.STOP, future=fut))
            await fut
        await asyncio.to_thread(self._thread.join, 5)

    def on_step(self, fn: Callable[[float, Batch], None]) -> None:
        """``fn(seconds, batch)`` runs on the engine thread after every step (``batch``: what it ran).
        An error in it is logged; it does not stop the engine."""
        self._on_step = fn

    def on_step_failed(self, fn: Callable[[], object]) -> None:
        """``fn()`` runs on the engine thread after every failed step (a metric)."""
        self._failures.on_failure = fn

    def on_fatal(self, fn: Callable[[EngineDied], None]) -> None:
        """``fn(error)`` runs on the event loop once, if the engine thread dies."""
        self._on_fatal = fn

    def _put_cmd(self, cmd: _Cmd) -> None:
        """Queue a command for the thread; once it died, the command fails at once (a command queued as
        it died is failed by whichever side sees it last)."""
        self._cmds.put(cmd)
        if self.failure is not None:
            self._fail_pending(self.failure)

    def submit(
        self,
        request_id: Hashable,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        output_offset: int = 0,
    ) -> asyncio.Queue[QueueItem]:
        """``output_offset``: a migrated stream's tokens already sent (``LLMEngine.add_request``)."""
        q: asyncio.Queue[QueueItem] = asyncio.Queue()
        self._queues[request_id] = q
        self._put_cmd(_Cmd(_Op.ADD, request_id, (list(prompt_token_ids), params, output_offset), queue=q))
        return q

    def submit_prefilled(
        self,
        request_id: Hashable,
        prompt_token_ids: Sequence[int],
        first_token_id: int,
        params: SamplingParams,
        choice_token_ids: Sequence[int] = (),
    ) -> asyncio.Queue[QueueItem]:
        """``choice_token_ids``: an ``n`` > 1 request's other choices' first tokens (``first_token_id``
        is choice 0's): they fork from the prompt's blocks (``LLMEngine.add_prefilled_choices``)."""
        q: asyncio.Queue[QueueItem] = asyncio.Queue()
        self._queues[request_id] = q
        firsts = (first_token_id, *choice_token_ids)
        self._put_cmd(_Cmd(_Op.ADD_PREFILLED, request_id, (list(prompt_token_ids), firsts, params), queue=q))
        return q

    def submit_migrated(
        self, request_id: Hashable, token_ids: Sequence[int], output_offset: int, params: SamplingParams
    ) -> asyncio.Queue[QueueItem]:
        """A decoding stream moved here live (``LLMEngine.add_migrated_request``)."""
        q: asyncio.Queue[QueueItem] = asyncio.Queue()
        self._queues[request_id] = q
        self._put_cmd(_Cmd(_Op.ADD_MIGRATED, request_id, (list(token_ids), output_offset, params), queue=q))
        return q

    def submit_choices(
        self,
        request_id: Hashable,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        choices: Sequence[tuple[int, Sequence[int]]],
    ) -> asyncio.Queue[QueueItem]:
        """An ``n`` > 1 request's open choices after a migration (``LLMEngine.add_resumed_choices``)."""
        q: asyncio.Queue[QueueItem] = asyncio.Queue()
        self._queues[request_id] = q
        self._put_cmd(_Cmd(_Op.ADD_CHOICES, request_id, (list(prompt_token_ids), params, choices), queue=q))
        return q

    def abort(self, request_id: Hashable, attempt: asyncio.Queue[QueueItem] | None = None) -> None:
        """Free everything the engine holds for the attempt ``attempt`` (the queue ``submit`` returned;
        None: the id's newest) of the id (idempotent); its queue gets None. A newer attempt of the same id
        (a retry) is left alone, whichever of the two the engine thread sees first."""
        q = attempt if attempt is not None else self._queues.get(request_id)
        self._put_cmd(_Cmd(_Op.ABORT, request_id, queue=q))

    def end_earlier_attempt(self, request_id: Hashable) -> None:
        """A new attempt of ``request_id`` is about to start here: end an earlier one still registered
        (its queue gets None, its blocks are freed), before anything the new one queues."""
        q = self._queues.get(request_id)
        if q is not None:
            self.abort(request_id, q)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        fut: asyncio.Future[T] = self._loop.create_future()
        self._put_cmd(_Cmd(_Op.CALL, args=(fn,), future=fut))
        return await fut

    # -- engine thread ------------------------------------------------------------
    def _put(self, request_id: Hashable, item: QueueItem) -> None:
        """To the attempt the engine's request under the id is (``_owners``); a final item ends it."""
        q = self._owners.get(request_id)
        if q is None:
            return
        if item is None or isinstance(item, BaseException):
            del self._owners[request_id]
        self._put_to(request_id, q, item)

    def _put_to(self, request_id: Hashable, q: asyncio.Queue[QueueItem], item: QueueItem) -> None:
        self._loop.call_soon_threadsafe(q.put_nowait, item)
        if item is None or isinstance(item, BaseException):
            self._loop.call_soon_threadsafe(self._forget, request_id, q)

    def _end_all(self, item: QueueItem) -> None:
        """Every attempt's queue, in the engine or still to be added, gets ``item`` (None or an error)."""
        ended = set()
        for rid, q in [*self._owners.items(), *list(self._queues.items())]:
            if id(q) not in ended:
                ended.add(id(q))
                self._put_to(rid, q, item)
        self._owners.clear()

    def _forget(self, request_id: Hashable, q: asyncio.Queue[QueueItem]) -> None:
        """(Event loop.) Drop the ended request's queue: that one, not a newer request's of the same id
        (a client retrying its own id at once) submitted in between."""
        if self._queues.get(request_id) is q:
            del self._queues[request_id]

    def _resolve(
        self, fut: asyncio.Future[Any] | None, value: Any = None, exc: BaseException | None = None
    ) -> None:
        if fut is not None:
            self._resolve_on(self._loop, fut, value, exc)

    def _apply(self, cmd: _Cmd) -> bool:
        """Run one command; False means stop the thread."""
        eng = self.engine
        if cmd.op is _Op.STOP:
            for rid in list(self._owners):
                eng.abort(rid)
            self._end_all(None)
            self._resolve(cmd.future)
            return False
        if cmd.op is _Op.CALL:
            (fn,) = cmd.args
            try:
                self._resolve(cmd.future, fn(eng))
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
                self._resolve(cmd.future, exc=e)
            return True
        if cmd.op is _Op.ABORT:
            if cmd.queue is None:  # no attempt was registered: free what is held under the id, if anything
                if cmd.request_id not in self._owners:
                    eng.abort(cmd.request_id)
                return True
            if self._owners.get(cmd.request_id) is cmd.queue:
                eng.abort(cmd.request_id)
                self._put(cmd.request_id, None)
            # else: that attempt has ended (the engine's request under the id, if any, is a newer one's)
            return True
        rid = cmd.request_id
        old = self._owners.get(rid)
        if old is not None and old is not cmd.queue:
            # An earlier attempt of the id is still in the engine (queued, running): whoever sent it has
            # moved on to this one (a router's retry), and its abort may still be on the way: end it now.
            eng.abort(rid)
            self._put(rid, None)
        if cmd.queue is not None:
            self._owners[rid] = cmd.queue
        try:
            if cmd.op is _Op.ADD:
                eng.add_request(cmd.request_id, *cmd.args)
            elif cmd.op is _Op.ADD_CHOICES:
                eng.add_resumed_choices(cmd.request_id, *cmd.args)
            elif cmd.op is _Op.ADD_MIGRATED:
                eng.add_migrated_request(cmd.request_id, *cmd.args)
            else:
                for delta in eng.add_prefilled_choices(cmd.request_id, *cmd.args):
                    self._put(cmd.request_id, delta)
                if not eng.has_request(cmd.request_id):  # finished at its first token
                    self._put(cmd.request_id, None)
        except BaseException as e:  # noqa: BLE001 - the request fails, the loop goes on
            eng.abort(cmd.request_id)
            self._put(cmd.request_id, e)
        return True

    def _run(self) -> None:
        """The thread never ends silently: ``MAX_FAILED_STEPS`` failed steps in a row, or any error outside
        a step, is the engine's death: every request and pending call gets ``EngineDied``, later ones at
        once, and ``on_fatal`` runs on the event loop (the worker drains and exits, to be replaced)."""
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - the thread must not end silently
            self._die(e)

    def fail(self, cause: BaseException) -> None:
        """The engine can serve nothing more (a tensor-parallel rank is gone): as if its thread had died of
        ``cause``. Safe from any thread; the first death is the one reported."""
        self._die(cause)

    def _die(self, cause: BaseException) -> None:
        if self.failure is not None:  # (a second death, e.g. the thread's own after ``fail``)
            return
        err = EngineDied(f"the engine thread died: {cause!r}")
        err.__cause__ = cause
        log.critical("%s", err, exc_info=cause)
        self.failure = err
        self._fail_pending(err)
        if self._on_fatal is not None:
            try:
                self._loop.call_soon_threadsafe(self._on_fatal, err)
            except RuntimeError:  # the event loop is closed: the process is ending anyway
                pass

    def _fail_pending(self, err: EngineDied) -> None:
        """Every queued command's future and every request's stream end with ``err`` (a STOP succeeds:
        there is nothing left to stop). Safe from either thread."""
        try:
            while True:
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    break
                if cmd.future is not None:
                    self._resolve(cmd.future, exc=None if cmd.op is _Op.STOP else err)
            self._end_all(err)
        except RuntimeError:  # the event loop is closed: no one is waiting any more
            pass

    def _step_done(self, seconds: float, batch: Batch) -> None:
        if self._on_step is None:
            return
        try:
            self._on_step(seconds, batch)
        except Exception:  # a metric must not stop the engine
            if not self._step_hook_failed:
                log.exception("the step callback failed (logged once; the engine goes on)")
                self._step_hook_failed = True

    def _serve(self) -> None:
        eng = self.engine
        stuck = False  # the last step scheduled nothing (waiting requests, no free blocks)
        while True:
            # Commands first: aborts free blocks before the next step needs them. With nothing to step,
            # or work no step can schedule (its blocks held by transfers' reservations, which a command or
            # a receiver's free releases), wait for one up to idle_wait_s rather than spin on the GIL.
            block = stuck or not eng.has_unfinished()
            stuck = False
            while True:
                try:
                    cmd = self._cmds.get(block=block, timeout=self._idle_wait_s if block else None)
                except queue.Empty:
                    break
                if not self._apply(cmd):
                    return
                block = False
            if not eng.has_unfinished():
                continue
            t0 = time.perf_counter()
            try:
                deltas = eng.step()
            except Exception as e:  # fail every request, keep the worker alive (unless it keeps failing)
                broken = self._failures.failed()
                log.exception("engine step failed (%d in a row)", self._failures.count)
                if broken:
                    n = self._failures.count
                    raise RuntimeError(f"{n} engine steps in a row failed, the last: {e!r}") from e
                for rid in list(self._owners):
                    eng.abort(rid)
                self._end_all(StepFailed(f"engine step failed: {e!r}"))
                continue
            self._failures.succeeded()
            stuck = eng.last_batch is None
            dt = time.perf_counter() - t0
            if self._step_delay_s and not stuck:
                time.sleep(self._step_delay_s)
            self.last_batch_size = len(deltas)
            if eng.last_batch is not None:
                self._step_done(dt, eng.last_batch)
            ended = []
            for d in deltas:
                self._put(d.request_id, d)
                if d.finish_reason is not None:
                    ended.append(d.request_id)
            # After every delta of the step: an n > 1 request ends with its last choice.
            for rid in ended:
                if not eng.has_request(rid):
                    self._put(rid, None)
