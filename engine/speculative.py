"""Speculative decoding on the decode side: proposals, the adaptive rule, and exact acceptance.

A proposer guesses a decoding stream's next few tokens; one verify forward computes the target's logits at
the stream's last token and at every proposed one; the target samples each position as it would have
without speculation (the same sampler row, seeded noise included), and a proposal is accepted while it
equals that sample. The stream gets the samples up to and including the first that differs from the
proposal, so its output is the non-speculative output, token for token (docs/speculative_decoding.md).
Pure Python: imports no torch.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, fields
from typing import Protocol

from pdserve.engine.sequence import Sequence

# A stream none of whose proposed tokens would pay at its acceptance rests this long, then proposes anew.
PROBE_PAUSE_STEPS = 4


class SpeculativeMethod(enum.StrEnum):
    NGRAM = "ngram"  # prompt lookup: continue an earlier occurrence of the stream's last n tokens
    # Self-speculative: the target's first ``draft_layers`` layers and its LM head propose greedily. Their
    # K/V are the target's own for those layers, so the draft needs no cache and no prefill of its own.
    DRAFT = "draft"


@dataclass(frozen=True)
class SpeculativeConfig:
    method: SpeculativeMethod | str = SpeculativeMethod.NGRAM
    num_speculative_tokens: int = 4  # k: the most tokens proposed per stream per step
    # The n-gram proposer matches the stream's last n tokens, longest first, for n in [min, max].
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # Adaptive: propose as many of k as pay at the stream's acceptance and the step's cost (``Speculator``),
    # and rest a stream whose proposals keep being wholly rejected, so open-ended output is not slowed.
    adaptive: bool = True
    # method "draft": how many of the target's first layers the draft runs (0: a quarter of them).
    draft_layers: int = 0

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "method", SpeculativeMethod(self.method))
        except ValueError:
            known = ", ".join(m.value for m in SpeculativeMethod)
            raise ValueError(f"speculative method must be one of {known}, got {self.method!r}") from None
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 16], got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi <= 16):
            raise ValueError(
                f"prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max <= 16, got {lo}, {hi}"
            )
        d = self.draft_layers
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise ValueError(f"draft_layers must be an integer >= 0, got {d!r}")

    def layers_of(self, num_layers: int) -> int:
        """The draft's layer count for a target of ``num_layers``; ValueError when it is not fewer."""
        d = self.draft_layers or max(1, num_layers // 4)
        if d >= num_layers:
            raise ValueError(f"draft_layers must be fewer than the model's {num_layers} layers, got {d}")
        return d


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """For each stream, up to its limit of guesses of the tokens that follow its tokens (``[]``: none;
        a limit of 0 asks for none). Their lookahead blocks are reserved already."""
        ...


class DraftModel(Protocol):
    def next_tokens(self, seqs: list[Sequence], token_ids: list[int], positions: list[int]) -> list[int]:
        """The draft's greedy token after each stream's ``token_ids[i]`` at ``positions[i]`` (whose K/V it
        stores in the stream's blocks, as a step would)."""
        ...


class _NgramIndex:
    """Where each n-gram of a stream's tokens last occurred with a token after it, for n in [lo, hi]: built
    once from the prompt, extended as tokens arrive, so a lookup costs a few dict reads."""

    __slots__ = ("lo", "hi", "last", "indexed")

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        # n -> n-gram -> the position of its last token (a token follows it)
        self.last: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(lo, hi + 1)}
        self.indexed = 0  # n-grams ending before this position are in ``last``

    def extend(self, tokens: list[int]) -> None:
        """Index the n-grams that now have a following token: those ending before ``len(tokens) - 1``."""
        end = len(tokens) - 1
        for n, table in self.last.items():
            for j in range(max(self.indexed, n - 1), end):
                table[tuple(tokens[j - n + 1 : j + 1])] = j
        self.indexed = max(self.indexed, end)

    def lookup(self, tokens: list[int], max_tokens: int) -> list[int]:
        for n in range(min(self.hi, len(tokens)), self.lo - 1, -1):
            j = self.last[n].get(tuple(tokens[-n:]))
            if j is not None:
                return tokens[j + 1 : j + 1 + max_tokens]
        return []


