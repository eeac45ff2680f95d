"""One request's token sequence and its lifecycle. Pure Python."""

from __future__ import annotations

import enum
from collections.abc import Hashable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.engine.params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.speculative import StreamState


class SequenceStatus(enum.Enum):
    # Preemption sends RUNNING back to WAITING with its blocks freed and ``num_computed_tokens`` reset,
    # so prompt and outputs are recomputed.
    WAITING = "waiting"  # queued; may hold blocks for a partially prefilled prompt
    RUNNING = "running"  # all but the last token cached; decodes each step
    SUSPENDED = "suspended"  # RUNNING, held out of the batches while its KV moves to another worker
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # eos, a stop token id, or a stop string
    LENGTH = "length"  # max_tokens, or the model's context is full
    ABORT = "abort"


@dataclass(frozen=True, slots=True)
class ChoiceId:
    """The sequence id of choice ``index`` (>= 1) of an ``n`` > 1 request; choice 0's is the request's own
    id. A class of its own, so it never equals a caller's id."""

    request_id: Hashable
    index: int


class Sequence:
    def __init__(self, seq_id: Hashable, prompt_token_ids: Seq[int], params: SamplingParams, arrival: int):
        self.seq_id = seq_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.arrival = arrival  # admission order; the newest running sequence is preempted first
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        # Tokens whose K/V are in the cache: always a prefix of token_ids.
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        # Prefix caching: the hashes of the sequence's first full blocks (``engine.prefix_hash``); they
        # depend on its tokens alone, so they outlive preemption. May run ahead of what is computed.
        self.block_hashes: list[bytes] = []
        # Prompt tokens reused from the cache when it was first scheduled (not recounted on preemption).
        self.num_cached_tokens = 0
        # Output tokens this request produced before it came here (a stream migrated from a failed
        # worker: they are the prompt's tail now). Seeded sampling and reported counts continue from it.
        self.output_offset = 0
        # ``n`` > 1: the request this sequence is a choice of, and which. Choice 0 is the sequence the
        # request was added as; ``forks`` counts the choices still to fork from it once its prompt is
        # computed (sharing its blocks).
        self.request_id: Hashable = seq_id
        self.index = 0
        self.forks = params.n - 1
        # Speculative decoding's state for this stream (``engine.speculative``), made when first asked.
        self.spec: StreamState | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def token_ids(self, start: int = 0, end: int | None = None) -> list[int]:
        """Tokens [start, end) of prompt + outputs."""
        end = self.num_tokens if end is None else end
        n = self.num_prompt_tokens
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
