"""Batched token sampler: greedy, temperature, top-k, top-p, min_tokens, per-request seed; one call a step.
Penalties and logit_bias (``engine.penalties``) apply first, to the rows that ask for them.

Seeded rows draw by the exponential race with counter-based noise of (seed, output index, vocabulary
index) alone, so a seeded request samples the same tokens alone or in any batch, on any device and on any
worker; unseeded rows share one generator (docs/engine.md). Each call ends in one device-to-host copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from pdserve.engine.grammar import TokenMask, apply_token_bitmask
from pdserve.engine.params import SamplingParams
from pdserve.engine.penalties import adjust_logits

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def token_seed(seed: int, index: int) -> int:
    """The 63-bit generator seed for output token ``index`` of a request seeded with ``seed`` (mod 2**64)."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ index) >> 1


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_GAMMA = _signed(0x9E3779B97F4A7C15)
_FMIX1 = _signed(0xFF51AFD7ED558CCD)
_FMIX2 = _signed(0xC4CEB9FE1A85EC53)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def counter_uniform(keys: torch.Tensor, n: int) -> torch.Tensor:
    """``[m, n]`` float32 uniforms in (0, 1): row ``r``, column ``j`` is murmur3's 64-bit finaliser of
    ``keys[r] + (j + 1) * golden_gamma`` (mod 2**64; int64 arithmetic wraps), top 24 bits, centred.
    ``keys [m]`` int64. The same bits on every device (``counter_uniform_reference`` is the spec)."""
    cols = torch.arange(1, n + 1, dtype=torch.int64, device=keys.device)
    x = keys[:, None] + cols[None, :] * _GAMMA  # [m, n]
    x = (x ^ _shr(x, 33)) * _FMIX1
    x = (x ^ _shr(x, 33)) * _FMIX2
    x = x ^ _shr(x, 33)
    return (_shr(x, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def counter_uniform_reference(key: int, j: int) -> float:
    """Pure-Python ``counter_uniform(tensor([key]), n)[0, j]``."""
    x = (key + (j + 1) * 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 33)) * 0xFF51AFD7ED558CCD) & _MASK64
    x = ((x ^ (x >> 33)) * 0xC4CEB9FE1A85EC53) & _MASK64
    x ^= x >> 33
    return ((x >> 40) + 0.5) / (1 << 24)


class SampleRow(NamedTuple):
    """One row of the logits to sample: the request's params and how many tokens it has output so far.

    A NamedTuple, not a frozen dataclass: the engine makes one per sequence per step, and a frozen
    dataclass's ``__init__`` costs several times as much."""

    params: SamplingParams
    output_index: int  # index of the token being sampled = number of output tokens already generated
    # Outputs the request made elsewhere before (a migrated stream): its seeded noise continues at
    # ``output_offset + output_index``; min_tokens counts ``output_index`` only (the caller lowered it).
    output_offset: int = 0
    # The request's tokens, read only for params that ``adjusts_logits`` (penalties): the prompt (whose
    # last ``output_offset`` tokens are earlier outputs) and the outputs made here so far.
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()


