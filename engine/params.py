"""Sampling parameters of one request (vLLM names and defaults) and request validation.

Pure Python: imports no torch, so the router validates requests with the same
rules the engine applies. Every check raises ``ValueError`` naming the field.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from pdserve.engine.structured import StructuredOutputsParams, check_compiles

# Below this temperature a request is greedy (vLLM's _SAMPLING_EPS): dividing
# logits by a tiny temperature would only amplify float noise.
GREEDY_EPS = 1e-5

# Bounds of the penalties and biases (OpenAI's for presence, frequency and logit_bias values); a request's
# logit_bias holds at most this many tokens.
MAX_ABS_PENALTY = 2.0
MAX_ABS_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_TOKENS = 300
# The most alternatives ``logprobs`` and ``prompt_logprobs`` may ask for (OpenAI's bound on top_logprobs).
MAX_LOGPROBS = 20

# Choices one request may sample (``n``); all of them must also fit the KV cache together
# (``Scheduler.check_fits``).
MAX_N = 128
_SEED_MOD = 1 << 64


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Lists are accepted and stored as tuples.

    ``temperature`` 0 means greedy; ``top_k`` -1 means off; ``seed`` makes the
    draw for output token ``i`` depend only on ``(seed, i)``, whatever else is
    in the batch and whichever worker samples it.

    Penalties and biases, as vLLM defines them (0, 0, 1 and none: off): ``presence_penalty`` and
    ``frequency_penalty`` in [-2, 2] subtract ``presence * (count > 0) + frequency * count`` from each
    token's logit, ``count`` its occurrences among the OUTPUT tokens; ``repetition_penalty`` > 0 divides
    the positive logits (multiplies the negative ones) of every token seen in the prompt or the outputs;
    ``logit_bias`` maps token ids to a value in [-100, 100] added to their logits. It is given as a
    mapping (or (id, bias) pairs) and stored as (id, bias) pairs sorted by id.

    ``n`` (vLLM's and OpenAI's): the request samples that many choices from one prompt, computed once
    and shared; choice ``i`` samples as a request of its own with ``choice_params(params, i)`` would.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Log-probabilities under the model's raw logits (``engine.logprobs``), vLLM's names: ``logprobs`` for
    # each generated token, ``prompt_logprobs`` for each prompt token given its prefix; the value is how
    # many of the most likely alternatives come with each (0: the token's own alone). None: none computed.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # The output matches this grammar (``engine.structured``; enforced by the sampler's token masks).
    structured_outputs: StructuredOutputsParams | None = None
    n: int = 1
    # False: this request is never speculated on a worker that speculates (``engine.speculative``); its
    # output is the same either way.
    speculative: bool = True

    def __post_init__(self) -> None:
        # Normalise before checking: a bare string is one stop string, not characters.
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if stop is None:
            stop = ()
        if not isinstance(stop, Sequence) or not all(isinstance(s, str) for s in stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, Sequence) or not all(_is_int(t) for t in ids):
            raise ValueError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or an integer >= 1, got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be a bool, got {self.speculative!r}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop must not contain an empty string")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {self.stop_token_ids!r}")
        self._check_penalties()
        _check_logprobs(self)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsParams, got "
                f"{type(self.structured_outputs).__name__}"
            )
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -MAX_ABS_PENALTY <= v <= MAX_ABS_PENALTY:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        if not _is_real(r) or not math.isfinite(r) or r <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {r!r}")
        object.__setattr__(self, "logit_bias", _logit_bias_pairs(self.logit_bias))

    @functools.cached_property
    def adjusts_logits(self) -> bool:
        """The sampler changes this request's logits before it samples: a penalty or a logit_bias."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
            or bool(self.logit_bias)
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @functools.cached_property
    def argmax_only(self) -> bool:
        """Every token is the argmax of the logits (greedy, or top_k 1: ties to the first index), with no
        min_tokens masking, no penalty or bias and no grammar: what the sampler's fast path checks for every
        sequence every step."""
        return (
            (self.greedy or self.top_k == 1)
            and self.min_tokens == 0
            and not self.adjusts_logits
            and self.structured_outputs is None
        )


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request seeded with ``seed``: ``(seed + index) mod 2**64``, as
    vLLM derives it. Choice 0 keeps the request's seed, so ``n`` = 1 samples as before, and choice ``i``
    samples what a request of its own with that seed samples. Without a seed the choices are independent
    draws."""
    return None if seed is None else (seed + index) % _SEED_MOD


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The parameters choice ``index`` of an ``n`` > 1 request samples with: one choice, its own seed."""
    if params.n == 1 and index == 0:
        return params
    return dataclasses.replace(params, n=1, seed=choice_seed(params.seed, index))


