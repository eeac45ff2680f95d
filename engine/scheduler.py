"""Continuous-batching scheduler over a paged KV cache. Pure Python: imports no torch.

``schedule()`` returns plain data (a prefill, decode or mixed batch) and ``postprocess()`` applies the
sampled tokens, nano-vllm style. The policy is ``schedule``'s docstring; block ownership follows the
contract in ``kv_transfer/__init__.py``. With a block manager that caches prefixes, a sequence starts past
its longest cached prefix, and each full block is committed to the cache once a step computed it.

An ``n`` > 1 request's choices fork from the sequence that computed its prompt (``engine.choices``);
``abort`` of the request's id ends them all.
"""

from __future__ import annotations

import bisect
import enum
import functools
import operator
from collections.abc import Hashable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import NamedTuple

from pdserve.engine.block_manager import BlockManager, OutOfBlocksError
from pdserve.engine.choices import ChoiceGroups, resumed_params
from pdserve.engine.params import SamplingParams
from pdserve.engine.prefix_hash import BlockHash, block_hashes
from pdserve.engine.sequence import FinishReason, Sequence, SequenceStatus

_by_arrival = operator.attrgetter("arrival")


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int  # the model's context: positions [0, max_model_len)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    eos_token_ids: tuple[int, ...] = ()
    mixed_steps: bool = False  # decode and prefill in one step (see ``Scheduler.schedule``)
    # Prefix caching (on when the block manager's is): the salt of the block hashes, which names what
    # the K/V of the same tokens depends on (``prefix_hash.model_cache_salt``).
    cache_salt: str = ""

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))


