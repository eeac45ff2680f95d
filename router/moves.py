"""Live migration on the router: a decoding stream moves to another decode worker with its KV, the client's
stream going on with no gap and no duplicate (``LiveMove``), and the watch that asks streams on draining
workers to move (``MoveWatch``). The workers' side is ``decode_pool.migration`` (the worker the stream
leaves) and ``decode_pool.remote`` (the one it comes to)."""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass
from typing import Any

import grpc

from pdserve.proto import generation_pb2, worker_pb2
from pdserve.router.channels import WorkerChannels
from pdserve.router.errors import RelayError, classify
from pdserve.router.jobs import Job, Ledger
from pdserve.router.metrics import RouterMetrics
from pdserve.router.ops import RouterOps
from pdserve.router.registry import Registry, State, Worker
from pdserve.router.stream import DecodeStream, Output, ReadAheadBudget, Write, deliver, next_message
from pdserve.router.validate import Prepared

log = logging.getLogger(__name__)

_EOF = grpc.aio.EOF
_CONTROL_TIMEOUT_S = 10.0  # Suspend, Resume; and the wait for the paused stream's last tokens
_RETRY_S = 1.0  # a move that could not start now is asked again after this
# How long the KV of a moving stream may take to land: generous, the transfer has its own stall watch.
_EXPORT_TIMEOUT_S = 120.0


class MoveOutcome(enum.StrEnum):
    MOVED = "moved"
    DECLINED = "declined"  # not now: no worker with room, the stream not decoding yet, one of several choices
    FAILED = "failed"  # a step failed; the stream went on where it was


class MoveCause(enum.StrEnum):
    DRAIN = "drain"  # its decode worker drains (scale-down, pdserve drain, SIGTERM)
    REBALANCE = "rebalance"  # its decode worker runs far more of this router's streams than the others


@dataclass
class Moved:
    """Where a stream went: relay ``call`` (its first message, the ticket, already read) from ``worker``."""

    worker: Worker
    call: Any


class Finished(Exception):
    """The request ended while its move was prepared (its last tokens came; a stop string)."""


