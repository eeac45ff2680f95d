"""A request's logprobs on their way to the client: the prefill worker's answer (token 0's of each choice,
the prompt's) and the decode worker's stream (one per token, but an adopted token 0's) merged into one
entry per token sent, and the prompt's on the first message (once, whatever ``n``). Pure: protobuf
messages, no grpc."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.proto import generation_pb2
from pdserve.router.validate import Prepared

_Entry = generation_pb2.TokenLogprobs


class MissingLogprobs(RuntimeError):
    """A worker sent fewer logprobs than tokens where none may be missing (the relay's error status)."""


class LogprobRelay:
    """What a request that asked for logprobs has still to send. Only such a request has one."""

    __slots__ = ("tokens", "prompt_asked", "firsts", "_prompt", "_first_prompt_token")

    def __init__(self, prep: Prepared) -> None:
        self.tokens = prep.params.logprobs is not None  # each generated token's
        self.prompt_asked = prep.params.prompt_logprobs is not None
        # Each choice's token 0's by its index, from the prefill worker's answer.
        self.firsts: dict[int, _Entry] = {}
        self._prompt: list[_Entry] | None = None  # the prompt's, once known, until sent
        self._first_prompt_token = prep.prompt_token_ids[0]

    @classmethod
    def of(cls, prep: Prepared) -> LogprobRelay | None:
        p = prep.params
        return cls(prep) if p.logprobs is not None or p.prompt_logprobs is not None else None

    def prefilled(self, firsts: Sequence[_Entry | None], prompt: Sequence[_Entry]) -> None:
        """The prefill worker's answer (or a local prefill's first message): each choice's token 0's
        logprobs, in choice order, when it sampled token 0, and the prompt's after its first token."""
        for index, first in enumerate(firsts):
            if first is not None:
                self.firsts[index] = first
        if self.prompt_asked and prompt and self._prompt is None:
            self._prompt = [_Entry(token_id=self._first_prompt_token), *prompt]

    def aligned(
        self, ids: Sequence[int], first_index: int, entries: Sequence[_Entry], index: int = 0
    ) -> list[_Entry]:
        """One entry per token of a worker message of choice ``index``: ``entries`` are those of its last
        tokens; token 0 of an adopted request has its entry from the prefill worker's answer."""
        if not self.tokens:
            return []
        missing = len(ids) - len(entries)
        if missing == 0:
            return list(entries)
        if missing == 1 and first_index == 0 and index in self.firsts:
            return [self.firsts[index], *entries]
        raise MissingLogprobs(
            f"a worker sent {len(entries)} logprobs for {len(ids)} tokens from output index {first_index}"
        )

    def attach(self, resp: generation_pb2.GenerateResponse, entries: Sequence[_Entry]) -> None:
        """Onto a message to the client: its tokens' entries, and the prompt's on the first one."""
        if entries:
            resp.logprobs.extend(entries)
        if self._prompt is not None:
            resp.prompt_logprobs.extend(self._prompt)
            self._prompt = None