class BatchKind(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"  # decode items (one token each) first, then prefill items


class ScheduledSeq(NamedTuple):
    """One sequence's work in a step. A NamedTuple, not a frozen dataclass: one is made per running
    sequence per step, and a frozen dataclass's ``__init__`` costs several times as much."""

    seq: Sequence
    start: int  # first position computed this step
    num_tokens: int  # positions [start, start + num_tokens) are computed this step
    sample: bool  # this step ends at the sequence's last token, so a token is sampled

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids(self.start, self.start + self.num_tokens)


@dataclass(frozen=True)
class Batch:
    kind: BatchKind
    items: tuple[ScheduledSeq, ...]
    decodes: int = (
        0  # the first ``decodes`` items decode one token each (all of a DECODE batch); the rest prefill
    )

    @property
    def num_tokens(self) -> int:
        return sum(it.num_tokens for it in self.items)

    @functools.cached_property
    def sample_items(self) -> tuple[ScheduledSeq, ...]:
        # Cached: the engine and ``postprocess`` both ask, every step. Every decode item samples.
        if self.kind is BatchKind.DECODE:
            return self.items
        return tuple(it for it in self.items if it.sample)


def check_stop(seq: Sequence, eos_token_ids: Iterable[int], max_model_len: int) -> FinishReason | None:
    """Token-level stop check after a token is appended (stop strings are checked on text, elsewhere)."""
    # Runs for every sequence every step: plain list lengths, not the Sequence properties.
    p = seq.params
    out = seq.output_token_ids
    n = len(out)
    if n >= p.min_tokens:
        last = out[-1]
        if (not p.ignore_eos and last in eos_token_ids) or last in p.stop_token_ids:
            return FinishReason.STOP
    if n >= p.max_tokens or len(seq.prompt_token_ids) + n >= max_model_len:
        return FinishReason.LENGTH
    return None


def needs_whole_prompt(seq: Sequence) -> bool:
    """Its prompt logprobs are still to come: every prompt position is computed, none reused."""
    return seq.params.prompt_logprobs is not None and not seq.output_token_ids


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: list[Sequence] = []  # ordered by arrival
        self.running: list[Sequence] = []
        # Decoding sequences held out of the batches (``suspend``): their blocks stay, nothing preempts them.
        self.suspended: dict[Hashable, Sequence] = {}
        # Ids whose blocks another thread reads (a suspended stream's KV on its way out): a finish keeps
        # their blocks until ``unpin``, so what is read is never another request's.
        self._pinned: set[Hashable] = set()
        self._free_on_unpin: set[Hashable] = set()
        self._seqs: dict[Hashable, Sequence] = {}
        self._arrivals = 0
        self.num_preemptions = 0  # since start, for metrics
        # Prompt tokens looked up in the prefix cache and those reused, since start (metrics).
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        # The block size when prefix caching is on, else 0: one test in the decode loop.
        self._cache_bs = block_manager.block_size if block_manager.enable_prefix_caching else 0
        self.choices = ChoiceGroups(block_manager)  # ``n`` > 1 requests' choices

    # -- requests ------------------------------------------------------------
    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """The request fits the context and, alone, the whole cache (so preemption always makes progress)."""
        if num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt has {num_prompt_tokens} tokens; the context is {self.config.max_model_len} tokens"
            )
        bm = self.block_manager
        need = bm.blocks_needed(min(num_prompt_tokens + params.max_tokens, self.config.max_model_len))
        if params.n > 1 and params.n * need > bm.num_blocks:
            # Bounded as if no block were shared, so that every choice can run to its end at once.
            raise ValueError(
                f"n is {params.n}: {params.n} choices of up to {need} KV blocks of {bm.block_size} tokens "
                f"each need up to {params.n * need} but the cache has {bm.num_blocks}: lower n or "
                "max_tokens, or give the engine more KV memory"
            )
        if need > bm.num_blocks:
            raise ValueError(
                f"request needs up to {need} KV blocks of {bm.block_size} tokens but the cache has "
                f"{bm.num_blocks}: lower max_tokens or give the engine more KV memory"
            )

    def add(self, seq_id: Hashable, prompt_token_ids: Seq[int], params: SamplingParams) -> Sequence:
        """Queue a new request; its prompt is prefilled by this engine."""
        if seq_id in self._seqs or seq_id in self.block_manager:
            raise ValueError(f"request id {seq_id!r} is already in use")
        self.check_fits(len(prompt_token_ids), params)
        seq = self._new_seq(seq_id, prompt_token_ids, params)
        self.choices.added(seq)
        self.waiting.append(seq)  # newest arrival: the end keeps arrival order
        return seq

    def add_prefilled(
        self, seq_id: Hashable, prompt_token_ids: Seq[int], first_token_id: int, params: SamplingParams
    ) -> Sequence:
        """Adopt a request whose prompt K/V already sit in blocks held under ``seq_id``; from then on the
        scheduler frees them on finish, abort and preemption.

        ``first_token_id`` (sampled by the prefill side) is output token 0 and
        goes through the same stop checks; the sequence may finish at once.
        """
        return self.add_prefilled_choices(seq_id, prompt_token_ids, (first_token_id,), params)[0]

    def add_prefilled_choices(
        self, seq_id: Hashable, prompt_token_ids: Seq[int], first_token_ids: Seq[int], params: SamplingParams
    ) -> list[Sequence]:
        """``add_prefilled`` of a request with ``params.n`` choices: ``first_token_ids`` holds each
        choice's output token 0, and choices 1.. fork from choice 0's blocks. Returns the choices."""
        bm = self.block_manager
        if len(first_token_ids) != params.n:
            raise ValueError(f"{len(first_token_ids)} first tokens for a request of n={params.n} choices")
        if seq_id in self._seqs:
            raise ValueError(f"request id {seq_id!r} is already in use")
        if seq_id not in bm or bm.capacity(seq_id) < len(prompt_token_ids):
            raise ValueError(
                f"request {seq_id!r} holds no blocks covering its {len(prompt_token_ids)} prompt tokens"
            )
        self.check_fits(len(prompt_token_ids), params)
        seq = self._new_seq(seq_id, prompt_token_ids, params)
        seq.num_computed_tokens = len(prompt_token_ids)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        if self._cache_bs:  # the received prompt is whole: its full blocks are cache hits from now on
            self._commit(seq, 0, len(prompt_token_ids))
        self.choices.added(seq)
        seqs = [seq, *self._fork(seq)] if seq.forks else [seq]
        for s, token in zip(seqs, first_token_ids, strict=True):
            self._append(s, token)
        return seqs

    def add_migrated(
        self, seq_id: Hashable, token_ids: Seq[int], output_offset: int, params: SamplingParams
    ) -> Sequence:
        """Adopt a decoding stream moved here live: ``token_ids`` is its prompt and every output token so
        far (the last ``output_offset`` of them), and the blocks held under ``seq_id`` hold the K/V of all
        but the last, which the next decode step computes, as on the worker it came from."""
        bm = self.block_manager
        if seq_id in self._seqs:
            raise ValueError(f"request id {seq_id!r} is already in use")
        if not 0 < output_offset < len(token_ids):
            raise ValueError(f"output_offset must be in [1, len(token_ids)), got {output_offset}")
        if params.n != 1:
            raise ValueError("a live-migrated stream has one choice (n = 1)")
        computed = len(token_ids) - 1
        if seq_id not in bm or bm.capacity(seq_id) < computed:
            raise ValueError(f"request {seq_id!r} holds no blocks covering its {computed} computed tokens")
        self.check_fits(len(token_ids), params)
        seq = self._new_seq(seq_id, token_ids, params)
        seq.output_offset = output_offset
        seq.num_computed_tokens = computed
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        if self._cache_bs:  # its full blocks are complete: cache hits from now on
            self._commit(seq, 0, computed)
        self.choices.added(seq)
        return seq

    def suspend(self, seq_id: Hashable) -> Sequence:
        """Hold a decoding sequence out of the batches (its KV is about to move); ValueError when it is not
        a decoding sequence of one choice."""
        seq = self._seqs.get(seq_id)
        if seq is None or seq.status is not SequenceStatus.RUNNING:
            state = "unknown" if seq is None else seq.status.value
            raise ValueError(f"request {seq_id!r} is not decoding here ({state})")
        if seq.params.n != 1 or seq_id in self.choices:
            raise ValueError(f"request {seq_id!r} has several choices: it cannot move live")
        self.running.remove(seq)
        seq.status = SequenceStatus.SUSPENDED
        self.suspended[seq_id] = seq
        return seq

    def pin(self, seq_id: Hashable) -> list[int]:
        """Keep a suspended sequence's blocks until ``unpin``, whatever ends it meanwhile; returns the
        blocks holding its computed tokens' K/V, in token order."""
        seq = self.suspended.get(seq_id)
        if seq is None:
            raise ValueError(f"request {seq_id!r} is not suspended here")
        self._pinned.add(seq_id)
        bs = self.block_manager.block_size
        return self.block_manager.block_table(seq_id)[: -(-seq.num_computed_tokens // bs)]

    def unpin(self, seq_id: Hashable) -> None:
        """Undo ``pin``; blocks of a sequence that ended meanwhile are freed now."""
        self._pinned.discard(seq_id)
        if seq_id in self._free_on_unpin:
            self._free_on_unpin.discard(seq_id)
            self.block_manager.free(seq_id)

    def resume(self, seq_id: Hashable) -> bool:
        """Put a suspended sequence back into the batches; False when it is not suspended."""
        seq = self.suspended.pop(seq_id, None)
        if seq is None:
            return False
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return True

    def add_choices(
        self,
        request_id: Hashable,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        choices: Seq[tuple[int, Seq[int]]],
    ) -> list[Sequence]:
        """Queue the open choices of an ``n`` > 1 request moved here after some output
        (``ChoiceGroups.resume``): nothing to fork from, so each computes its prompt, or reuses the
        prefix cache."""
        if request_id in self._seqs or request_id in self.choices or request_id in self.block_manager:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_fits(len(prompt_token_ids), params)
        for index, earlier in choices:
            self.check_fits(len(prompt_token_ids) + len(earlier), resumed_params(params, index, len(earlier)))
        seqs = self.choices.resume(request_id, prompt_token_ids, params, choices, self._new_seq)
        self.waiting += seqs
        return seqs

    def _new_seq(self, seq_id: Hashable, prompt_token_ids: Seq[int], params: SamplingParams) -> Sequence:
        seq = Sequence(seq_id, prompt_token_ids, params, arrival=self._arrivals)
        self._arrivals += 1
        self._seqs[seq_id] = seq
        return seq

    def get(self, seq_id: Hashable) -> Sequence | None:
        return self._seqs.get(seq_id)

    def has_request(self, request_id: Hashable) -> bool:
        """Some choice of the request is unfinished."""
        return request_id in self._seqs or request_id in self.choices

    def request_seqs(self, request_id: Hashable) -> list[Sequence]:
        """The request's sequences: its choices so far (``n`` > 1), else its one sequence if unfinished."""
        group = self.choices.groups.get(request_id)
        if group is not None:
            return list(group)
        seq = self._seqs.get(request_id)
        return [] if seq is None else [seq]

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence and free its blocks now (idempotent)."""
        if seq.is_finished:
            return
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        if seq.seq_id in self._pinned:
            self._free_on_unpin.add(seq.seq_id)
        else:
            self.block_manager.free(seq.seq_id)
        self._seqs.pop(seq.seq_id, None)
        self.suspended.pop(seq.seq_id, None)
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)
        self.choices.finished(seq)

    def abort(self, seq_id: Hashable) -> bool:
        """Abort a request (every choice) and free its blocks, including blocks reserved under its id but
        never adopted."""
        group = self.choices.groups.get(seq_id)
        if group is not None:
            for s in list(group):
                self.finish(s, FinishReason.ABORT)
            return True
        seq = self._seqs.get(seq_id)
        if seq is not None:
            self.finish(seq, FinishReason.ABORT)
            return True
        if seq_id in self._pinned:  # ended already; its blocks go at ``unpin``
            return False
        return self.block_manager.free(seq_id)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    @property
    def num_unfinished(self) -> int:
        return len(self._seqs)

    # -- scheduling ----------------------------------------------------------
    def schedule(self) -> Batch | None:
        """The next step's work, or None when there is nothing to run.

        - Default: prefill first. While sequences wait, a step only prefills; otherwise it only decodes.
        - ``mixed_steps``: decode up to ``max_num_seqs`` running sequences, oldest first, and fill what is
          left of ``max_num_batched_tokens`` (a decode counts one) with waiting prompts, FIFO, so a prefill
          never stalls the running streams and the step reads the weights once for both.
        - A prompt longer than what is left of the budget is chunked; at most one sequence is partially
          prefilled at a time, and it heads the queue.
        - A sequence that needs a block when none is free preempts the newest sequence holding blocks
          (freed, requeued to recompute), else itself. Nothing deadlocks: every request fits the cache
          alone (``check_fits``).
        - Another thread may reserve in the same ``BlockManager`` (a decode worker), so no earlier reading
          of it is trusted: the scheduler allocates, and "out of blocks" means "no room yet".
        - Prefix caching: a waiting sequence that holds no blocks (new or preempted) reuses the longest
          cached run of its full blocks, short of its last token (which is computed, so a fully cached
          prompt recomputes its last block into a fresh one), and computes from there; the budget counts
          computed tokens only. Reused blocks are shared read-only: a step writes only past them. A prompt
          whose prompt logprobs are asked for reuses nothing (``needs_whole_prompt``).
        """
        if self.config.mixed_steps:
            decodes = self._schedule_decode() if self.running else []
            prefills = self._schedule_prefill(self.config.max_num_batched_tokens - len(decodes))
            if decodes and prefills:
                return Batch(BatchKind.MIXED, (*decodes, *prefills), len(decodes))
            if prefills:
                return Batch(BatchKind.PREFILL, tuple(prefills))
            return Batch(BatchKind.DECODE, tuple(decodes), len(decodes)) if decodes else None
        items = self._schedule_prefill(self.config.max_num_batched_tokens)
        if items:
            return Batch(BatchKind.PREFILL, tuple(items))
        items = self._schedule_decode()
        if items:
            return Batch(BatchKind.DECODE, tuple(items), len(items))
        return None

    def _schedule_prefill(self, budget: int) -> list[ScheduledSeq]:
        cfg = self.config
        items: list[ScheduledSeq] = []
        num_seqs = len(self.running)
        while self.waiting and budget > 0 and num_seqs < cfg.max_num_seqs:
            seq = self.waiting[0]
            if self._cache_bs and seq.seq_id not in self.block_manager:
                span = self._allocate_cached(seq, budget)
                if span is None:
                    break  # FIFO, as below
                start, n = span
            else:
                start = seq.num_computed_tokens
                n = min(seq.num_tokens - start, budget)
                if not self._reserve(seq, start + n):
                    break  # FIFO: later requests do not overtake one that waits for blocks
            done = start + n == seq.num_tokens
            items.append(ScheduledSeq(seq, start, n, sample=done))
            budget -= n
            num_seqs += 1
            if not done:
                break  # budget exhausted; this partial prefill stays at the head of the queue
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return items

    def _schedule_decode(self) -> list[ScheduledSeq]:
        running = self.running
        running.sort(key=_by_arrival)
        max_seqs = self.config.max_num_seqs
        items: list[ScheduledSeq] = []
        i = 0
        while i < len(running) and len(items) < max_seqs:
            # The common case in one block-manager call: every sequence up to the first that is out of
            # blocks grows, in order, exactly as one ``_reserve`` each would.
            seqs = running[i : i + max_seqs - len(items)]
            ns = [len(s.prompt_token_ids) + len(s.output_token_ids) for s in seqs]
            done = self.block_manager.grow_each([s.seq_id for s in seqs], ns)
            items += [ScheduledSeq(seqs[k], ns[k] - 1, 1, True) for k in range(done)]
            i += done
            if done == len(seqs):
                continue
            seq = running[i]  # out of blocks (or holding none): preempt the newest holders, or itself
            while not self._reserve(seq, seq.num_tokens):
                victim = self._newest_holder_after(seq)
                self._preempt(victim if victim is not None else seq)
                if victim is None:
                    break
            else:
                items.append(ScheduledSeq(seq, seq.num_tokens - 1, 1, sample=True))
                i += 1
        return items

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Cover ``num_tokens`` positions with blocks; False (nothing changed) when out of blocks."""
        bm = self.block_manager
        try:
            if seq.seq_id in bm:
                bm.grow(seq.seq_id, num_tokens)
            else:
                bm.allocate(seq.seq_id, num_tokens)
        except OutOfBlocksError:
            return False
        return True

    def _allocate_cached(self, seq: Sequence, budget: int) -> tuple[int, int] | None:
        """Allocate a sequence that holds no blocks, reusing its longest cached prefix: the span
        ``(start, num_tokens)`` of its first step, or None (nothing changed) when out of blocks."""
        bm, bs = self.block_manager, self._cache_bs
        total = seq.num_tokens
        hashes = self._hashes(seq, (total - 1) // bs)  # the last token is always computed
        # Prompt logprobs need every prompt position's logits: such a prompt is computed whole (as vLLM).
        hit = 0 if needs_whole_prompt(seq) else bm.cached_prefix_blocks(hashes)
        n = min(total - hit * bs, budget)
        try:
            reused = bm.allocate_prefixed(seq.seq_id, hit * bs + n, hashes[:hit])
        except OutOfBlocksError:
            return None
        start = reused * bs
        if reused < hit:  # another thread evicted some since the lookup: a longer span, still covered
            n = min(total - start, budget)
        seq.num_computed_tokens = start
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = start
            self.prefix_query_tokens += seq.num_prompt_tokens
            self.prefix_hit_tokens += start
        return start, n

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """The hashes of the sequence's first ``num_blocks`` full blocks, extending ``seq.block_hashes``."""
        hashes = seq.block_hashes
        have = len(hashes)
        if have < num_blocks:
            bs = self._cache_bs
            hashes += block_hashes(
                seq.token_ids(have * bs, num_blocks * bs),
                bs,
                self.config.cache_salt,
                parent=hashes[-1] if hashes else None,
            )
        return hashes if len(hashes) == num_blocks else hashes[:num_blocks]

    def _commit(self, seq: Sequence, start: int, end: int) -> None:
        """A step computed positions ``[start, end)``: commit the blocks it filled to the prefix cache (with
        any full block before it that was never committed: an adopted prompt's)."""
        first = min(len(seq.block_hashes), start // self._cache_bs)
        hashes = self._hashes(seq, end // self._cache_bs)
        self.block_manager.commit(seq.seq_id, hashes, start=first)

    def _newest_holder_after(self, seq: Sequence) -> Sequence | None:
        """The newest sequence newer than ``seq`` holding blocks: running ones or a partial prefill."""
        cands = [s for s in self.running if s.arrival > seq.arrival]
        cands += [s for s in self.waiting if s.arrival > seq.arrival and s.seq_id in self.block_manager]
        return max(cands, key=lambda s: s.arrival, default=None)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.WAITING
        # Arrival order keeps the invariant that a waiting sequence holding
        # blocks (a partial prefill) is never behind one that holds none.
        bisect.insort(self.waiting, seq, key=lambda s: s.arrival)

    # -- results -------------------------------------------------------------
    def postprocess(
        self, batch: Batch, token_ids: Seq[int], forks: dict[Hashable, Seq[int]] | None = None
    ) -> list[Sequence]:
        """Apply a step's results: ``token_ids`` has one sampled token per item of ``batch.sample_items``;
        ``forks``: for a sequence (by id) whose other choices fork now (``Sequence.forks``), their first
        tokens, in choice order.

        Returns the sequences that got a token, in batch order (forked choices right after the sequence
        they forked from); finished ones have ``finish_reason`` set and their blocks already freed.
        """
        if len(token_ids) != len(batch.sample_items):
            raise ValueError(f"{len(batch.sample_items)} sequences sampled but {len(token_ids)} tokens given")
        if batch.kind is BatchKind.DECODE:  # every step of a running stream: the short loop
            return self._postprocess_decode(batch.items, token_ids)
        tokens = iter(token_ids)
        out: list[Sequence] = []
        bs = self._cache_bs
        for it in batch.items:
            seq = it.seq
            if seq.is_finished:  # aborted between schedule and postprocess
                if it.sample:
                    next(tokens)
                continue
            end = seq.num_computed_tokens = it.start + it.num_tokens
            if bs and end // bs > it.start // bs:  # filled a block: before a finish frees them
                self._commit(seq, it.start, end)
            if it.sample:
                token = next(tokens)
                if seq.forks:
                    if forks is None or len(forks.get(seq.seq_id, ())) != seq.forks:
                        raise ValueError(f"{seq.seq_id!r} forks {seq.forks} choices: give their first tokens")
                    children = self._fork(seq)
                    self._append(seq, token)
                    out.append(seq)
                    for child, t in zip(children, forks[seq.seq_id], strict=True):
                        self._append(child, t)
                    out += children
                    continue
                self._append(seq, token)
                out.append(seq)
        return out

    def _postprocess_decode(self, items: Seq[ScheduledSeq], token_ids: Seq[int]) -> list[Sequence]:
        """``postprocess`` of a DECODE batch: one token per item, every item samples."""
        eos, max_len, finish = self.config.eos_token_ids, self.config.max_model_len, self.finish
        finished = SequenceStatus.FINISHED
        bs = self._cache_bs
        out: list[Sequence] = []
        for it, token in zip(items, token_ids, strict=True):
            seq = it.seq
            if seq.status is finished:  # aborted between schedule and postprocess
                continue
            end = seq.num_computed_tokens = it.start + 1
            if bs and end % bs == 0:  # filled a block
                self._commit(seq, it.start, end)
            seq.output_token_ids.append(token)
            reason = check_stop(seq, eos, max_len)
            if reason is not None:
                finish(seq, reason)
            out.append(seq)
        return out

    def reserve_lookahead(self, seq: Sequence, num_tokens: int) -> bool:
        """Cover ``num_tokens`` positions of a decoding sequence with blocks for a speculative step (its
        proposals' K/V are written before they are verified); False (nothing changed) when out of blocks.
        Blocks reserved for proposals that are rejected stay in its table (tables only grow) and are
        written again by later steps."""
        return self._reserve(seq, num_tokens)

    def append_verified(self, seq: Sequence, token_id: int) -> None:
        """A speculative step computed ``seq``'s last token and sampled ``token_id`` after it: the last
        token is cached now (committing a block it filled) and the new one is appended and stop-checked.
        Called once per token the step gives the sequence, in order, while it is unfinished."""
        start = seq.num_computed_tokens
        end = seq.num_computed_tokens = len(seq.prompt_token_ids) + len(seq.output_token_ids)
        bs = self._cache_bs
        if bs and end // bs > start // bs:  # filled a block: before a finish frees them
            self._commit(seq, start, end)
        self._append(seq, token_id)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """``parent``'s other choices (``ChoiceGroups.fork``), queued by their status."""
        children = self.choices.fork(parent, self._new_seq)
        for child in children:
            if child.status is SequenceStatus.RUNNING:
                self.running.append(child)
            else:  # no block for its copy: it waits as a preempted sequence does
                bisect.insort(self.waiting, child, key=_by_arrival)
        return children

    def _append(self, seq: Sequence, token_id: int) -> None:
        seq.output_token_ids.append(token_id)
        reason = check_stop(seq, self.config.eos_token_ids, self.config.max_model_len)
        if reason is not None:
            self.finish(seq, reason)
