"""The time-to-first-token budget of admission (``--admission-ttft-s``): predict how long a routed prompt
would wait for its first token on the worker that prefills it, so a request that would not make the budget
is refused at once instead of queueing. Pure logic: no grpc, no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.router.policy import Route


@dataclass(frozen=True)
class TtftPrediction:
    seconds: float
    tokens_ahead: int  # prefill tokens queued before it on that worker
    own_tokens: int  # its own prompt tokens past the worker's cached prefix
    tokens_per_s: float  # the worker's measured prefill rate


def predict_ttft(route: Route, prompt_len: int) -> TtftPrediction | None:
    """Tokens ahead of the prompt on the worker that prefills it, plus its own uncached tokens, over that
    worker's prefill rate. The KV transfer is not on the path: a prefill worker answers the first token
    before it completes the transfer. None when the worker has not measured a rate yet (admitted: the
    first forwards measure it)."""
    w = route.prefill if route.prefill is not None else route.decode
    rate = w.prefill_tokens_per_s
    if rate <= 0:
        return None
    cached = route.prefill_cached_tokens if route.prefill is not None else route.decode_cached_tokens
    own = max(prompt_len - cached, 1)
    # The worker's last heartbeat counts every router's prompts; this router's own count is newer for its
    # own: the larger of the two, not their sum (which would count this router's twice).
    ahead = max(w.queued_prefill_tokens, w.assigned_prefill_tokens)
    return TtftPrediction((ahead + own) / rate, ahead, own, rate)


def retry_after_s(prediction: TtftPrediction, budget_s: float) -> int:
    """Whole seconds until the queue ahead has drained enough for the prompt to fit the budget (at least 1):
    the Retry-After of a refusal."""
    return max(1, math.ceil(prediction.seconds - budget_s))
