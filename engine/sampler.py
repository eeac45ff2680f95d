"""Batched token sampler: greedy, temperature, top-k, top-p, min_tokens, per-request seed.

One call per step samples every row of the batch. Sampling is the exponential
race (equivalent to Gumbel-max): ``argmax(probs / q)`` with ``q ~ Exp(1)``.

Seeded rows are stateless per token: the noise for output token ``i`` of a
request comes from a generator seeded with ``mix(seed, i)`` and nothing else.
So a seeded request samples the same tokens alone or in any batch, and in the
disaggregated system the prefill worker (token 0) and the decode worker
(tokens 1..) sample exactly what a colocated engine would. Unseeded rows share
one engine-wide generator. An all-greedy batch is a single argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.params import SamplingParams

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def token_seed(seed: int, index: int) -> int:
    """The 63-bit generator seed for output token ``index`` of a request seeded with ``seed`` (mod 2**64)."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ index) >> 1


@dataclass(frozen=True)
class SampleRow:
    """One row of the logits to sample: the request's params and how many tokens it has output so far."""

    params: SamplingParams
    output_index: int  # index of the token being sampled = number of output tokens already generated


class Sampler:
    def __init__(self, eos_token_ids: Sequence[int] = (), seed: int = 0, device: str | torch.device = "cpu"):
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[int]:
        """Sample one token per row of ``logits`` [n, V] (float32); returns n token ids."""
        n, vocab = logits.shape
        if n != len(rows):
            raise ValueError(f"logits has {n} rows but {len(rows)} sample rows were given")
        if n == 0:
            return []
        logits = self._mask_min_tokens(logits, rows, vocab)
        greedy = [r.params.greedy for r in rows]
        if all(greedy):
            return logits.argmax(dim=-1).tolist()
        out = logits.argmax(dim=-1).tolist() if any(greedy) else [0] * n
        idx = [i for i in range(n) if not greedy[i]]
        sampled = self._sample(logits[idx], [rows[i] for i in idx])
        for i, t in zip(idx, sampled, strict=True):
            out[i] = t
        return out

    def _mask_min_tokens(self, logits: torch.Tensor, rows: Sequence[SampleRow], vocab: int) -> torch.Tensor:
        """Until a request has ``min_tokens`` outputs, its stop tokens and eos cannot be sampled.

        As in vLLM (and transformers' ``min_new_tokens``) eos is masked even with ``ignore_eos``.
        """
        masked = False
        for i, r in enumerate(rows):
            p = r.params
            if r.output_index >= p.min_tokens:
                continue
            ids = {t for t in (*p.stop_token_ids, *self.eos_token_ids) if t < vocab}
            if not ids:
                continue
            if not masked:
                logits = logits.clone()  # the caller's logits stay untouched
                masked = True
            logits[i, sorted(ids)] = float("-inf")
        return logits

    def _sample(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[int]:
        m, vocab = logits.shape
        temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype, device=logits.device)
        logits = logits / temps.unsqueeze(1)  # [m, V]
        filt = [i for i, r in enumerate(rows) if r.params.top_k != -1 or r.params.top_p < 1.0]
        if filt:
            sub = [rows[i] for i in filt]
            k = torch.tensor(
                [min(r.params.top_k, vocab) if r.params.top_k > 0 else vocab for r in sub],
                device=logits.device,
            )
            p = torch.tensor([r.params.top_p for r in sub], dtype=logits.dtype, device=logits.device)
            logits[filt] = apply_top_k_top_p(logits[filt], k, p)
        probs = logits.softmax(dim=-1)  # [m, V]
        q = torch.empty_like(probs)  # [m, V] exponential noise
        unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
        if unseeded:
            q[unseeded] = torch.empty(
                (len(unseeded), vocab), dtype=probs.dtype, device=probs.device
            ).exponential_(generator=self.generator)
        for i, r in enumerate(rows):
            if r.params.seed is not None:
                g = torch.Generator(device=probs.device)
                g.manual_seed(token_seed(r.params.seed, r.output_index))
                q[i].exponential_(generator=g)
        # A zero draw would turn a masked (zero-probability) token into 0/0 = NaN, which argmax picks.
        q.clamp_(min=torch.finfo(q.dtype).tiny)
        return probs.div_(q).argmax(dim=-1).tolist()


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Mask logits [m, V] outside each row's top-k and top-p (nucleus) sets with -inf.

    ``k`` [m] (V = off) and ``p`` [m] (1.0 = off). The most likely token always
    survives; ties at the k-th value are kept (as vLLM does).
    """
    srt, order = logits.sort(dim=-1, descending=False)  # [m, V] ascending
    vocab = srt.shape[1]
    kth = srt.gather(1, (vocab - k).clamp(0, vocab - 1).unsqueeze(1))  # [m, 1]
    srt = srt.masked_fill(srt < kth, float("-inf"))
    cum = srt.softmax(dim=-1).cumsum(dim=-1)  # [m, V]
    drop = cum <= (1 - p).unsqueeze(1)
    drop[:, -1] = False
    srt = srt.masked_fill(drop, float("-inf"))
    return srt.scatter(1, order, srt)