def _logit_bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as (id, bias) pairs sorted by id; ValueError naming the field."""
    if bias is None:
        return ()
    if isinstance(bias, Mapping):
        items: Iterable[object] = bias.items()
    elif isinstance(bias, Sequence) and not isinstance(bias, str | bytes):
        items = bias
    else:
        raise ValueError(f"logit_bias must be a mapping of token ids to biases, got {bias!r}")
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise ValueError(f"logit_bias has {len(bias)} tokens; at most {MAX_LOGIT_BIAS_TOKENS}")
    pairs: dict[int, float] = {}
    for item in items:
        if not (isinstance(item, Sequence) and len(item) == 2):
            raise ValueError(f"logit_bias must map token ids to biases, got the item {item!r}")
        t, v = item
        if not _is_int(t) or t < 0:
            raise ValueError(f"logit_bias has the key {t!r}; keys must be token ids (integers >= 0)")
        if not _is_real(v) or not -MAX_ABS_LOGIT_BIAS <= v <= MAX_ABS_LOGIT_BIAS:
            raise ValueError(f"logit_bias of token {t} must be in [-100, 100], got {v!r}")
        if t in pairs:
            raise ValueError(f"logit_bias has token id {t} twice")
        pairs[t] = float(v)
    return tuple(sorted(pairs.items()))


def _check_logprobs(params: SamplingParams) -> None:
    for name in ("logprobs", "prompt_logprobs"):
        v = getattr(params, name)
        if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
            raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {v!r}")


def check_prompt_length(tokens: int, max_model_len: int, name: str = "prompt", what: str = "") -> None:
    """ValueError when a prompt of ``tokens`` tokens (``what``: how that is known, when it is a bound)
    leaves no room to generate."""
    if tokens >= max_model_len:
        raise ValueError(
            f"{name} has {what or tokens} tokens; the model's context is {max_model_len} tokens "
            f"and at least one must be left to generate"
        )


def validate_prompt_token_ids(
    token_ids: Sequence[int], *, vocab_size: int, max_model_len: int, name: str = "prompt"
) -> None:
    """Empty prompts, ids outside the vocabulary and prompts that leave no room to generate are errors."""
    if len(token_ids) == 0:
        raise ValueError(f"{name} is empty")
    check_prompt_length(len(token_ids), max_model_len, name)
    # A list of plain ints (every prompt the engine sees) is checked by C-level builtins, far cheaper than
    # the loop below on long prompts. Anything else, or a bad id, goes through the loop, which names it.
    if set(map(type, token_ids)) == {int} and min(token_ids) >= 0 and max(token_ids) < vocab_size:
        return
    for t in token_ids:
        if not _is_int(t) or not 0 <= t < vocab_size:
            raise ValueError(f"{name} has token id {t!r} outside the vocabulary [0, {vocab_size})")


def validate_params_for_model(params: SamplingParams, *, vocab_size: int, can_detokenize: bool) -> None:
    """Checks that need the model: stop and logit_bias ids inside the vocabulary, stop strings need a
    tokenizer."""
    if params.top_k > vocab_size:
        # Refused, not clipped: a top_k above the vocabulary is a client's mistake worth hearing about.
        raise ValueError(f"top_k must be at most the vocabulary size {vocab_size}, got {params.top_k}")
    for t in params.stop_token_ids:
        if t >= vocab_size:
            raise ValueError(f"stop_token_ids has id {t} outside the vocabulary [0, {vocab_size})")
    if params.logit_bias and params.logit_bias[-1][0] >= vocab_size:  # (sorted: the largest id is last)
        raise ValueError(
            f"logit_bias has token id {params.logit_bias[-1][0]} outside the vocabulary [0, {vocab_size})"
        )
    if params.stop and not can_detokenize:
        raise ValueError(
            "stop strings need a tokenizer (this model directory has none, or detokenize is off)"
        )
    if params.structured_outputs is not None:
        check_compiles(params.structured_outputs)
