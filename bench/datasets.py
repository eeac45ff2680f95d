"""Benchmark workloads: the prompts and output lengths a run sends (pure: numpy only).

``random``: token-id prompts with vLLM's ``range_ratio`` and random prefix; ``shared-prefix``: the same over
``num_prefix_groups`` prefixes, so a prefix cache shows; ``multi-turn``: conversations that resend their
history, each turn's prompt the previous one's plus a stand-in answer and a new user message; ``jsonl``: a
file's prompts or chat messages. Every draw comes from the generator passed in, so one seed gives one request
stream.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


class DatasetName(enum.StrEnum):
    RANDOM = "random"
    SHARED_PREFIX = "shared-prefix"
    MULTI_TURN = "multi-turn"
    JSONL = "jsonl"


@dataclass(frozen=True)
class TokenSpace:
    """The token ids a random prompt may use: ``[0, vocab_size)`` minus the special ones."""

    vocab_size: int
    excluded_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if self.vocab_size <= len(self.excluded_ids & frozenset(range(self.vocab_size))):
            raise ValueError(f"no token ids left: vocab_size {self.vocab_size}, all excluded")

    def allowed(self) -> np.ndarray:
        ids = np.arange(self.vocab_size, dtype=np.int64)
        if not self.excluded_ids:
            return ids
        return ids[~np.isin(ids, np.fromiter(self.excluded_ids, dtype=np.int64))]


@dataclass(frozen=True)
class WorkloadConfig:
    dataset: DatasetName = DatasetName.RANDOM
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 0
    num_prefix_groups: int = 8  # shared-prefix only
    turns: int = 4  # multi-turn only: requests per conversation (the request count sets how many)
    dataset_path: Path | None = None  # jsonl only
    ignore_eos: bool = False  # jsonl only: the synthetic workloads always ignore EOS

    def __post_init__(self) -> None:
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError(
                f"input_len and output_len must be >= 1, got {self.input_len}, {self.output_len}"
            )
        if self.prefix_len < 0:
            raise ValueError(f"prefix_len must be >= 0, got {self.prefix_len}")
        if self.dataset == DatasetName.SHARED_PREFIX:
            if self.prefix_len < 1:
                raise ValueError("the shared-prefix workload needs prefix_len >= 1")
            if self.num_prefix_groups < 1:
                raise ValueError(f"num_prefix_groups must be >= 1, got {self.num_prefix_groups}")
        if self.turns < 1:
            raise ValueError(f"turns must be >= 1, got {self.turns}")
        if (self.dataset == DatasetName.JSONL) != (self.dataset_path is not None):
            raise ValueError("dataset_path is required by the jsonl workload and only used by it")


@dataclass(frozen=True)
class SampleRequest:
    """One request of the stream. Exactly one of the three inputs is set."""

    prompt_token_ids: tuple[int, ...] | None = None
    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content)
    prompt_len: int | None = None  # known client side for token-id prompts; else the server's usage says
    output_len: int | None = None  # sent as max_tokens
    ignore_eos: bool = False
    group: int | None = None  # the shared prefix's group
    # multi-turn: the conversation and the request's turn in it (0 first); a turn is sent once the one
    # before it finished.
    conversation: int | None = None
    turn: int | None = None


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive bounds lengths are drawn from; the low end is at least 1."""
    low = max(1, math.floor(length * (1.0 - range_ratio)))
    high = max(low, math.ceil(length * (1.0 + range_ratio)))
    return low, high