class Sampler:
    def __init__(
        self,
        eos_token_ids: Sequence[int] = (),
        seed: int = 0,
        device: str | torch.device = "cpu",
        argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
        race: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ):
        """``argmax``: the greedy rows' ``logits [n, V] -> [n]`` (``ModelRunner.argmax``; default torch's).
        ``race``: the seeded rows' draw, ``seeded_race``'s contract (``ModelRunner.seeded_race``)."""
        self.eos_token_ids = tuple(eos_token_ids)
        self.argmax = argmax or (lambda x: x.argmax(dim=-1))
        self.race = race or seeded_race
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, rows: Sequence[SampleRow], token_mask: TokenMask | None = None
    ) -> list[int]:
        """Sample one token per row of ``logits`` [n, V] (float32); returns n token ids. ``token_mask``: the
        constrained rows' grammar masks (``engine.grammar``), applied first; in those rows the grammar alone
        decides where the output may end (min_tokens does not hold eos back there)."""
        n, vocab = logits.shape
        if n != len(rows):
            raise ValueError(f"logits has {n} rows but {len(rows)} sample rows were given")
        if n == 0:
            return []
        if token_mask is not None and token_mask.rows:
            logits = apply_token_bitmask(logits, token_mask)
        # One pass over the rows, every step: those still short of min_tokens, those with penalties or
        # biases, and those not greedy.
        short: list[int] = []
        idx: list[int] = []
        adjust: list[int] = []
        for i, r in enumerate(rows):
            p = r.params
            if r.output_index < p.min_tokens and p.structured_outputs is None:
                short.append(i)
            if p.adjusts_logits:
                adjust.append(i)
            # top_k 1 is argmax, ties to the first index as greedy: a draw among exactly tied logits (bf16
            # rounding makes them) would let a top_k=1 request leave greedy's tokens.
            if not p.greedy and p.top_k != 1:
                idx.append(i)
        if short:
            logits = self._mask_min_tokens(logits, rows, short, vocab)
        if adjust:
            # vLLM's order: min_tokens and logit_bias, then the penalties, then temperature, top-k, top-p.
            logits = adjust_logits(logits, rows, adjust)
        tokens = self.argmax(logits)  # [n]
        if idx:
            sub = logits if len(idx) == n else logits[idx]
            sampled = self._sample(sub, [rows[i] for i in idx])
            if len(idx) == n:
                tokens = sampled
            else:
                tokens[idx] = sampled
        return tokens.tolist()  # the step's one device-to-host copy

    def argmax_tokens(self, logits: torch.Tensor) -> list[int]:
        """``self(logits, rows)`` where every row's params are ``argmax_only``: no per-row work."""
        return self.argmax(logits).tolist() if len(logits) else []

    def _mask_min_tokens(
        self, logits: torch.Tensor, rows: Sequence[SampleRow], short: list[int], vocab: int
    ) -> torch.Tensor:
        """Until a request has ``min_tokens`` outputs, its stop tokens and eos cannot be sampled: ``short``
        are the indices of the rows with fewer.

        As in vLLM (and transformers' ``min_new_tokens``) eos is masked even with ``ignore_eos``.
        """
        masked = False
        for i in short:
            p = rows[i].params
            ids = {t for t in (*p.stop_token_ids, *self.eos_token_ids) if t < vocab}
            if not ids:
                continue
            if not masked:
                logits = logits.clone()  # the caller's logits stay untouched
                masked = True
            logits[i, sorted(ids)] = float("-inf")
        return logits

    def _sample(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
        m, vocab = logits.shape
        dev = logits.device
        temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype, device=dev)
        logits = logits / temps.unsqueeze(1)  # [m, V]
        probs = logits.softmax(dim=-1)  # [m, V]
        filt = [i for i, r in enumerate(rows) if r.params.top_k != -1 or r.params.top_p < 1.0]
        if filt:
            # Tokens outside the top-k / top-p sets get probability 0; the rest keep theirs unnormalised
            # (both draws below scale with the row's total).
            frows = [rows[i] for i in filt]
            k = torch.tensor(
                [min(r.params.top_k, vocab) if r.params.top_k > 0 else vocab for r in frows], device=dev
            )
            p = torch.tensor([r.params.top_p for r in frows], dtype=logits.dtype, device=dev)
            if len(filt) == m:
                thr = top_k_top_p_thresholds(logits, k, p, probs=probs)
                probs.masked_fill_(logits < thr.unsqueeze(1), 0.0)
            else:
                lf, pf = logits[filt], probs[filt]
                thr = top_k_top_p_thresholds(lf, k, p, probs=pf)
                probs[filt] = pf.masked_fill_(lf < thr.unsqueeze(1), 0.0)
        seeded = [i for i, r in enumerate(rows) if r.params.seed is not None]
        unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
        tokens = torch.empty(m, dtype=torch.int64, device=dev)
        if unseeded:
            # One uniform a row, inverted through its distribution: generating noise for the whole
            # vocabulary from torch's CPU generator would cost a large share of a decode step.
            sub = probs if len(unseeded) == m else probs[unseeded]
            u = torch.rand(len(unseeded), generator=self.generator, device=dev)
            drawn = inverse_cdf_sample(sub, u)
            if len(unseeded) == m:
                return drawn
            tokens[unseeded] = drawn
        keys = torch.tensor(
            [
                token_seed(rows[i].params.seed or 0, rows[i].output_offset + rows[i].output_index)
                for i in seeded
            ],
            dtype=torch.int64,
            device=dev,
        )
        drawn = self.race(probs if len(seeded) == m else probs[seeded], keys)
        if len(seeded) == m:
            return drawn
        tokens[seeded] = drawn
        return tokens


