"""Logit adjustments a request asks for before it samples: logit_bias, then the repetition, frequency and
presence penalties (vLLM's order and definitions), batched over the rows that ask for any of them.

Each is a few tensor operations over ``[m, V]``: the rows' tokens become count tensors by one
``scatter_add_``, never a loop over tokens in Python. Rows whose value of a penalty is neutral (1 for the
repetition penalty, 0 for the others) get bit-identical logits from it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol

import torch

from pdserve.engine.params import SamplingParams


class TokenRow(Protocol):
    """What a row needs to be adjusted (``sampler.SampleRow`` is one)."""

    @property
    def params(self) -> SamplingParams: ...
    @property
    def output_offset(self) -> int: ...
    @property
    def prompt_token_ids(self) -> Sequence[int]: ...
    @property
    def output_token_ids(self) -> Sequence[int]: ...


def token_counts(
    seqs: Sequence[Sequence[int]], vocab: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``[m, vocab]`` how often each token occurs in each of the ``m`` sequences."""
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    flat = torch.tensor(list(itertools.chain.from_iterable(seqs)), dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(seqs), dtype=torch.int64), lens)
    counts = torch.zeros(len(seqs) * vocab, dtype=dtype, device=device)
    if len(flat):
        index = (rows * vocab + flat).to(device)
        counts.scatter_add_(0, index, torch.ones(len(flat), dtype=dtype, device=device))
    return counts.view(len(seqs), vocab)


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    presence: torch.Tensor | None = None,
    frequency: torch.Tensor | None = None,
    repetition: torch.Tensor | None = None,
) -> torch.Tensor:
    """``logits [m, V]`` penalised, as a new tensor. ``presence``, ``frequency``, ``repetition``: ``[m]`` each
    row's value, or None where no row has one.

    Repetition (transformers' ``RepetitionPenaltyLogitsProcessor``): a token seen in the row's prompt or
    outputs has a negative logit multiplied by the penalty, any other divided by it. Then, with ``c`` the
    token's count among the outputs alone (OpenAI's definition):
    ``logit - frequency * c - presence * (c > 0)``.
    """
    vocab = logits.shape[1]
    dev = logits.device
    counts = token_counts(output_ids, vocab, logits.dtype, dev)  # [m, V]
    seen_out = counts > 0
    if repetition is not None:
        seen = seen_out | (token_counts(prompt_ids, vocab, logits.dtype, dev) > 0)
        penalty = torch.where(seen, repetition.unsqueeze(1), 1.0)  # [m, V]; 1: untouched
        logits = torch.where(logits < 0, logits * penalty, logits / penalty)
    else:
        logits = logits.clone()
    if frequency is not None:
        logits -= frequency.unsqueeze(1) * counts
    if presence is not None:
        logits -= presence.unsqueeze(1) * seen_out
    return logits


def apply_logit_bias(logits: torch.Tensor, biases: Sequence[tuple[tuple[int, float], ...]]) -> None:
    """Add each row's ``(token id, bias)`` pairs to ``logits [m, V]``, in place."""
    rows = [i for i, b in enumerate(biases) for _ in b]
    ids = [t for b in biases for t, _ in b]
    values = [v for b in biases for _, v in b]
    if not ids:
        return
    dev = logits.device
    index = (torch.tensor(rows, device=dev), torch.tensor(ids, device=dev))
    logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=dev), accumulate=True)


def adjust_logits(logits: torch.Tensor, rows: Sequence[TokenRow], which: Sequence[int]) -> torch.Tensor:
    """``logits [n, V]`` with the adjustments of rows ``which`` (those whose params ``adjusts_logits``)
    applied; the other rows are copied untouched, and the caller's tensor is left as it was.

    A migrated stream's earlier outputs (its ``output_offset``, the prompt's tail now) count as outputs.
    """
    logits = logits.clone()
    sel = [rows[i] for i in which]
    dev = logits.device
    bias_rows = [j for j, r in enumerate(sel) if r.params.logit_bias]
    pen_rows = [
        j
        for j, r in enumerate(sel)
        if r.params.presence_penalty or r.params.frequency_penalty or r.params.repetition_penalty != 1
    ]
    idx = torch.tensor(which, device=dev)
    sub = logits[idx]  # [m, V]
    if bias_rows:
        part = sub if len(bias_rows) == len(sel) else sub[bias_rows]
        apply_logit_bias(part, [sel[j].params.logit_bias for j in bias_rows])
        if len(bias_rows) != len(sel):
            sub[bias_rows] = part
    if pen_rows:
        prs = [sel[j] for j in pen_rows]
        prompts: list[Sequence[int]] = []
        outputs: list[Sequence[int]] = []
        for r in prs:
            cut = len(r.prompt_token_ids) - r.output_offset
            prompts.append(r.prompt_token_ids[:cut])
            tail = r.prompt_token_ids[cut:]
            outputs.append([*tail, *r.output_token_ids] if tail else r.output_token_ids)

        def col(name: str, neutral: float) -> torch.Tensor | None:
            values = [getattr(r.params, name) for r in prs]
            if all(v == neutral for v in values):
                return None  # (decided here, from the params: a check on the device would be a sync)
            return torch.tensor(values, dtype=logits.dtype, device=dev)

        part = sub if len(pen_rows) == len(sel) else sub[pen_rows]
        part = apply_penalties(
            part,
            prompts,
            outputs,
            presence=col("presence_penalty", 0.0),
            frequency=col("frequency_penalty", 0.0),
            repetition=col("repetition_penalty", 1.0),
        )
        if len(pen_rows) == len(sel):
            sub = part
        else:
            sub[pen_rows] = part
    logits[idx] = sub
    return logits
