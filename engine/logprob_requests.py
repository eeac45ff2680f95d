"""The engine's requests that asked for logprobs (``SamplingParams.logprobs``, ``prompt_logprobs``): which
they are, the prompt logprobs gathered chunk by chunk for those whose first token is due, and each step's
sampled tokens' logprobs onto their deltas. While none asked, the engine's steps never come here. Keyed by
sequence id: each choice of an ``n`` > 1 request has its own logprobs; its prompt's (computed once, by
choice 0) come on choice 0's first delta."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import torch

from pdserve.engine.logprobs import TokenLogprob, prompt_targets, token_logprobs
from pdserve.engine.params import SamplingParams
from pdserve.engine.scheduler import Batch
from pdserve.engine.sequence import ChoiceId
from pdserve.engine.sequence import Sequence as EngineSequence

if TYPE_CHECKING:
    from pdserve.engine.llm_engine import RequestOutputDelta
    from pdserve.engine.model_runner import KeptRows


class LogprobRequests:
    def __init__(self) -> None:
        self.ids: set[Hashable] = set()  # unfinished sequences that asked for either kind
        # The prompt logprobs so far, by position (the first None), of those whose first token is due.
        self.prompt: dict[Hashable, list[TokenLogprob | None]] = {}

    def __bool__(self) -> bool:
        return bool(self.ids)

    def add(self, request_id: Hashable, params: SamplingParams, num_prompt_tokens: int) -> None:
        """A request this engine prefills."""
        if params.logprobs is not None or params.prompt_logprobs is not None:
            self.ids.add(request_id)
        if params.prompt_logprobs is not None:
            self.prompt[request_id] = [None] * num_prompt_tokens

    def add_prefilled(self, request_id: Hashable, params: SamplingParams) -> None:
        """An adopted request: its token 0's and prompt's logprobs are the prefill worker's."""
        if params.logprobs is not None:
            self.ids.add(request_id)

    def discard(self, request_id: Hashable) -> None:
        self.ids.discard(request_id)
        self.prompt.pop(request_id, None)

    def forked(self, seq_id: Hashable, child_ids: Sequence[Hashable]) -> None:
        """Choices forked from ``seq_id``: each asked as it did."""
        if seq_id in self.ids:
            self.ids.update(child_ids)

    def keep(self, batch: Batch) -> list[bool]:
        """Per prefill item of ``batch``: whether its positions' logits are kept (prompt logprobs due)."""
        return [it.seq.seq_id in self.prompt for it in batch.items[batch.decodes :]]

    def gather_prompt(self, batch: Batch, keep: list[bool], kept: KeptRows) -> None:
        """Each kept chunk's positions give the logprobs of the prompt tokens after them; a prompt in
        several chunks (chunked prefill) fills its slots chunk by chunk."""
        row = 0
        for it, k in zip(batch.items[batch.decodes :], keep, strict=True):
            if not k:
                continue
            seq = it.seq
            targets = prompt_targets(seq.prompt_token_ids, it.start, it.num_tokens)
            if targets:
                top = seq.params.prompt_logprobs or 0

                def rows(a: int, b: int, first: int = row) -> torch.Tensor:
                    return kept.logits(first + a, first + b)

                entries = token_logprobs(rows, targets, [top] * len(targets))
                self.prompt[seq.seq_id][it.start + 1 : it.start + 1 + len(entries)] = entries
            row += it.num_tokens

    @staticmethod
    def sampled(
        seqs: Sequence[EngineSequence], logits: torch.Tensor, tokens: Sequence[int]
    ) -> dict[Hashable, TokenLogprob]:
        """The sampled tokens' logprobs, from their rows of ``logits``, of the sequences that asked."""
        return LogprobRequests.sampled_rows(
            [s.seq_id for s in seqs], [s.params for s in seqs], logits, tokens
        )

    @staticmethod
    def sampled_rows(
        seq_ids: Sequence[Hashable],
        params: Sequence[SamplingParams],
        logits: torch.Tensor,
        tokens: Sequence[int],
    ) -> dict[Hashable, TokenLogprob]:
        """``sampled`` by row: the sequence (to be) whose token each row of ``logits`` gave, and its
        parameters (an ``n`` > 1 prompt's row samples every choice's first token)."""
        asked = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not asked:
            return {}
        rows = logits if len(asked) == len(params) else logits[asked]
        tops = [params[i].logprobs or 0 for i in asked]
        entries = token_logprobs(rows, [tokens[i] for i in asked], tops)
        return {seq_ids[i]: e for i, e in zip(asked, entries, strict=True)}

    def attach(self, delta: RequestOutputDelta, lps: dict[Hashable, TokenLogprob]) -> RequestOutputDelta:
        """``delta`` with its token's logprobs and, on a request's first, its prompt's; a finished sequence
        is forgotten."""
        rid = delta.request_id
        sid = rid if not delta.choice_index else ChoiceId(rid, delta.choice_index)
        if sid not in self.ids:
            return delta
        lp = lps.get(sid)
        prompt = self.prompt.pop(sid, None)
        if delta.finish_reason is not None:
            self.ids.discard(sid)
        return delta._replace(
            logprobs=None if lp is None else (lp,),
            prompt_logprobs=None if prompt is None else tuple(prompt),
        )