class NgramProposer:
    """Prompt lookup: the tokens that followed the most recent earlier occurrence of the stream's last n
    tokens (prompt and output alike), the longest n in [min, max] that occurred."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.lo, self.hi = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        return [self.lookup(seq, n) if n > 0 else [] for seq, n in zip(seqs, limits, strict=True)]

    def lookup(self, seq: Sequence, max_tokens: int) -> list[int]:
        state = _state(seq)
        if state.index is None:
            state.index = _NgramIndex(self.lo, self.hi)
        tokens = seq.token_ids()
        state.index.extend(tokens)
        return state.index.lookup(tokens, max_tokens)


class DraftProposer:
    """A draft model's greedy guesses, made for every proposing stream at once, one draft step per token
    (the streams that want fewer leave the batch early)."""

    def __init__(self, model: DraftModel) -> None:
        self.model = model

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in seqs]
        rows = [i for i, n in enumerate(limits) if n > 0]
        tokens = [seqs[i].last_token_id for i in rows]
        positions = [seqs[i].num_tokens - 1 for i in rows]
        while rows:
            guesses = self.model.next_tokens([seqs[i] for i in rows], tokens, positions)
            going: list[int] = []
            for i, t in zip(rows, guesses, strict=True):
                out[i].append(t)
                if len(out[i]) < limits[i]:
                    going.append(i)
            rows = going
            tokens = [out[i][-1] for i in rows]
            positions = [seqs[i].num_tokens - 1 + len(out[i]) for i in rows]
        return out


@dataclass(slots=True)
class StreamState:
    """A stream's speculation state, kept on its ``Sequence`` (so it ends with it)."""

    # Decayed counts of its proposals' accepted tokens and of their rejections (at most one a proposal):
    # accepted / (accepted + rejected) estimates the chance that its next proposed token stands. The
    # prior is one of each (an even chance) until its own proposals say otherwise.
    accepted: float = 1.0
    rejected: float = 1.0
    pause: int = 0  # steps left before it proposes again
    probing: bool = False  # resting because no token paid: it proposes one when the rest ends
    index: _NgramIndex | None = None

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


def _state(seq: Sequence) -> StreamState:
    st = seq.spec
    if st is None:
        st = seq.spec = StreamState()
    return st


# How fast a stream's acceptance estimate forgets (per proposal) and the step-cost fit forgets (per step).
ACCEPTANCE_DECAY = 0.7
STEP_COST_DECAY = 0.97
# The share of a decode step its rows cost, assumed until the fit has seen steps of different sizes.
DEFAULT_ROW_SHARE = 0.2
# How fast a row count's own departure from the fitted line forgets (per step of that many rows).
RESIDUAL_DECAY = 0.7