def seeded_race(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``[m]`` each row's draw from ``probs [m, V]`` (rows of any positive total; zeros are never drawn) for
    the row's noise key (``token_seed``): the exponential race ``argmax(probs / q)``, ``q = -log(u)`` from
    ``counter_uniform``, the first index on ties. May overwrite ``probs``."""
    q = counter_uniform(keys, probs.shape[1]).log_().neg_()  # [m, V] Exp(1)
    # A zero draw would turn a masked (zero-probability) token into 0/0 = NaN, which argmax picks.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return probs.div_(q).argmax(dim=-1)


def inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs [m, V]`` (rows summing to ~1) for uniforms ``u [m]`` in [0, 1): the first
    index whose cumulative probability exceeds ``u`` times the row's total, so a zero-probability (masked)
    token is never picked. Where rounding puts ``u * total`` at the total, the row's most likely token."""
    cdf = probs.cumsum(dim=-1)  # [m, V]
    target = (u.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)  # [m, 1]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)  # [m]
    over = idx >= probs.shape[1]
    if probs.device.type == "cpu" and not bool(over.any()):  # (on CUDA the check would be a second sync)
        return idx
    return torch.where(over, probs.argmax(dim=-1), idx)


# A row's top-k and top-p sets are looked for among its largest ``_CANDIDATES`` logits (``topk``: sorting a
# whole vocabulary on CPU is costly), then among 8x as many for the rows that did not settle there, and
# only then in the sorted row. A typical nucleus lies within the first candidates at most positions.
_CANDIDATES = 256


def apply_top_k_top_p(
    logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor, candidates: int = _CANDIDATES
) -> torch.Tensor:
    """Mask logits [m, V] outside each row's top-k and top-p (nucleus) sets with -inf.

    ``k`` [m] (V = off) and ``p`` [m] (1.0 = off). The top-p set is the smallest run of most likely tokens
    (of the top-k set) whose probabilities sum to at least ``p`` times the top-k set's. Each set is a
    threshold on the logits, so tokens tied with its last member are kept (as vLLM does at the k-th value)
    and the result does not depend on how a sort orders ties. The most likely token always survives.
    ``candidates`` only decides how many of a row's largest logits are looked at first; the masks are the
    same for any value (the tests check this).
    """
    thr = top_k_top_p_thresholds(logits, k, p, candidates)
    return logits.masked_fill(logits < thr.unsqueeze(1), float("-inf"))


def top_k_top_p_thresholds(
    logits: torch.Tensor,
    k: torch.Tensor,
    p: torch.Tensor,
    candidates: int = _CANDIDATES,
    probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[m]`` the smallest logit each row keeps under ``apply_top_k_top_p`` (-inf where nothing is cut).
    ``probs``: ``logits.softmax(-1)`` where the caller has it (a row's softmax, like its cumulative sums,
    is computed within the row alone, so a row gets the same thresholds in any batch)."""
    m, vocab = logits.shape
    if probs is None:
        probs = logits.softmax(dim=-1)
    # On a GPU the sort is cheap and deciding which rows the candidates settle would cost a sync.
    first = max(candidates, 2) if logits.device.type == "cpu" else vocab
    widths = [w for w in (first, 8 * first) if w < vocab] + [vocab]
    thr = torch.empty(m, dtype=logits.dtype, device=logits.device)
    rest = torch.arange(m, device=logits.device)
    stage = 0
    while True:
        w = widths[stage]
        sub = logits[rest] if len(rest) < m else logits
        top, idx = sub.topk(w, dim=-1) if w < vocab else sub.sort(dim=-1, descending=True)
        ptop = (probs[rest] if len(rest) < m else probs).gather(1, idx)
        thr_w, done, seen = _thresholds(top, ptop, k[rest], p[rest], vocab)
        thr[rest] = thr_w
        if w == vocab or bool(done.all()):
            return thr
        # The wider candidates only where they can settle every row left: a row whose top-k set is larger,
        # or whose candidates hold under half of its nucleus (a flat distribution), is sorted whole.
        left = ~done
        wider = widths[stage + 1]
        hopeful = (k[rest][left] <= wider) | (k[rest][left] >= vocab)
        hopeful &= seen[left] >= 0.5 * p[rest][left].to(seen.dtype)
        rest = rest[left]
        stage = stage + 1 if wider == vocab or bool(hopeful.all()) else len(widths) - 1


def _thresholds(
    top: torch.Tensor, ptop: torch.Tensor, k: torch.Tensor, p: torch.Tensor, vocab: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thresholds from ``top [m, w]``, each row's ``w`` largest logits in descending order, and ``ptop``,
    their probabilities; ``[m]`` whether ``top`` decided them (always when ``w`` is the vocabulary); and
    ``[m]`` the share of the top-k set's probability that ``top`` holds (1 where no row has a top-p)."""
    w = top.shape[1]
    ninf = float("-inf")
    k = k.clamp(1, vocab)
    topk = k < vocab
    kth = top.gather(1, (k - 1).clamp(max=w - 1).unsqueeze(1)).squeeze(1)  # the k-th largest logit
    kth = torch.where(topk, kth, ninf)
    done = ~topk | (k <= w)
    nucleus = p < 1.0
    seen = torch.ones_like(kth)
    if top.device.type != "cpu" or bool(nucleus.any()):  # (on a GPU the check would be a sync)
        # of the top-k set (ties at the k-th included); searchsorted counts without a [m, w] mask
        members = torch.searchsorted(top.neg(), kth.neg().unsqueeze(1), right=True).squeeze(1)
        whole = ~topk | (members < w) | (w == vocab)  # ... all of them inside ``top``
        cum = ptop.cumsum(dim=-1)  # [m, w]
        total = torch.where(topk, cum.gather(1, (members - 1).clamp(min=0).unsqueeze(1)).squeeze(1), 1.0)
        target = (p.to(cum.dtype) * total).unsqueeze(1)
        last = torch.searchsorted(cum, target).squeeze(1)  # the first position reaching p of the set
        reached = last < w
        thr_p = top.gather(1, last.clamp(max=w - 1).unsqueeze(1)).squeeze(1)
        # Not reached in the whole vocabulary (p at the edge of float rounding): keep the top-k set.
        thr_p = torch.where(reached, thr_p, ninf)
        kth = torch.where(nucleus, torch.maximum(kth, thr_p), kth)
        done &= ~nucleus | (reached & whole)
        seen = cum[:, -1] / total
    return kth, done, seen
