"""How a request ends in error: ``RelayError`` (its gRPC status, and whether it may move to another
worker) and the classification of a failed worker call."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from pdserve.router.jobs import Failure, Job
from pdserve.router.ops import RouterOps
from pdserve.router.registry import Worker
from pdserve.worker.role import Role
from pdserve.worker.shell import REJECT_METADATA_KEY, RETRY_ELSEWHERE_KEY


class RelayError(Exception):
    """The request ends with this gRPC status. ``migrate``: what failed under it when a healthy worker
    could take the request over (``metrics.MIGRATION_REASONS``); "" when it must end."""

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str,
        migrate: str = "",
        worker_id: str = "",
        rejected: bool = False,
        retry_after_s: int = 0,
    ) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.migrate = migrate
        self.worker_id = worker_id  # the worker that failed, not to be routed to again (when migrating)
        # Refused for want of room, as the admission queue refuses: counted as a rejection, not an error.
        self.rejected = rejected
        # A refusal for load that knows when the request would fit (the TTFT budget's): seconds, 0: unknown.
        self.retry_after_s = retry_after_s

    @classmethod
    def of(cls, failure: Failure) -> RelayError:
        # The sweep fails a job with UNAVAILABLE when one of its workers missed heartbeats; a worker seen
        # dead by another request's call fails its jobs with the reason it was seen with.
        migrate = failure.reason or ("heartbeat_lost" if failure.code == "UNAVAILABLE" else "")
        return cls(grpc.StatusCode[failure.code], failure.details, migrate, failure.worker_id)


class ClientGone(asyncio.CancelledError):
    """A write to the client failed because the client went away (its cancel or deadline): the request
    ends as a cancel, even where a worker failure was recorded at the same moment (no move for nobody)."""


def cancelling() -> bool:
    """The current task is being cancelled (not one of its worker calls)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def worker_failure(job: Job, e: asyncio.CancelledError) -> RelayError | None:
    """The job's recorded failure, when ``e`` is the cancel ``Job.fail`` gave its worker call: not a cancel
    of this task, nor the client gone during a write."""
    if job.failure is None or cancelling() or isinstance(e, ClientGone):
        return None
    return RelayError.of(job.failure)


def is_batch_error(e: BaseException) -> bool:
    """grpc.aio's internal ExecuteBatchError: an operation on a call that already ended (client gone)."""
    return type(e).__name__ == "ExecuteBatchError"


def outcome(task: asyncio.Future, job: Job, w: Worker, role: str, ops: RouterOps) -> Any:
    """The result of a finished worker call on ``w``, or its failure as a RelayError."""
    try:
        return task.result()
    except grpc.aio.AioRpcError as e:
        raise classify(job, w, role, e, ops) from None
    except asyncio.CancelledError:
        if job.failure is not None:
            raise RelayError.of(job.failure) from None
        raise


def classify(job: Job, w: Worker, role: str, e: grpc.aio.AioRpcError, ops: RouterOps) -> RelayError:
    """What a failed call to ``w`` (in ``role``) means for the request, and for ``w`` (told to ``ops``)."""
    if job.failure is not None:
        return RelayError.of(job.failure)
    code = e.code()
    trailing = e.trailing_metadata() or ()
    # In messages a worker is named by its role ("colocated" for role both); ``role`` is the call's.
    where = f"{'colocated' if w.role is Role.BOTH else role} worker {w.worker_id}"
    if any(k == RETRY_ELSEWHERE_KEY for k, _ in trailing):
        # A failed engine step or prefill forward: the worker lives on; another one serves the request.
        return RelayError(code, f"{where} failed: {e.details()}", "step_failed", w.worker_id)
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        # The request's time ran out (the client's deadline or --request-timeout): no worker failed.
        return RelayError(code, f"the request passed its deadline (it was on {where})")
    details = f"{where} failed: {code.name}: {e.details()}"
    lost = f"{role}_failed"
    if code is grpc.StatusCode.UNAVAILABLE:
        draining = any(k == REJECT_METADATA_KEY for k, _ in trailing)
        ops.worker_failed(w, not draining, details)
        return RelayError(code, details, lost, w.worker_id)
    if code is grpc.StatusCode.CANCELLED:
        # Not our cancel (that raises CancelledError): the worker went away mid-call.
        return RelayError(grpc.StatusCode.UNAVAILABLE, details, lost, w.worker_id)
    if code is grpc.StatusCode.ABORTED:
        # A KV transfer that did not complete (its prefill side died or hung): another try can serve it,
        # not on that prefill worker.
        route = job.route
        culprit = route.prefill.worker_id if route is not None and route.prefill is not None else ""
        # The decode worker lives on: it reports the transfer failed (not "decode worker ... failed").
        sender = f" from prefill worker {culprit}" if culprit else ""
        said = f"the KV transfer{sender} to {where} failed: {code.name}: {e.details()}"
        return RelayError(code, said, "transfer_aborted", culprit)
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and role == "decode":
        # Its reservation found fewer free blocks than its last heartbeat said (running requests grew
        # since): nothing was sent, so route it again, on this worker too once a heartbeat shows room.
        ops.worker_full(w)
        return RelayError(code, f"{where} refused it: {e.details()}", "decode_full")
    return RelayError(code, details)
