"""Token log-probabilities: each row's log-softmax of the model's raw float32 logits (before temperature,
top-k/top-p, min_tokens or any other processing: vLLM's default, ``raw_logprobs``), the given token's
value and the most likely alternatives. Computed only for requests that ask (``SamplingParams.logprobs``,
``prompt_logprobs``), a slice of rows at a time so a long prompt never holds its whole ``[T, V]``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

# Rows whose log-softmax is taken at once: bounds the transient ``[rows, V]`` tensors a long prompt makes.
SLICE_ROWS = 256


class TokenLogprob(NamedTuple):
    """One position: the token there (sampled, or the prompt's), its log-probability given what came
    before, and the ``top`` most likely tokens with theirs, most likely first."""

    token_id: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


def token_logprobs(
    logits: torch.Tensor | Callable[[int, int], torch.Tensor],
    token_ids: Sequence[int],
    num_top: Sequence[int],
) -> list[TokenLogprob]:
    """Row ``i``'s log-probability of ``token_ids[i]`` and its ``num_top[i]`` most likely tokens.

    ``logits``: ``[n, V]`` float logits, or a function of ``(start, end)`` that gives rows
    ``[start, end)`` (``engine.model_runner.KeptRows.logits``), called a slice at a time.
    """
    n = len(token_ids)
    if len(num_top) != n:
        raise ValueError(f"{n} token ids but {len(num_top)} top counts")
    out: list[TokenLogprob] = []
    for start in range(0, n, SLICE_ROWS):
        end = min(start + SLICE_ROWS, n)
        part = logits[start:end] if isinstance(logits, torch.Tensor) else logits(start, end)
        out += _slice_logprobs(part, token_ids[start:end], num_top[start:end])
    return out


def _slice_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]
) -> list[TokenLogprob]:
    lp = logits.float().log_softmax(dim=-1)  # [m, V]
    ids = torch.tensor(list(token_ids), dtype=torch.int64, device=lp.device)
    chosen = lp.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()  # [m]
    k = max(num_top, default=0)
    if k == 0:
        return [TokenLogprob(t, c) for t, c in zip(token_ids, chosen, strict=True)]
    vals, idx = lp.topk(min(k, lp.shape[1]), dim=-1)  # [m, k], most likely first
    top_vals, top_idx = vals.tolist(), idx.tolist()
    return [
        TokenLogprob(t, c, tuple(top_idx[i][:m]), tuple(top_vals[i][:m]))
        for i, (t, c, m) in enumerate(zip(token_ids, chosen, num_top, strict=True))
    ]


def prompt_targets(prompt: Sequence[int], start: int, num_tokens: int) -> list[int]:
    """The prompt tokens a chunk's positions ``[start, start + num_tokens)`` predict: position ``p``'s
    logits give the log-probability of token ``p + 1``; the prompt's last position predicts the first
    output token, which is not the prompt's."""
    return list(prompt[start + 1 : min(start + num_tokens + 1, len(prompt))])
