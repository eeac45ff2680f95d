"""Prefill scheduler: batches queued prompts in arrival order under a token budget and allocates their KV
blocks, reusing the blocks of a cached prefix (``engine.prefix_hash``). Pure: no torch, no grpc."""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.block_manager import BlockManager, OutOfBlocksError
from pdserve.engine.prefix_hash import block_hashes


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
    block_hashes: list[bytes] = field(default_factory=list)  # the prompt's full blocks (prefix caching)
    cached_tokens: int = 0  # leading prompt tokens reused from this worker's cache: not computed
    whole_prompt: bool = False  # compute every prompt token, reusing no cached prefix (prompt logprobs)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def new_tokens(self) -> int:
        """Prompt tokens the forward computes."""
        return len(self.prompt_token_ids) - self.cached_tokens


class PrefillScheduler:
    def __init__(self, block_manager: BlockManager, max_batched_tokens: int, cache_salt: str = "") -> None:
        """Prefix caching is on when ``block_manager`` has it on; ``cache_salt`` is the engine's
        (``LLMEngine.cache_salt``: what else makes the same tokens' KV differ)."""
        if max_batched_tokens < 1:
            raise ValueError(f"max_batched_tokens must be >= 1, got {max_batched_tokens}")
        self.block_manager = block_manager
        self.max_batched_tokens = max_batched_tokens
        self.cache_salt = cache_salt
        self._queue: deque[PrefillJob] = deque()
        # Running totals for the prefix-cache metrics: prompt tokens looked up, and those reused.
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

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
        if self.block_manager.enable_prefix_caching:
            job.block_hashes = block_hashes(
                job.prompt_token_ids, self.block_manager.block_size, self.cache_salt
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
        """Take queued jobs in arrival order while the tokens they compute fit ``max_batched_tokens`` (a
        prompt longer than the budget runs alone) and their blocks fit the cache; allocate those blocks,
        holding the cached blocks of each prompt's longest cached prefix (at most all but the block of its
        last token, which is computed for the first token's logits; none for a ``whole_prompt`` job). The
        caller frees each job's blocks
        (``finish``) when its transfer ends."""
        batch: list[PrefillJob] = []
        tokens = 0
        bm = self.block_manager
        bs = bm.block_size
        while self._queue:
            job = self._queue[0]
            # This pool is the event loop's alone: the lookup holds until the allocation below.
            reusable = [] if job.whole_prompt else job.block_hashes[: (job.num_tokens - 1) // bs]
            hit = bm.cached_prefix_blocks(reusable) if reusable else 0
            if batch and tokens + job.num_tokens - hit * bs > self.max_batched_tokens:
                break
            # Owned by the job, not its request id: a retry of the id may come while this attempt's
            # transfer still aborts, holding these blocks.
            try:
                reused = bm.allocate_prefixed(job, job.num_tokens, reusable[:hit])
            except OutOfBlocksError:
                break  # FIFO: a big prompt waits for blocks rather than being overtaken forever
            self._queue.popleft()
            job.block_table = bm.block_table(job)
            job.cached_tokens = reused * bs
            if job.block_hashes:
                self.prefix_query_tokens += job.num_tokens
                self.prefix_hit_tokens += job.cached_tokens
            job.stage = Stage.SCHEDULED
            batch.append(job)
            tokens += job.new_tokens
        return batch

    def computed(self, job: PrefillJob) -> None:
        """The job's forward wrote its prompt's KV: its full blocks become cache hits for later prompts."""
        if job.block_hashes and job.stage is Stage.SCHEDULED:
            self.block_manager.commit(job, job.block_hashes)

    def finish(self, job: PrefillJob) -> None:
        """The job's transfer ended (completed or failed): its blocks go back."""
        self.block_manager.free(job)
        if job.stage is not Stage.CANCELLED:
            job.stage = Stage.DONE
