"""Constrained decoding: one grammar matcher per constrained sequence, and the token masks it allows.

llguidance (``engine.structured`` says why this library) compiles a request's constraint against the
model's vocabulary; each constrained sequence keeps a matcher that accepts every token it outputs. Before
a step samples, ``MaskFiller`` fills one bitmask row per constrained row on a thread of its own (the
library computes masks with the GIL released), so the masks are made while the forward runs;
``apply_token_bitmask`` then sets every token a row's grammar forbids to -inf. Eos is allowed only where
the grammar may end; once it can extend no further, eos is the only token left.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from pdserve.engine.params import SamplingParams
from pdserve.engine.structured import StructuredOutputsParams

if TYPE_CHECKING:
    import llguidance

    from pdserve.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_MAX_COMPILED = 256  # distinct constraints whose compiled matcher is kept (least recently used dropped)


class TokenMask(NamedTuple):
    """The sampler's input for a step's constrained rows: ``bitmask [len(rows), ceil(V / 32)]`` int32, bit
    ``t % 32`` of word ``t // 32`` set where token ``t`` is allowed; row ``i`` masks logits row
    ``rows[i]``."""

    rows: list[int]
    bitmask: torch.Tensor

    def spread(self, index: Sequence[int]) -> TokenMask:
        """The mask of logits rows ``index`` picks (row ``j`` is row ``index[j]``: an ``n`` > 1 prompt's
        row once per choice), each with its source row's mask."""
        at = {r: k for k, r in enumerate(self.rows)}
        rows = [j for j, i in enumerate(index) if i in at]
        return TokenMask(rows, self.bitmask[[at[index[j]] for j in rows]])


class GrammarMatcher:
    """One sequence's place in its grammar."""

    __slots__ = ("_m", "_eos", "ended")

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: frozenset[int]) -> None:
        self._m = matcher
        self._eos = eos_token_ids
        # The grammar took eos, or refused a token: the sequence ends here (finish reason "stop").
        self.ended = False

    @property
    def llmatcher(self) -> llguidance.LLMatcher:
        return self._m

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False when the grammar forbids it (the matcher then ends)."""
        ok = bool(self._m.consume_token(token_id))
        self.ended = not ok or token_id in self._eos
        return ok

    def copy(self) -> GrammarMatcher:
        """A matcher of its own in the same place (a choice forked from this sequence)."""
        m = GrammarMatcher(self._m.deep_copy(), self._eos)
        m.ended = self.ended
        return m

    def accept_all(self, token_ids: Sequence[int]) -> bool:
        """Replay tokens already output (a migrated stream, a prefilled first token)."""
        return all(self.accept(t) for t in token_ids)

    @property
    def error(self) -> str:
        return self._m.get_error()

    def state(self) -> tuple[bool, bool, bool, bytes]:
        """Ended, accepting, stopped, and the next mask: what two matchers in the same place agree on."""
        return self.ended, self._m.is_accepting(), self._m.is_stopped(), self._m.compute_bitmask()


class GrammarCompiler:
    """Compiles constraints against one model's vocabulary, once per distinct constraint, and hands out
    matchers. Thread-safe. The library's view of the vocabulary is built on first use (about half a second
    for a 50k vocabulary), so processes that never see a constrained request never pay for it."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width: bits past the tokenizer's vocabulary stay 0
        self.eos_token_ids = frozenset(eos_token_ids)
        self._eos = list(dict.fromkeys(eos_token_ids))
        self._lock = threading.Lock()
        self._compiled: OrderedDict[StructuredOutputsParams, llguidance.LLMatcher] = OrderedDict()
        self.num_compiled = 0  # compilations since start (the cache's misses)

    @functools.cached_property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        import llguidance

        if self._tokenizer is None:
            raise ValueError("structured_outputs needs the model's tokenizer, and this model has none")
        n = max(self.vocab_size, self._tokenizer.vocab_size)
        return llguidance.LLTokenizer(self._tokenizer.backend.to_str(), n_vocab=n, eos_token=self._eos)

    @property
    def bitmask_words(self) -> int:
        return (max(self.vocab_size, self.lltokenizer.vocab_size) + 31) // 32

    def compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The compiled, unstarted matcher of ``spec`` (cached). ValueError naming the field when the
        library cannot compile it for this vocabulary."""
        import llguidance

        with self._lock:
            m = self._compiled.get(spec)
            if m is not None:
                self._compiled.move_to_end(spec)
                return m
        tok = self.lltokenizer
        m = llguidance.LLMatcher(tok, spec.lark(), log_level=0)
        if m.is_error():
            raise ValueError(f"{spec.field} does not compile: {m.get_error().strip().splitlines()[0]}")
        with self._lock:
            self._compiled[spec] = m
            self.num_compiled += 1
            while len(self._compiled) > _MAX_COMPILED:
                self._compiled.popitem(last=False)
        return m

    def matcher(self, spec: StructuredOutputsParams, replay: Sequence[int] = ()) -> GrammarMatcher:
        """A matcher at the start of ``spec``, advanced past ``replay`` (output tokens the sequence already
        has). ValueError when ``spec`` does not compile or ``replay`` leaves the grammar."""
        m = GrammarMatcher(self.compile(spec).deep_copy(), self.eos_token_ids)
        if not m.accept_all(replay):
            raise ValueError(f"{spec.field}: the output so far does not match it ({m.error.strip()})")
        return m


class MaskFiller:
    """Fills a step's bitmask on a thread of its own: ``start`` before the forward, ``TokenMask`` after."""

    def __init__(self, words: int) -> None:
        import llguidance

        self.words = words
        self._executor = llguidance.LLExecutor(num_threads=1)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")

    def fill(self, matchers: Sequence[GrammarMatcher]) -> torch.Tensor:
        """``[len(matchers), words]`` the bitmask of each matcher's next token (here, now)."""
        bitmask = torch.zeros((len(matchers), self.words), dtype=torch.int32)
        pairs = [(m.llmatcher, i) for i, m in enumerate(matchers)]
        # (a contiguous CPU int32 tensor, rows of ``words`` words: what the library writes into)
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), self.words * 4, len(matchers))
        return bitmask

    def start(self, rows: list[int], matchers: Sequence[GrammarMatcher]) -> Future[TokenMask]:
        """The mask of ``matchers`` (for logits rows ``rows``), made on the mask thread."""
        return self._thread.submit(lambda: TokenMask(rows, self.fill(matchers)))

    def close(self) -> None:
        self._thread.shutdown(wait=False)


