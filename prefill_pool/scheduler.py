"""Prefill scheduler: batches queued prompts in arrival order under a token budget and allocates their KV
blocks. Pure: no torch, no grpc."""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.block_manager import BlockManager


class Stage(enum.Enum):
    """A job's queue stage (the request's whole walk is ``request.ReqState``)."""

    QUEUED = "queued"  # waiting for KV blocks and a batch slot
    SCHEDULED = "scheduled"  # blocks allocated: its forward runs, its KV streams to the decode worker
    DONE = "done"  # its transfer ended (``finish``): its blocks are freed
    CANCELLED = "cancelled"  # dropped by ``cancel`` or ``pop_queued``: its blocks, if any, are freed


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
        """Take queued jobs in arrival order while their prompt tokens fit ``max_batched_tokens`` (a prompt
        longer than the budget runs alone) and their blocks fit the cache; allocate those blocks. The
        caller frees each job's blocks (``finish``) when its transfer ends."""
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
            # Owned by the job, not its request id: a retry of the id may come while this attempt's
            # transfer still aborts, holding these blocks.
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
