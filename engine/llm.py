"""The offline API, in the shape users know from vLLM.

from pdserve.engine import LLM, SamplingParams
llm = LLM("smollm2-135m-instruct", dtype="float32")
outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0, max_tokens=32))
"""

from __future__ import annotations

import collections
import itertools
import sys
from collections.abc import Iterator, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.engine.llm_engine import EngineConfig, LLMEngine, RequestOutputDelta, engine_config_fields
from pdserve.engine.logprobs import TokenLogprob
from pdserve.engine.params import SamplingParams
from pdserve.engine.registry import DEFAULT_MODEL, resolve_model
from pdserve.engine.tokenizer import Tokenizer

Prompt = str | Seq[int]
Messages = Seq[Mapping[str, str]]


@dataclass
class CompletionOutput:
    """One choice of a request (vLLM's name): ``index`` in [0, n)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None  # ``SamplingParams.logprobs``: one per output token


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None  # the text prompt, None for token-id prompts
    prompt_token_ids: list[int]
    token_ids: list[int]  # choice 0's (as its text and finish_reason)
    text: str  # "" when the model has no tokenizer
    finish_reason: str  # "stop" | "length"
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    # ``SamplingParams.logprobs``: one per output token; ``prompt_logprobs``: one per prompt token, the first
    # None (vLLM's shapes). None: not asked for. ``logprobs`` is choice 0's (each choice has its own).
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Every choice (``SamplingParams.n``), in index order; the first is the fields above.
    outputs: list[CompletionOutput] = field(default_factory=list)


class LLM:
    """An engine for offline generation. ``dtype="auto"`` runs bfloat16 on CUDA and on CPUs with native
    bf16 dot products, float32 elsewhere; ``device`` is ``cpu``, ``cuda`` or ``cuda:N``, and on a GPU
    ``gpu_memory_utilization`` bounds the memory the engine takes. ``llm.engine.device`` and
    ``llm.engine.dtype`` say what it picked. ``enable_prefix_caching`` (default True) reuses the K/V of
    full blocks prompts share; ``RequestOutput.num_cached_tokens`` counts the prompt tokens it saved."""

    def __init__(
        self,
        model: str | Path = DEFAULT_MODEL,
        *,
        dtype: str = "auto",
        device: str = "cpu",
        cache_dir: str | Path | None = None,
        **engine_options: Any,
    ) -> None:
        unknown = sorted(set(engine_options) - engine_config_fields())
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(engine_config_fields())}")
        config = EngineConfig(dtype=dtype, device=device, **engine_options)
        path = resolve_model(str(model), cache_dir)
        try:
            tokenizer: Tokenizer | None = Tokenizer.from_dir(path)
        except FileNotFoundError:
            tokenizer = None  # token-id prompts still work
        self.model_dir = path
        self.engine = LLMEngine(path, tokenizer, config)
        self._ids = itertools.count()
        # Where each open request's deltas go, by request id: a stream's queue of deltas not yet handed
        # out, or a generate call's collector. Whoever steps the engine (a stream's iterator, a generate
        # call) hands every request's deltas here, so streams and generate calls open at once each get
        # all of their own.
        self._inbox: dict[str, collections.deque[RequestOutputDelta] | _Collector] = {}

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    # -- public API ------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs in prompt order. Every prompt and parameter
        set is validated before any work; then all run at once, continuously batched."""
        items = _as_prompt_list(prompts)
        plist = self._params_list(params, len(items))
        encoded = [self._encode(p, i) for i, p in enumerate(items)]
        for i, (ids, sp) in enumerate(zip(encoded, plist, strict=True)):
            try:
                self._validate(ids, sp)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        texts = [p if isinstance(p, str) else None for p in items]
        return self._run(texts, encoded, plist, use_tqdm)

    def chat(
        self,
        messages: Messages | Seq[Messages],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate a reply to each conversation (one list of messages, or a list of them)."""
        convs = [messages] if _is_conversation(messages) else list(messages)  # type: ignore[list-item]
        return self.generate(
            [self.encode_chat(c, add_generation_prompt) for c in convs],  # type: ignore[arg-type]
            params,
            use_tqdm,
        )

    def encode_chat(self, messages: Messages, add_generation_prompt: bool = True) -> list[int]:
        """Prompt token ids for a conversation, via the model's chat template."""
        if self.tokenizer is None:
            raise ValueError(f"chat needs a tokenizer and {self.model_dir} has none")
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutputDelta]:
        """Deltas of one request as they are produced (with ``n`` > 1, every choice's, each carrying its
        ``choice_index``). Closing the iterator early aborts the request."""
        ids = self._encode(prompt, 0)
        params = SamplingParams() if params is None else params
        self._validate(ids, params)
        rid = str(next(self._ids))
        inbox = self._inbox[rid] = collections.deque()
        self.engine.add_request(rid, ids, params)
        open_choices = params.n
        try:
            while True:
                while inbox:
                    d = inbox.popleft()
                    yield d
                    if d.finish_reason is not None:
                        open_choices -= 1
                        if not open_choices:
                            return
                if not self.engine.has_request(rid):  # ended without a last delta (aborted)
                    return
                self._step()
        finally:
            self._inbox.pop(rid, None)
            self.engine.abort(rid)

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        self.engine.validate_request(ids, params)
        if params.stop and not self.engine.config.detokenize:
            # The engine leaves stop strings to its caller when it does not detokenize; this is the caller,
            # and it has no text to look in.
            raise ValueError("stop strings need text: this LLM was made with detokenize=False")

    def _step(self) -> None:
        """One engine step; each delta goes to the inbox of its request (dropped: a request not started
        by this LLM's API, e.g. added to ``engine`` directly)."""
        ran = self.engine.num_steps
        deltas = self.engine.step()
        if self.engine.num_steps == ran:  # cannot happen for requests that passed validation
            raise RuntimeError(f"engine stalled with {len(self._inbox)} requests open")
        for d in deltas:
            box = self._inbox.get(d.request_id)  # type: ignore[call-overload]
            if box is not None:
                box.append(d)

    # -- internals -------------------------------------------------------------
    def _encode(self, prompt: Prompt, index: int) -> list[int]:
        if not isinstance(prompt, str | Seq):
            raise ValueError(
                f"prompt {index} must be text or a list of token ids, got {type(prompt).__name__}"
            )
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise ValueError(f"prompt {index} is text but {self.model_dir} has no tokenizer; pass token ids")
        if not prompt:
            raise ValueError(f"prompt {index}: prompt is empty")
        return self.tokenizer.encode(prompt)

    @staticmethod
    def _params_list(params: SamplingParams | Seq[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        if not isinstance(params, Seq):  # (a dict of fields, say: its keys would be named, not it)
            raise ValueError(
                f"params must be a SamplingParams or a list of them, got {type(params).__name__}"
            )
        plist = list(params)
        if len(plist) != n:
            raise ValueError(f"got {len(plist)} SamplingParams for {n} prompts")
        for i, p in enumerate(plist):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"params {i} must be a SamplingParams, got {type(p).__name__}")
        return plist

    def _run(
        self, texts: list[str | None], encoded: list[list[int]], plist: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        engine = self.engine
        bar = _progress(len(encoded), use_tqdm)
        sinks: list[_Collector] = []
        open_: set[str] = set()
        try:
            for text, ids, sp in zip(texts, encoded, plist, strict=True):
                rid = str(next(self._ids))
                sink = _Collector(RequestOutput(rid, text, ids, [], "", ""), sp.n, open_, bar)
                self._inbox[rid] = sink  # whoever steps the engine hands this request's deltas to it
                sinks.append(sink)
                open_.add(rid)
                engine.add_request(rid, ids, sp)
            while open_:
                # Ours still open beyond what the engine runs: one may have ended without a last delta.
                if len(open_) > engine.scheduler.num_unfinished:
                    for rid in open_:
                        if not engine.has_request(rid):
                            raise RuntimeError(f"request {rid} ended without finishing")
                self._step()
        finally:
            if bar is not None:
                bar.close()
            for sink in sinks:  # an interrupted call leaves nothing behind
                rid = sink.out.request_id
                self._inbox.pop(rid, None)
                engine.abort(rid)
        return [sink.result() for sink in sinks]


class _Collector:
    """Where the deltas of one ``generate`` request go as steps produce them: its choices, built up."""

    __slots__ = ("bar", "open", "out", "choices", "pieces", "left")

    def __init__(self, out: RequestOutput, n: int, open_: set[str], bar: Any) -> None:
        self.out, self.open, self.bar = out, open_, bar
        self.choices = [CompletionOutput(i, "", [], "") for i in range(n)]
        # Each choice's text as pieces, joined at the end: ``text += piece`` copies the text so far.
        self.pieces: list[list[str]] = [[] for _ in range(n)]
        self.left = n  # choices not finished

    def append(self, d: RequestOutputDelta) -> None:
        choice = self.choices[d.choice_index]
        choice.token_ids += d.new_token_ids
        if d.logprobs is not None:
            if choice.logprobs is None:
                choice.logprobs = []
            choice.logprobs += d.logprobs
        if d.prompt_logprobs is not None:
            self.out.prompt_logprobs = list(d.prompt_logprobs)
        if d.new_text:
            self.pieces[d.choice_index].append(d.new_text)
        if d.finish_reason is not None:
            choice.finish_reason = d.finish_reason
            self.out.num_cached_tokens = max(self.out.num_cached_tokens, d.num_cached_tokens)
            self.left -= 1
            if not self.left:
                self.open.discard(self.out.request_id)
                if self.bar is not None:
                    self.bar.update(1)

    def result(self) -> RequestOutput:
        out = self.out
        for choice, pieces in zip(self.choices, self.pieces, strict=True):
            choice.text = "".join(pieces)
        first = self.choices[0]
        out.token_ids, out.text, out.finish_reason = first.token_ids, first.text, first.finish_reason
        out.logprobs = first.logprobs
        out.outputs = self.choices
        return out


def _is_conversation(messages: object) -> bool:
    return isinstance(messages, Seq) and len(messages) > 0 and isinstance(messages[0], Mapping)


def _as_prompt_list(prompts: object) -> list[Prompt]:
    """One prompt (a string or a list of ints) or a list of them -> a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Seq):
        raise ValueError(
            f"prompts must be a string, a list of token ids, or a list of those; got {prompts!r}"
        )
    if len(prompts) > 0 and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [list(prompts)]
    return list(prompts)


def _progress(total: int, use_tqdm: bool) -> Any:
    if not use_tqdm or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="Generating", unit="req", dynamic_ncols=True)