class StepCost:
    """A decode step's seconds as ``a + b * rows``, fitted by least squares over recent steps (exponential
    forgetting): ``b`` is what one more verified row adds to the step it rides in. Each row count seen
    also keeps its own departure from the line: a CPU's matrix kernel works in tiles of rows, so one row
    past a tile can cost as much as a tile (``seconds``)."""

    def __init__(self) -> None:
        self._n = self._x = self._y = self._xx = self._xy = 0.0
        self._residual: dict[int, float] = {}

    def observe(self, rows: int, seconds: float) -> None:
        line = self._line()
        if line is not None:
            off = seconds - (line[0] + line[1] * rows)
            old = self._residual.get(rows)
            self._residual[rows] = off if old is None else old * RESIDUAL_DECAY + off * (1 - RESIDUAL_DECAY)
        d = STEP_COST_DECAY
        self._n = self._n * d + 1.0
        self._x = self._x * d + rows
        self._y = self._y * d + seconds
        self._xx = self._xx * d + rows * rows
        self._xy = self._xy * d + rows * seconds

    def _line(self) -> tuple[float, float] | None:
        """``(a, b)``, or None until steps of different sizes were seen."""
        spread = self._n * self._xx - self._x * self._x
        if self._n < 4 or spread < 0.5 * self._n * self._n:  # (row counts' variance below 0.5)
            return None
        b = (self._n * self._xy - self._x * self._y) / spread
        a = (self._y - b * self._x) / self._n
        return max(a, 0.0), max(b, 0.0)

    def row_share(self, rows: int) -> float:
        """``b * rows / (a + b * rows)``: the share of a step of ``rows`` rows that goes with its rows (the
        rest is paid once a step: weights read, launches). ``DEFAULT_ROW_SHARE`` until steps of different
        sizes were seen."""
        line = self._line()
        if line is None:
            return DEFAULT_ROW_SHARE
        a, b = line
        step = a + b * rows
        return b * rows / step if step > 0 else DEFAULT_ROW_SHARE

    def seconds(self, rows: int) -> float | None:
        """A step of ``rows`` rows: the line plus that row count's own departure from it where one was
        seen; None until the line is known."""
        line = self._line()
        if line is None:
            return None
        return line[0] + line[1] * rows + self._residual.get(rows, 0.0)


