"""Prefill scheduler: batch queued prompts under a token budget. Pure: no torch, no grpc.

A job's queue stages (``Stage``; the request's whole walk is ``request.ReqState``):

    QUEUED (waiting for KV blocks and a batch slot)
    -> SCHEDULED (blocks allocated to the job: its forward, its KV streaming to the decode worker)
    -> DONE (its transfer ended; its blocks are freed)
    or CANCELLED (``cancel``, ``pop_queued``: its blocks, if any, are freed)

``schedule()`` takes queued requests in arrival order while their prompt
tokens fit ``max_batched_tokens`` (a prompt longer than the budget runs alone)
and while the block manager can hold them. It allocates their blocks and
returns them; the caller frees each request's blocks when its transfer ends.

Blocks are owned by the job object, not its request id: the router may send a
request again (a retry after its decode worker died) while this worker is
still aborting the first attempt's transfer, whose blocks it still holds.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.block_manager import BlockManager


class Stage(enum.Enum):
    QUEUED = "queued"
    SCHEDULED = "scheduled"
    DONE = "done"
    CANCELLED = "cancelled"


@dataclass(eq=False)
class PrefillJob:
    request_id: Hashable
    prompt_token_ids: list[int]
    payload: Any = None  # the worker's per-request state (params, transfer handle, future)
    stage: Stage = Stage.QUEUED
    block_table: list[int] = field(default_factory=list)
    attach_key: Any = None  # (request id, the router's attempt key) of a job submitted without a ticket

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)


class PrefillScheduler:
    def __init__(self, block_manager: BlockManager, max_batched_tokens: int) -> None:
        if max_batched_tokens < 1:
            raise ValueError(f"max_batched_tokens must be >= 1, got {max_batched_tokens}")
        self.block_manager = block_manager
        self.max_batched_tokens = max_batched_tokens
        self._queue: deque[PrefillJob] = deque()

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    @property
    def queued_tokens(self) -> int:
        return sum(j.num_tokens for j in self._queue)

    def fits_ever(self, num_tokens: int) -> bool:
        return self.block_manager.blocks_needed(num_tokens) <= self.block_manager.num_blocks

    def add(self, job: PrefillJob) -> None:
        if not job.prompt_token_ids:
            raise ValueError("prompt_token_ids is empty")
        if not self.fits_ever(job.num_tokens):
            raise ValueError(
                f"prompt of {job.num_tokens} tokens needs more KV blocks than this prefill worker has "
                f"({self.block_manager.num_blocks} x {self.block_manager.block_size} tokens)"
            )
        self._queue.append(job)

    def cancel(self, job: PrefillJob) -> None:
        """Drop a job at any stage; frees its blocks. Idempotent."""
        if job.stage is Stage.QUEUED:
            try:
                self._queue.remove(job)
            except ValueError:
                pass
        self.block_manager.free(job)
        job.stage = Stage.CANCELLED

    def pop_queued(self) -> PrefillJob | None:
        """Take the oldest queued job off the queue (it never got blocks), or None."""
        if not self._queue:
            return None
        job = self._queue.popleft()
        job.stage = Stage.CANCELLED
        return job

    def schedule(self) -> list[PrefillJob]:
        batch: list[PrefillJob] = []
        tokens = 0
        bm = self.block_manager
        while self._queue:
            job = self._queue[0]
            if batch and tokens + job.num_tokens > self.max_batched_tokens:
                break
            if not bm.can_allocate(job.num_tokens):
                break  # FIFO: a big prompt waits for blocks rather than being overtaken forever
            self._queue.popleft()
            job.block_table = bm.allocate(job, job.num_tokens)
            job.stage = Stage.SCHEDULED
            batch.append(job)
            tokens += job.num_tokens
        return batch

    def finish(self, job: PrefillJob) -> None:
        """The job's transfer ended (completed or failed): its blocks go back."""
        self.block_manager.free(job)
        if job.stage is not Stage.CANCELLED:
            job.stage = Stage.DONE