class LiveMove:
    """Moves one relayed stream (``run``), called by ``attempt.Attempt`` when its relay paused for it."""

    def __init__(
        self, channels: WorkerChannels, ops: RouterOps, budget: ReadAheadBudget, metrics: RouterMetrics | None
    ) -> None:
        self._channels = channels
        self._ops = ops
        self._budget = budget
        self._metrics = metrics
        self.moving = 0  # moves under way (``pdserve status``)

    async def run(
        self,
        job: Job,
        prep: Prepared,
        out: Output,
        write: Write,
        d: Worker,
        stream: DecodeStream,
        timeout: float | None,
        deadline_unix: float,
    ) -> Moved | None:
        """Move the job's stream off ``d``: None when it stays (declined or failed: relay ``stream`` on).
        Raises Finished when the request ended meanwhile, RelayError when ``d`` failed under it."""
        cause, job.move = job.move, ""
        started = time.perf_counter()
        self.moving += 1
        outcome, moved, kv_bytes = MoveOutcome.FAILED, None, 0
        try:
            moved, kv_bytes = await self._move(job, prep, out, write, d, stream, timeout, deadline_unix)
            outcome = MoveOutcome.MOVED if moved is not None else MoveOutcome.DECLINED
        except Finished:
            outcome = MoveOutcome.DECLINED
            raise
        except _Failed as e:
            log.warning(
                "request %s: live move off %s failed: %s; it stays there", prep.request_id, d.worker_id, e
            )
        finally:
            self.moving -= 1
            if moved is None:
                job.move_after = time.monotonic() + _RETRY_S
            else:  # (asked again while it moved, for the worker it left)
                job.move, job.moved_at = "", time.monotonic()
            if self._metrics is not None:
                self._metrics.live_move(cause, outcome.value, time.perf_counter() - started, kv_bytes)
        return moved

    async def _move(
        self,
        job: Job,
        prep: Prepared,
        out: Output,
        write: Write,
        d: Worker,
        stream: DecodeStream,
        timeout: float | None,
        deadline_unix: float,
    ) -> tuple[Moved | None, int]:
        if out.n != 1 or job.route is None or job.route.decode_unused:
            return None, 0
        wid = self._channels.worker_request_id(prep.request_id)
        meta = self._channels.metadata(prep.request_id)
        src = self._channels.stub(d.address)
        # Where to: chosen before anything pauses; counted there once the move is done.
        sent = len(out.sent)
        target = self._ops.move_target(job, d, len(prep.prompt_token_ids) + sent + 1)
        if target is None:
            return None, 0
        dest = target.decode
        try:
            paused = await src.Suspend(
                worker_pb2.SuspendRequest(request_id=wid), timeout=_CONTROL_TIMEOUT_S, metadata=meta
            )
        except grpc.aio.AioRpcError as e:
            # Not decoding (yet, or any more); or a worker that cannot move streams live (an older build):
            # the stream stays and ends there.
            if e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED):
                return None, 0
            raise classify(job, d, "decode", e, self._ops) from None
        dcall = None
        try:
            await self._catch_up(out, write, stream, len(paused.output_token_ids))
            outputs = list(out.sent)
            if outputs != list(paused.output_token_ids):
                raise _Failed(f"the relayed tokens differ from the {len(outputs)} the worker holds")
            req = self._migrate_request(prep, wid, outputs, deadline_unix)
            if req is None:  # everything was sent but the finish
                await deliver(out, (), len(outputs), "length", write)
                raise Finished
            dcall = self._channels.stub(dest.address).Generate(req, timeout=timeout, metadata=meta)
            job.calls.append(dcall)
            try:
                first = await asyncio.wait_for(dcall.read(), _CONTROL_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                classify(job, dest, "decode", e, self._ops)  # (a dead destination is told to the router)
                raise
            if first is _EOF or not first.transfer_ticket:
                raise _Failed(f"{dest.worker_id} answered the move without a ticket")
            exported = await src.ExportKV(
                worker_pb2.ExportKVRequest(request_id=wid, transfer_ticket=first.transfer_ticket),
                timeout=_EXPORT_TIMEOUT_S,
                metadata=meta,
            )
        except (grpc.aio.AioRpcError, TimeoutError, _Failed) as e:
            if dcall is not None:
                dcall.cancel()  # its reservation is freed (after the transfer, if one started, settled)
            await self._resume(job, d, src, wid, meta)
            raise e if isinstance(e, _Failed) else _Failed(_describe(e)) from None
        except BaseException:
            if dcall is not None:
                dcall.cancel()
            raise
        # The destination holds the KV and decodes from here: the source's call ends (it frees the stream).
        stream.close(self._budget)
        self._ops.moved(job, target, len(prep.prompt_token_ids) + len(outputs))
        log.info(
            "request %s: moved live from %s to %s after %d tokens (%d KV bytes)",
            prep.request_id,
            d.worker_id,
            dest.worker_id,
            len(outputs),
            exported.transfer_bytes,
        )
        return Moved(dest, dcall), exported.transfer_bytes

    async def _catch_up(self, out: Output, write: Write, stream: DecodeStream, count: int) -> None:
        """Relay what the paused stream sent before its pause, up to ``count`` output tokens (their
        logprobs come with them)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + _CONTROL_TIMEOUT_S
        while out.choices[0].detok.count < count:
            try:
                m = await asyncio.wait_for(next_message(stream, self._budget), max(end - loop.time(), 0.0))
            except TimeoutError:
                raise _Failed(f"the paused stream's tokens up to {count} did not come") from None
            if isinstance(m, BaseException):
                raise m
            if m is _EOF:
                raise _Failed("the paused stream ended")
            if not hasattr(m, "token_ids"):  # (the move sentinel)
                continue
            lps = m.logprobs if out.logprobs is not None else ()
            if await deliver(out, m.token_ids, m.first_index, m.finish_reason, write, lps, m.index):
                raise Finished

    @staticmethod
    def _migrate_request(
        prep: Prepared, wid: str, outputs: list[int], deadline_unix: float
    ) -> worker_pb2.WorkerGenerateRequest | None:
        """The destination's request: the prompt and every token so far, with what is left to generate."""
        p = prep.params
        k = len(outputs)
        if k >= p.max_tokens:
            return None
        sampling = generation_pb2.SamplingParams()
        sampling.CopyFrom(prep.sampling)
        sampling.max_tokens = p.max_tokens - k
        sampling.min_tokens = max(p.min_tokens - k, 0)
        sampling.ClearField("prompt_logprobs")  # (sent with token 0)
        return worker_pb2.WorkerGenerateRequest(
            request_id=wid,
            prompt_token_ids=[*prep.prompt_token_ids, *outputs],
            sampling=sampling,
            mode=worker_pb2.PREFILL_MODE_MIGRATE,
            deadline_unix=deadline_unix,
            output_offset=k,
        )

    async def _resume(self, job: Job, d: Worker, src: Any, wid: str, meta: Any) -> None:
        """The move failed: the stream goes on where it was. If that worker is gone, the relay's failure
        path moves the stream (re-prefill)."""
        try:
            await src.Resume(
                worker_pb2.SuspendRequest(request_id=wid), timeout=_CONTROL_TIMEOUT_S, metadata=meta
            )
        except grpc.aio.AioRpcError as e:
            if e.code() is grpc.StatusCode.NOT_FOUND:  # ended meanwhile (e.g. cancelled): nothing to resume
                return
            raise classify(job, d, "decode", e, self._ops) from None


class _Failed(Exception):
    """A step of the move failed; the stream stays where it was."""


def _describe(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    if isinstance(e, TimeoutError):
        return "timed out"
    return str(e)


@dataclass(frozen=True)
class RebalanceConfig:
    """When the watch moves streams off a decode worker that runs far more of this router's streams than
    the pool's mean: it starts once the busiest worker runs at least ``start_ratio`` x the mean and
    ``min_excess`` more than the least busy one, and goes on (one stream at a time, at most
    ``moves_per_s``) until the busiest is within ``stop_ratio`` x the mean (hysteresis)."""

    enabled: bool = True
    start_ratio: float = 1.5
    stop_ratio: float = 1.2
    min_excess: int = 4
    moves_per_s: float = 2.0
    settle_s: float = 10.0  # a stream moved live is not moved again to even the batches this soon

    def __post_init__(self) -> None:
        if not 1.0 <= self.stop_ratio <= self.start_ratio:
            raise ValueError("rebalance ratios need 1 <= stop_ratio <= start_ratio")
        if self.min_excess < 1 or self.moves_per_s <= 0 or self.settle_s < 0:
            raise ValueError("rebalance needs min_excess >= 1, moves_per_s > 0 and settle_s >= 0")


class MoveWatch:
    """Asks streams to move live, a tick at a time (their relays move them): every stream on a draining
    decode worker, and, to even the decode batches, one stream at a time off a worker far busier than the
    others (``RebalanceConfig``). It only ever asks this router's streams, so several routers never move
    one stream twice."""

    def __init__(
        self,
        registry: Registry,
        ledger: Ledger,
        rebalance: RebalanceConfig | None = None,
        interval_s: float = 0.2,
    ) -> None:
        self._registry = registry
        self._ledger = ledger
        self._rebalance = rebalance or RebalanceConfig()
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self._relieving: set[str] = set()  # workers the rebalancer moves streams off (until even)
        self._next_move = 0.0  # time.monotonic(): the rebalancer's rate limit

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def tick(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        draining = {w.worker_id for w in self._registry if w.role.decodes and w.state is State.DRAINING}
        by_worker: dict[str, list[Job]] = {}
        for job in self._ledger:
            r = job.route
            if r is None or r.decode_unused:
                continue
            if r.decode.worker_id in draining:
                job.request_move(MoveCause.DRAIN)
            else:
                by_worker.setdefault(r.decode.worker_id, []).append(job)
        if self._rebalance.enabled and now >= self._next_move:
            pick = self._to_rebalance(by_worker, now)
            if pick is not None:
                pick.request_move(MoveCause.REBALANCE)
                self._next_move = now + 1.0 / self._rebalance.moves_per_s

    def _to_rebalance(self, by_worker: dict[str, list[Job]], now: float) -> Job | None:
        """The stream to move off the busiest decode worker now, if the pool is uneven enough. A stream
        already asked to move counts as gone to the least busy worker (its move takes a while)."""
        cfg = self._rebalance
        ready = [w.worker_id for w in self._registry.ready() if w.role.decodes]
        counts = {wid: sum(1 for j in by_worker.get(wid, ()) if not j.move) for wid in ready}
        if len(counts) < 2:
            self._relieving.clear()
            return None
        least_id = min(counts, key=lambda wid: counts[wid])
        counts[least_id] += sum(1 for wid in ready for j in by_worker.get(wid, ()) if j.move)
        mean = sum(counts.values()) / len(counts)
        busiest = max(counts, key=lambda wid: counts[wid])
        n, least = counts[busiest], min(counts.values())
        self._relieving &= set(counts)
        if busiest in self._relieving:
            if n <= cfg.stop_ratio * mean or n - least <= 1:
                self._relieving.discard(busiest)
                return None
        elif n >= cfg.start_ratio * mean and n - least >= cfg.min_excess:
            self._relieving.add(busiest)
        else:
            return None
        # The one with the least KV to move (a move copies its whole context), not moved lately.
        candidates = [
            j
            for j in by_worker[busiest]
            if not j.move and j.kv_blocks > 0 and now - j.moved_at >= cfg.settle_s and now >= j.move_after
        ]
        return min(candidates, key=lambda j: j.kv_blocks, default=None)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the watch must go on
                log.exception("the live-move watch failed a tick")


__all__ = [
    "Finished",
    "LiveMove",
    "MoveCause",
    "MoveOutcome",
    "MoveWatch",
    "Moved",
    "RebalanceConfig",
    "RelayError",
]