@dataclass
class SpeculationStats:
    """Since start, for metrics: verify forwards run, tokens proposed, proposals accepted, and tokens
    emitted by verify forwards (accepted proposals plus each stream's one sampled token)."""

    verify_steps: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    streams_verified: int = 0  # (stream, verify forward) pairs that carried a proposal

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a stream gets per verify forward it took part in with a proposal."""
        return self.emitted_tokens / self.streams_verified if self.streams_verified else 0.0


class Speculator:
    """Decides each stream's proposal for a decode step and keeps the adaptive rule and the stats.

    The adaptive rule weighs a proposed token's chance against its cost. The j-th token of a stream's
    proposal stands with chance ``p**j`` (``p``: the stream's acceptance estimate) and costs one row of the
    verify forward; a step of ``B`` streams makes ``B`` tokens for ``a + b * B`` seconds. So the j-th token
    pays while ``p**j / b > B / (a + b * B)``, i.e. ``p**j`` exceeds the step's row share (``StepCost``):
    small when weights dominate a step (batch 1, memory-bound devices), large when rows do (big batches
    on a compute-bound CPU). A stream proposes at least one token while it is not resting; one none of
    whose tokens pays rests (``PROBE_PAUSE_STEPS``), and ``trim`` then keeps what pays for the step as a
    whole. Misses need no rule of their own: they lower the stream's acceptance, and with it what pays."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        # The draft proposer needs the engine's model: the engine sets it (``DraftProposer``).
        self.proposer: Proposer = NgramProposer(config)
        self.stats = SpeculationStats()
        self.step_cost = StepCost()
        self._row_share = DEFAULT_ROW_SHARE  # of the step being planned (``plan``)
        # The proposer's seconds per proposed token (decayed): a draft model's forward steps; next to
        # nothing for prompt lookup.
        self._propose_seconds = 0.0
        self._propose_share = 0.0  # that, per token, as a share of a token's worth (``plan``)

    def plan(self, streams: int) -> None:
        """A decode step of ``streams`` streams is about to be proposed for."""
        self._row_share = self.step_cost.row_share(streams)
        step = self.step_cost.seconds(streams)
        self._propose_share = self._propose_seconds * streams / step if step else 0.0

    def observe_step(self, rows: int, seconds: float) -> None:
        """A decode step (verifying or not) of ``rows`` rows took ``seconds``."""
        self.step_cost.observe(rows, seconds)

    def limit(self, seq: Sequence, room: int) -> int:
        """The most ``seq`` proposes for the next step: what pays at its acceptance, at most k and at most
        ``room`` (what its budget and context allow after the one token the step makes anyway); 0 while
        it rests."""
        st = _state(seq)
        if st.pause:
            st.pause -= 1
            return 0
        k = self.config.num_speculative_tokens
        if self.config.adaptive:
            # A token pays when its chance exceeds what its row and its own proposing cost.
            p, share, n = st.acceptance, self._row_share + self._propose_share, 0
            chance = p
            while n < k and chance > share:
                n += 1
                chance *= p
            if n == 0 and not st.probing:
                # Not even its first token pays: rest, then try one (its estimate would never move else).
                st.pause, st.probing = PROBE_PAUSE_STEPS, True
                return 0
            st.probing = False
            k = max(n, 1)
        return max(min(k, room), 0)

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        began = time.perf_counter()
        proposals = self.proposer.propose(seqs, limits)
        made = sum(map(len, proposals))
        if made:
            self.observe_proposing(made, time.perf_counter() - began)
        return self.trim(seqs, proposals)

    def observe_proposing(self, tokens: int, seconds: float) -> None:
        """The proposer made ``tokens`` tokens in ``seconds``."""
        d = ACCEPTANCE_DECAY
        self._propose_seconds = self._propose_seconds * d + seconds / tokens * (1 - d)

    def trim(self, seqs: list[Sequence], proposals: list[list[int]]) -> list[list[int]]:
        """The proposed tokens that pay together (adaptive rule): the ``R`` likeliest of them (the j-th of a
        stream's standing with chance ``p**j``), for the ``R`` that most exceeds what the ``R`` rows add
        to the step, each expected token worth a plain step's seconds per token (``StepCost.seconds``).
        Where one row past a tile costs a tile, a lone likely token may not pay while a tile of them
        does; before the step cost is known, nothing is trimmed."""
        if not self.config.adaptive:
            return proposals
        streams = len(seqs)
        cost = self.step_cost
        base = cost.seconds(streams)
        if base is None or base <= 0:
            return proposals
        worth = base / streams
        chances: list[tuple[float, int]] = []  # (chance, stream), each stream's in its proposal's order
        for i, (seq, prop) in enumerate(zip(seqs, proposals, strict=True)):
            p = _state(seq).acceptance
            chances += [(p ** (j + 1), i) for j in range(len(prop))]
        chances.sort(key=lambda c: -c[0])  # stable: a stream's tokens stay in order (p < 1)
        best, best_gain, expected = 0, 0.0, 0.0
        for r, (chance, _) in enumerate(chances, 1):
            expected += chance * worth
            step = cost.seconds(streams + r)
            gain = expected - ((step if step is not None else base) - base)
            if gain > best_gain:
                best, best_gain = r, gain
        keep = [0] * streams
        for _, i in chances[:best]:
            keep[i] += 1
        return [prop[:n] for prop, n in zip(proposals, keep, strict=True)]

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """A verify forward checked ``proposed`` tokens of ``seq`` and accepted the first ``accepted``."""
        s = self.stats
        s.proposed_tokens += proposed
        s.accepted_tokens += accepted
        s.emitted_tokens += accepted + 1
        s.streams_verified += 1
        if not self.config.adaptive:
            return
        st = _state(seq)
        st.accepted = st.accepted * ACCEPTANCE_DECAY + accepted
        st.rejected = st.rejected * ACCEPTANCE_DECAY + (accepted < proposed)


def accepted_prefix(proposal: list[int], samples: list[int]) -> int:
    """How many proposed tokens stand: the longest run of ``proposal`` equal to the target's samples at the
    same positions (``samples`` has one more entry, the sample after the last proposal)."""
    n = 0
    for guess, sample in zip(proposal, samples, strict=False):
        if guess != sample:
            break
        n += 1
    return n


def speculative_config_from_dict(options: dict) -> SpeculativeConfig:
    """A ``SpeculativeConfig`` from vLLM-style options; ValueError naming an unknown one."""
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown speculative_config option(s) {unknown}; known: {sorted(known)}")
    return SpeculativeConfig(**options)