_BITS = torch.arange(32, dtype=torch.int32)


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[k, vocab]`` bool: which tokens each row of ``bitmask [k, words]`` (int32) allows."""
    if bitmask.device.type == "cpu":
        # numpy's unpackbits: an order of magnitude faster on CPU than shifting every word 32 ways.
        bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(bits[:, :vocab]).bool()
    return allowed_tokens_by_shifts(bitmask, vocab)


def allowed_tokens_by_shifts(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """``allowed_tokens`` in torch ops alone, on the bitmask's device (a GPU's)."""
    shifted = bitmask.unsqueeze(-1) >> _BITS.to(bitmask.device)  # [k, words, 32]
    return (shifted & 1).bool().flatten(1)[:, :vocab]


def apply_token_bitmask(logits: torch.Tensor, mask: TokenMask) -> torch.Tensor:
    """``logits [n, V]`` with every token ``mask`` forbids in its rows set to -inf; a new tensor (the
    caller's logits are untouched). A row that allows no token at all (its matcher erred) keeps its
    logits: the matcher ends that sequence once it sees the token."""
    vocab = logits.shape[1]
    allowed = allowed_tokens(mask.bitmask.to(logits.device, non_blocking=True), vocab)  # [k, V]
    out = logits.clone()
    idx = torch.tensor(mask.rows, device=logits.device)
    rows = out.index_select(0, idx)
    none = ~allowed.any(dim=1, keepdim=True)
    rows.masked_fill_(~(allowed | none), float("-inf"))
    out.index_copy_(0, idx, rows)
    return out


class ConstrainedSequences:
    """An engine's constrained sequences: their matchers, and the step's masks. One thread uses it (the
    engine's); the masks are filled on the mask thread while that thread runs the forward."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._matchers: dict[Hashable, GrammarMatcher] = {}
        self._filler: MaskFiller | None = None  # made on the first constrained step

    def __bool__(self) -> bool:
        return bool(self._matchers)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._matchers

    def check(self, params: SamplingParams) -> None:
        """ValueError naming the field when the request's constraint does not compile for this model."""
        if params.structured_outputs is not None:
            self.compiler.compile(params.structured_outputs)

    def new(self, params: SamplingParams, replay: Sequence[int] = ()) -> GrammarMatcher | None:
        """A matcher for a request (None: unconstrained), past ``replay``, its outputs so far."""
        if params.structured_outputs is None:
            return None
        return self.compiler.matcher(params.structured_outputs, replay)

    def add(self, seq_id: Hashable, matcher: GrammarMatcher | None) -> None:
        if matcher is not None:
            self._matchers[seq_id] = matcher

    def drop(self, seq_id: Hashable) -> None:
        self._matchers.pop(seq_id, None)

    def fork(self, seq_id: Hashable, child_ids: Sequence[Hashable]) -> None:
        """Choices forked from ``seq_id`` (``n`` > 1): each gets a copy of its matcher."""
        m = self._matchers.get(seq_id)
        if m is not None:
            for child in child_ids:
                self._matchers[child] = m.copy()

    def start_masks(self, seq_ids: Sequence[Hashable]) -> Future[TokenMask] | None:
        """The masks of the constrained ones among a step's sampled sequences (None: there are none)."""
        matchers = self._matchers
        rows = [i for i, sid in enumerate(seq_ids) if sid in matchers]
        if not rows:
            return None
        if self._filler is None:
            self._filler = MaskFiller(self.compiler.bitmask_words)
        return self._filler.start(rows, [matchers[seq_ids[i]] for i in rows])

    def accept(self, seq_id: Hashable, token_id: int) -> bool:
        """Advance a sequence's matcher past its new token. True when the sequence ends here: its grammar
        took eos, or refused the token (logged). False for an unconstrained sequence."""
        m = self._matchers.get(seq_id)
        if m is None:
            return False
        if not m.accept(token_id):
            log.warning("request %s: token %d leaves its grammar: %s", seq_id, token_id, m.error.strip())
        return m.ended

    def close(self) -> None:
        if self._filler is not None:
            self._filler.close()