def sample_requests(
    config: WorkloadConfig, n: int, rng: np.random.Generator, token_space: TokenSpace | None = None
) -> list[SampleRequest]:
    """``n`` requests of the configured workload. ``token_space`` is required by the synthetic ones."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if config.dataset == DatasetName.JSONL:
        assert config.dataset_path is not None  # checked by WorkloadConfig
        return sample_jsonl(
            load_jsonl(config.dataset_path), n, rng, config.output_len, ignore_eos=config.ignore_eos
        )
    if token_space is None:
        raise ValueError(f"the {config.dataset} workload needs the model's token space (vocab size)")
    if config.dataset == DatasetName.MULTI_TURN:
        return sample_multi_turn(config, n, rng, token_space)
    groups = config.num_prefix_groups if config.dataset == DatasetName.SHARED_PREFIX else 1
    return sample_random(config, n, rng, token_space, groups)


def sample_random(
    config: WorkloadConfig, n: int, rng: np.random.Generator, token_space: TokenSpace, groups: int
) -> list[SampleRequest]:
    """Token ids, so lengths are exact (no decode/re-encode drift), and ``ignore_eos`` with ``max_tokens``
    the output length, so those are exact too; one random prefix per group."""
    allowed = token_space.allowed()
    prefixes = [allowed[rng.integers(0, len(allowed), size=config.prefix_len)] for _ in range(groups)]
    in_low, in_high = length_range(config.input_len, config.range_ratio)
    out_low, out_high = length_range(config.output_len, config.range_ratio)
    input_lens = rng.integers(in_low, in_high + 1, size=n)
    output_lens = rng.integers(out_low, out_high + 1, size=n)
    # Even spread over the groups, in a random order.
    group_of = rng.permutation(np.arange(n) % groups)
    out = []
    for i in range(n):
        suffix = allowed[rng.integers(0, len(allowed), size=int(input_lens[i]))]
        ids = tuple(int(t) for t in np.concatenate((prefixes[group_of[i]], suffix)))
        out.append(
            SampleRequest(
                prompt_token_ids=ids,
                prompt_len=len(ids),
                output_len=int(output_lens[i]),
                ignore_eos=True,
                group=int(group_of[i]) if groups > 1 else None,
            )
        )
    return out


def sample_multi_turn(
    config: WorkloadConfig, n: int, rng: np.random.Generator, token_space: TokenSpace
) -> list[SampleRequest]:
    """``n`` requests of conversations of ``config.turns`` turns, conversation by conversation (the last one
    cut short when ``n`` is not a multiple). Turn 0's prompt: a ``prefix_len`` prefix all conversations
    share, then a user message of ``input_len`` tokens (``range_ratio`` applies); turn k's: turn k-1's
    prompt, a stand-in for its answer (random tokens, as many as turn k-1 asked for: ``ignore_eos`` makes
    the real answer that long), then a new user message."""
    allowed = token_space.allowed()

    def tokens(k: int) -> np.ndarray:
        return allowed[rng.integers(0, len(allowed), size=k)]

    prefix = tokens(config.prefix_len)
    in_low, in_high = length_range(config.input_len, config.range_ratio)
    out_low, out_high = length_range(config.output_len, config.range_ratio)
    out: list[SampleRequest] = []
    conversation = 0
    while len(out) < n:
        history = prefix
        previous_output = 0
        for turn in range(min(config.turns, n - len(out))):
            answer = tokens(previous_output)
            user = tokens(int(rng.integers(in_low, in_high + 1)))
            history = np.concatenate((history, answer, user))
            previous_output = int(rng.integers(out_low, out_high + 1))
            ids = tuple(int(t) for t in history)
            out.append(
                SampleRequest(
                    prompt_token_ids=ids,
                    prompt_len=len(ids),
                    output_len=previous_output,
                    ignore_eos=True,
                    conversation=conversation,
                    turn=turn,
                )
            )
        conversation += 1
    return out


def sample_jsonl(
    entries: Sequence[SampleRequest],
    n: int,
    rng: np.random.Generator,
    default_output_len: int,
    *,
    ignore_eos: bool,
) -> list[SampleRequest]:
    """``n`` entries in a seeded shuffled order, cycling when the file holds fewer."""
    if not entries and n:
        raise ValueError("the dataset holds no requests")
    order: list[int] = []
    while len(order) < n:
        order.extend(int(i) for i in rng.permutation(len(entries)))
    out = []
    for i in order[:n]:
        e = entries[i]
        out.append(
            SampleRequest(
                prompt=e.prompt,
                messages=e.messages,
                output_len=e.output_len if e.output_len is not None else default_output_len,
                ignore_eos=ignore_eos,
            )
        )
    return out


def load_jsonl(path: Path) -> list[SampleRequest]:
    """Parse a JSONL workload file; ValueError naming the file and line for a bad entry."""
    entries = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                entries.append(parse_entry(json.loads(line)))
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: {e}") from None
    return entries


def parse_entry(obj: Any) -> SampleRequest:
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    output_len = obj.get("output_len")
    if output_len is not None and (isinstance(output_len, bool) or not isinstance(output_len, int)):
        raise ValueError(f"output_len must be an integer, got {output_len!r}")
    if output_len is not None and output_len < 1:
        raise ValueError(f"output_len must be >= 1, got {output_len}")
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        raise ValueError('each line needs exactly one of "prompt" or "messages"')
    if has_prompt:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise ValueError("prompt must be a non-empty string")
        return SampleRequest(prompt=obj["prompt"], output_len=output_len)
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    pairs = []
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f'each message needs string "role" and "content", got {m!r}')
        pairs.append((m["role"], m["content"]))
    return SampleRequest(messages=tuple(pairs), output_len=output_len)
