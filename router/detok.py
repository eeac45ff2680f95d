"""Incremental detokenization with stop strings for one request. Pure: no grpc, no torch."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.params import SamplingParams
from pdserve.engine.stopping import StopStringMatcher
from pdserve.router.validate import TextStream


class Detokenizer:
    """Each token id goes through the tokenizer's ``TextStream`` (right for characters split across tokens),
    then the engine's ``StopStringMatcher``, which holds back text that could still become a stop string:
    a stop string never reaches the client."""

    __slots__ = ("_stream", "_stop", "_min_tokens", "count")

    def __init__(self, stream: TextStream, params: SamplingParams) -> None:
        self._stream = stream
        # No matcher without stop strings: the common case costs one call per token.
        self._stop = StopStringMatcher(params.stop) if params.stop else None
        self._min_tokens = params.min_tokens
        self.count = 0  # tokens fed so far (the request's completion tokens)

    def feed(self, token_ids: Sequence[int], ends_on_stop_token: bool = False) -> tuple[str, int]:
        """Feed new tokens. Returns (text safe to emit, tokens consumed).

        ``consumed < len(token_ids)`` only when a stop string matched: the
        tokens after the one that completed it are dropped (see ``stopped``).
        ``ends_on_stop_token``: the worker finished with "stop" on the last id
        (eos or a stop token id); as in the engine, that token's text is never emitted.
        """
        n = len(token_ids)
        if ends_on_stop_token and n:
            text, used = self.feed(token_ids[:-1])
            if self.stopped:
                return text, used
            self.count += 1
            return text, used + 1
        step = self._stream.step
        if self._stop is None:
            self.count += n
            if n == 1:
                return step(token_ids[0]) or "", 1
            return "".join([step(t) or "" for t in token_ids]), n
        parts = []
        for i, t in enumerate(token_ids):
            self.count += 1
            # The engine's rule: a stop string counts only once more than min_tokens outputs exist.
            m = self._stop.feed(step(t) or "", can_stop=self.count > self._min_tokens)
            parts.append(m.text)
            if m.stopped:
                return "".join(parts), i + 1
        return "".join(parts), n

    @property
    def stopped(self) -> bool:
        return self._stop is not None and self._stop.stopped

    def flush(self) -> str:
        """Held-back text at the end of the stream (it turned out not to be a stop string)."""
        return self._stop.flush() if self._stop is not None else ""
