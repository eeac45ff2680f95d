"""Admission's bounds on waiting: the time-to-first-token budget (``--admission-ttft-s``) predicts how long a
routed prompt would wait for its first token on the worker that prefills it, so a request that would not
make the budget is refused at once instead of queueing; the prefill queue bound
(``--max-prefill-queue-tokens``) does the same in tokens. Pure logic: no grpc, no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.router.policy import QueueFullError, Route


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


def check_ttft_budget(route: Route, prompt_len: int, budget_s: float) -> float:
    """Refuse (QueueFullError, at once) a request whose predicted time to first token on ``route`` is over
    ``budget_s``; else the prediction in seconds (checked against its actual TTFT in a metric), 0 when the
    worker has measured no rate yet."""
    pred = predict_ttft(route, prompt_len)
    if pred is None:
        return 0.0
    if pred.seconds > budget_s:
        w = route.prefill if route.prefill is not None else route.decode
        raise QueueFullError(
            f"the predicted time to first token is {pred.seconds:.3g}s, over the budget of "
            f"{budget_s:.3g}s ({pred.tokens_ahead} prompt tokens queued on {w.worker_id} before its "
            f"{pred.own_tokens}, at {pred.tokens_per_s:.0f} tokens/s)",
            "ttft_budget",
            retry_after_s(pred, budget_s),
        )
    return pred.seconds


def check_prefill_queue(route: Route, prompt_len: int, bound: int) -> None:
    """Refuse (QueueFullError) a prompt that would queue behind ``bound`` prompt tokens on the least loaded
    prefill worker (the one ``choose_route`` picked): it would wait longer than the cluster is sized for. A
    prompt alone on an idle worker is always taken; 0: no bound."""
    p = route.prefill
    if p is None or not bound:
        return
    queued = p.assigned_prefill_tokens
    if queued and queued + prompt_len > bound:
        raise QueueFullError(
            f"the prefill queue is full ({queued} prompt tokens queued on {p.worker_id}, "
            f"the bound is {bound})",
            "prefill_queue_full",
        )
