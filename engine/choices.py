"""The choices of ``n`` > 1 requests: which sequences are one request's, forking them from the sequence that
computed the prompt, sampling every first token from its one row of logits, and resuming a moved
request's choices. Pure Python: imports no torch.

A request is added as one sequence, choice 0. The step that computes its prompt's last token samples every
choice's first token from that row (``fork_rows``), and choices 1.. fork from it (``ChoiceGroups.fork``):
each shares the prompt's full blocks by reference count and gets a copy of its partial last block, which
the engine makes (``block_copies``) before the next step writes into it. So the prompt is computed once,
whether or not prefix caching is on. From then on every choice is a sequence of its own (its id a
``ChoiceId``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from collections.abc import Sequence as Seq

from pdserve.engine.block_manager import BlockManager, OutOfBlocksError
from pdserve.engine.params import SamplingParams, choice_params
from pdserve.engine.sequence import ChoiceId, Sequence, SequenceStatus

NewSeq = Callable[[Hashable, Seq[int], SamplingParams], Sequence]


class ChoiceGroups:
    """The choices of each ``n`` > 1 request by its id, until all have finished; how many sequences still
    have choices to fork; the (source, destination) blocks whose K/V the engine copies before the next
    step (a forked choice's partial block)."""

    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self.groups: dict[Hashable, list[Sequence]] = {}
        self.num_forking = 0
        self.block_copies: list[tuple[int, int]] = []

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self.groups

    def added(self, seq: Sequence) -> None:
        """A new sequence: one with choices to fork starts its request's group."""
        if seq.forks:
            self.groups[seq.seq_id] = [seq]
            self.num_forking += 1

    def finished(self, seq: Sequence) -> None:
        """``seq`` finished; the group goes once all its choices have."""
        if seq.forks:  # ended before its prompt was computed: its other choices never fork
            seq.forks = 0
            self.num_forking -= 1
        group = self.groups.get(seq.request_id)
        if group is not None and all(s.is_finished for s in group):
            del self.groups[seq.request_id]

    def fork(self, parent: Sequence, new_seq: NewSeq) -> list[Sequence]:
        """Choices 1.. of ``parent``'s request, made now that its prompt is computed (before it has any
        output of its own), with no output token yet. Each is RUNNING, sharing the prompt's full blocks
        and holding a copy of its partial last block, or, when no block is free for that copy, WAITING
        and holding none, as a preempted sequence, to compute from its cached prefix later. The caller
        queues them by their status."""
        bm = self.block_manager
        rid, computed = parent.request_id, parent.num_computed_tokens
        group = self.groups[rid]
        children = []
        for index in range(1, parent.forks + 1):
            child = new_seq(
                ChoiceId(rid, index), parent.prompt_token_ids, choice_params(parent.params, index)
            )
            child.request_id, child.index, child.forks = rid, index, 0
            child.output_offset = parent.output_offset
            child.num_cached_tokens = parent.num_cached_tokens
            child.block_hashes = list(parent.block_hashes)
            try:
                copy = bm.fork_prefix(parent.seq_id, child.seq_id, computed)
            except OutOfBlocksError:
                child.status = SequenceStatus.WAITING
            else:
                if copy is not None:
                    self.block_copies.append(copy)
                child.num_computed_tokens = computed
                child.status = SequenceStatus.RUNNING
            group.append(child)
            children.append(child)
        parent.forks = 0
        self.num_forking -= 1
        return children

    def resume(
        self,
        request_id: Hashable,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        choices: Seq[tuple[int, Seq[int]]],
        new_seq: NewSeq,
    ) -> list[Sequence]:
        """The open choices of an ``n`` > 1 request moved here after some output, as WAITING sequences:
        each ``(index, the tokens it output before)`` continues as a sequence of its own, its prompt the
        request's plus those tokens, with what is left of max_tokens and min_tokens."""
        indices = [i for i, _ in choices]
        if not choices or len(set(indices)) != len(indices) or not all(0 <= i < params.n for i in indices):
            raise ValueError(f"choices must be distinct indices in [0, n={params.n}), got {indices}")
        plist = [resumed_params(params, index, len(earlier)) for index, earlier in choices]
        seqs = []
        for (index, earlier), p in zip(choices, plist, strict=True):
            sid = request_id if index == 0 else ChoiceId(request_id, index)
            seq = new_seq(sid, [*prompt_token_ids, *earlier], p)
            seq.request_id, seq.index, seq.forks, seq.output_offset = request_id, index, 0, len(earlier)
            seqs.append(seq)
        self.groups[request_id] = list(seqs)
        return seqs


def resumed_params(params: SamplingParams, index: int, output: int) -> SamplingParams:
    """Choice ``index``'s parameters once it has ``output`` tokens: its seed, what is left of the limits."""
    left = params.max_tokens - output
    if left < 1:
        raise ValueError(f"choice {index} has output {output} of max_tokens={params.max_tokens}")
    return dataclasses.replace(
        choice_params(params, index), max_tokens=left, min_tokens=max(params.min_tokens - output, 0)
    )


def fork_rows(seqs: Seq[Sequence]) -> tuple[list[int], list[SamplingParams]]:
    """The rows to sample in a step where some of ``seqs`` (one row of logits each) fork: for each
    sequence, a row per choice of its request still unsampled (itself first), as (the row of logits it
    reads, the choice's parameters)."""
    index: list[int] = []
    params: list[SamplingParams] = []
    for i, s in enumerate(seqs):
        for c in range(1 + s.forks):
            index.append(i)
            params.append(choice_params(s.params, c))
    return index, params


def split_first_tokens(seqs: Seq[Sequence], tokens: Seq[int]) -> tuple[list[int], dict[Hashable, Seq[int]]]:
    """``tokens`` sampled by ``fork_rows``' rows, as each sequence's own token and, by the id of a sequence
    that forks, its other choices' first tokens (``Scheduler.postprocess``'s arguments)."""
    own: list[int] = []
    forks: dict[Hashable, Seq[int]] = {}
    k = 0
    for s in seqs:
        own.append(tokens[k])
        if s.forks:
            forks[s.seq_id] = tokens[k + 1 : k + 1 + s.forks]
        k += 1 + s.forks
    return own, forks


def child_ids(seq: Sequence) -> list[Hashable]:
    """The sequence ids of the choices that fork from ``seq`` (none once forked)."""
    return [ChoiceId(seq.request_id, c) for c in range(1, 1 + seq.forks)]


def fork_row_ids(seqs: Seq[Sequence]) -> list[Hashable]:
    """The sequence id each of ``fork_rows``' rows samples for: its own, or that of the choice to fork."""
    return [sid for s in seqs for sid in (s.seq_id, *child_ids(s))]
