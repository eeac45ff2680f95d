"""LLMEngine: scheduler + model runner + sampler + detokenizer, one ``step()`` at a time.

A decode worker's ``add_prefilled_request`` adopts blocks its KV receiver filled under the request id (the
hand-over is the contract in ``kv_transfer/__init__.py``). Not thread-safe: one thread drives ``add_*``,
``abort`` and ``step``. Prefix caching (on by default) reuses the K/V of full blocks a prompt shares with
earlier sequences; ``cache_salt`` names what those blocks' hashes depend on. An ``n`` > 1 request computes
its prompt once and forks its choices from it (``engine.choices``); each choice's deltas carry its
``choice_index``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.choices import child_ids, fork_row_ids, fork_rows, split_first_tokens
from pdserve.engine.device import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    check_device,
    check_dtype,
    check_gpu_memory_utilization,
    resolve_device,
    resolve_dtype,
)
from pdserve.engine.grammar import ConstrainedSequences, GrammarCompiler
from pdserve.engine.logprob_requests import LogprobRequests
from pdserve.engine.logprobs import TokenLogprob, token_logprobs
from pdserve.engine.model_runner import Backend, DecodeItem, ModelRunner, PrefillItem, build_runner
from pdserve.engine.params import SamplingParams, validate_params_for_model, validate_prompt_token_ids
from pdserve.engine.prefix_hash import model_cache_salt
from pdserve.engine.quant import check_quantization
from pdserve.engine.sampler import SampleRow
from pdserve.engine.scheduler import Batch, BatchKind, Scheduler, SchedulerConfig
from pdserve.engine.sequence import FinishReason
from pdserve.engine.sequence import Sequence as EngineSequence
from pdserve.engine.speculative import (
    DraftProposer,
    SpeculativeConfig,
    SpeculativeMethod,
    Speculator,
    accepted_prefix,
    speculative_config_from_dict,
)
from pdserve.engine.stopping import StopStringMatcher

if TYPE_CHECKING:
    from concurrent.futures import Future

    from pdserve.engine.grammar import TokenMask
    from pdserve.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 64  # sequences per decode batch
    max_num_batched_tokens: int = 2048  # tokens per step (a decode counts one); longer prompts are chunked
    # True: one step decodes the running sequences and prefills waiting prompts in what is left of the
    # budget (``engine.scheduler``). False (the default: mixed steps are slower on CPU): a step either
    # prefills or decodes, prefill first.
    mixed_steps: bool = False
    block_size: int = 16
    num_blocks: int | None = (
        None  # KV blocks; or size the cache by kv_cache_bytes; neither: the runner decides
    )
    kv_cache_bytes: int | None = None
    # As asked: "auto" (bfloat16 on CUDA and on CPUs with native bf16 dot products, float32 elsewhere),
    # "float32", "bfloat16" or "float16". What the engine runs in is ``resolved_dtype``.
    dtype: str = "auto"
    # "none" or "int8": weight-only int8 with a scale per row and 64 inputs (``engine.quant``);
    # activations, KV cache and sums stay in dtype / float32.
    quantization: str = "none"
    device: str = "cpu"  # cpu | cuda | cuda:N as asked; ``resolved_device`` is the one it runs on (cuda:N)
    # Share of the GPU's memory the engine may use (weights, activations and the KV cache), as vLLM
    # means it; sizes the cache when neither num_blocks nor kv_cache_bytes is given. Ignored on CPU.
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    threads: int | None = None  # torch.set_num_threads when given
    max_model_len: int | None = None  # cap on the model's context
    seed: int = 0  # the engine-wide generator for unseeded sampling
    detokenize: bool = True  # False: the caller turns tokens into text and applies stop strings
    # CUDA (Triton backend): False captures decode as CUDA graphs at start-up for batch sizes up to
    # max_num_seqs; True runs every step eagerly (vLLM's --enforce-eager). Ignored elsewhere.
    enforce_eager: bool = False
    # CPU: the KV cache in shared memory (``ModelRunner(kv_shared=True)``), which a prefill worker of this
    # host writes with plain copies (a decode worker's ``--kv-shared-memory``). Ignored elsewhere.
    kv_shared_memory: bool = False
    # Reuse the K/V of full blocks a prompt shares with earlier sequences (vLLM's automatic prefix
    # caching): finished sequences' blocks stay cached until their room is needed.
    enable_prefix_caching: bool = True
    # Speculative decoding of decoding streams (``engine.speculative``): a SpeculativeConfig, or the same
    # as a dict (vLLM's ``speculative_config``, e.g. ``{"method": "ngram", "num_speculative_tokens": 4}``);
    # None: off. Output is the same token for token either way.
    speculative_config: SpeculativeConfig | None = None
    # Tensor parallelism (``engine.tensor_parallel``): the model split over this many processes of one
    # host, each caching its own KV heads, with ``threads`` torch threads each (CPU: gloo; CUDA: NCCL,
    # or gloo where ranks share a GPU).
    tensor_parallel_size: int = 1
    # Resolved on this host when the config is made (``engine.device``): the device and dtype the engine
    # runs on, which it reports. A device this host lacks fails here, before anything loads.
    resolved_device: str = dataclasses.field(init=False)
    resolved_dtype: str = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        if isinstance(self.dtype, torch.dtype):
            names = {v: k for k, v in DTYPES.items()}
            object.__setattr__(self, "dtype", names.get(self.dtype, str(self.dtype)))
        check_dtype(self.dtype)
        check_quantization(self.quantization)
        check_device(self.device)
        check_gpu_memory_utilization(self.gpu_memory_utilization)
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}"
            )
        for name in ("num_blocks", "kv_cache_bytes", "threads", "max_model_len"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be None or an integer >= 1, got {v!r}")
        if self.num_blocks is not None and self.kv_cache_bytes is not None:
            raise ValueError("give num_blocks or kv_cache_bytes, not both")
        spec = self.speculative_config
        if isinstance(spec, dict):
            object.__setattr__(self, "speculative_config", speculative_config_from_dict(spec))
        elif spec is not None and not isinstance(spec, SpeculativeConfig):
            raise ValueError(
                f"speculative_config must be a SpeculativeConfig, a dict or None, got {type(spec).__name__}"
            )
        device = resolve_device(self.device)
        object.__setattr__(self, "resolved_device", device)
        object.__setattr__(self, "resolved_dtype", resolve_dtype(self.dtype, device))

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.resolved_dtype]


class RequestOutputDelta(NamedTuple):
    """What one step produced for one request.

    A NamedTuple, not a frozen dataclass: the engine makes one per sequence per step, and a frozen
    dataclass's ``__init__`` costs several times as much."""

    request_id: Hashable
    new_token_ids: tuple[int, ...]
    new_text: str  # "" without a tokenizer, or while a multi-byte character is incomplete
    finish_reason: str | None  # "stop" | "length" on the last delta, else None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache, not computed
    # ``SamplingParams.logprobs``: one per new token (None: not asked, or token 0 of an adopted request,
    # which the prefill worker sampled).
    logprobs: tuple[TokenLogprob, ...] | None = None
    # ``SamplingParams.prompt_logprobs``, on the first delta: one per prompt token, the first None (vLLM's).
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    # Which choice of an ``n`` > 1 request (``request_id`` is the request's). Not ``index``: a tuple's
    # method of that name.
    choice_index: int = 0


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int  # free or holding cached K/V that can be evicted
    num_blocks: int
    num_preemptions: int  # since start
    num_cached_blocks: int = 0  # of the free ones, those holding cached K/V


@dataclass(slots=True)
class _TextState:
    # The sequence's detokenizer (``TextStream.step_int``: a token's text, None while a character is
    # incomplete); None when the engine does not detokenize.
    step: Callable[[int], str | None] | None
    # None without stop strings: a matcher with none passes text through and never holds any back.
    matcher: StopStringMatcher | None


class LLMEngine:
    def __init__(
        self,
        model: str | Path | ModelRunner,
        tokenizer: Tokenizer | None = None,
        config: EngineConfig | None = None,
    ) -> None:
        self.config = config = config or EngineConfig()
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        if isinstance(model, ModelRunner):
            self.runner = model
        else:
            self.runner = self._runner(Path(model), config)
        self.tokenizer = tokenizer
        mc = self.runner.config
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        eos = list(mc.eos_token_ids)
        if tokenizer is not None:
            eos += [t for t in tokenizer.eos_token_ids if t not in eos]
        self.eos_token_ids = tuple(eos)
        # What the K/V of the same tokens depends on: the weights, the dtype, the quantization. Workers
        # report it with their cached block hashes.
        self.cache_salt = model_cache_salt(self.runner.model_dir, self.dtype, self.runner.quantization)
        self.block_manager = BlockManager(
            self.runner.num_blocks, self.runner.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_model_len=self.max_model_len,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                eos_token_ids=self.eos_token_ids,
                mixed_steps=config.mixed_steps,
                cache_salt=self.cache_salt,
            ),
            self.block_manager,
        )
        self.sampler = self.runner.sampler(self.eos_token_ids, seed=config.seed)
        # A verify step decodes each stream's last token and proposals as rows of their own.
        spec_rows = 1 + (config.speculative_config.num_speculative_tokens if config.speculative_config else 0)
        self.runner.prepare_decode(config.max_num_seqs * spec_rows, cuda_graphs=not config.enforce_eager)
        self.runner.prepare_prefill(config.max_num_batched_tokens, cuda_graphs=not config.enforce_eager)
        self._text: dict[Hashable, _TextState] = {}
        # Requests that asked for logprobs (none: every step runs as if logprobs did not exist).
        self._logprobs = LogprobRequests()
        # Structured output: each constrained sequence's grammar matcher (``engine.grammar``).
        self.constrained = ConstrainedSequences(
            GrammarCompiler(tokenizer, self.vocab_size, self.eos_token_ids)
        )
        # Speculative decoding of decoding streams (None: off).
        spec = config.speculative_config
        self.speculator = speculator = Speculator(spec) if spec is not None else None
        if speculator is not None and speculator.config.method is SpeculativeMethod.DRAFT:
            speculator.proposer = DraftProposer(
                _TruncatedTarget(self.runner, self.block_manager, speculator.config.layers_of(mc.num_layers))
            )
        self.num_steps = 0  # batches run since start
        self.last_batch: Batch | None = None  # what the latest step ran (the worker's step metrics)
        log.info(
            "engine: %s on %s in %s (dtype %s asked)%s, %d KV blocks of %d tokens, prefix caching %s",
            self.runner.model_dir.name,
            self.device,
            self.dtype,
            config.dtype,
            "" if config.quantization == "none" else f", {config.quantization} weights",
            self.runner.num_blocks,
            self.runner.block_size,
            "on" if config.enable_prefix_caching else "off",
        )

    @staticmethod
    def _runner(model: Path, config: EngineConfig) -> ModelRunner:
        kwargs: dict[str, Any] = {
            "dtype": config.torch_dtype,
            "device": config.resolved_device,
            "block_size": config.block_size,
            "num_blocks": config.num_blocks,
            "kv_cache_bytes": config.kv_cache_bytes,
            "gpu_memory_utilization": config.gpu_memory_utilization,
            "quantization": config.quantization,
        }
        if config.kv_shared_memory:
            kwargs["kv_shared"] = True
        return build_runner(model, config.tensor_parallel_size, config.threads or 1, **kwargs)

    def close(self) -> None:
        """Stop the tensor-parallel followers (if any); the engine serves nothing after."""
        if self.runner.tp is not None:
            self.runner.tp.close()

    @property
    def device(self) -> str:
        """The device the engine runs on: ``cpu`` or ``cuda:N``."""
        d = self.runner.kv.device
        return d.type if d.index is None else f"{d.type}:{d.index}"

    @property
    def dtype(self) -> str:
        """The dtype the engine runs in (``auto`` resolved): ``float32``, ``bfloat16`` or ``float16``."""
        return str(self.runner.dtype).removeprefix("torch.")

    @property
    def vocab_size(self) -> int:
        return self.runner.config.vocab_size

    @property
    def detokenizes(self) -> bool:
        return self.config.detokenize and self.tokenizer is not None

    # -- requests ------------------------------------------------------------
    def validate_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Every check ``add_request`` makes except the request id; ValueError naming the problem."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        validate_prompt_token_ids(
            prompt_token_ids, vocab_size=self.vocab_size, max_model_len=self.max_model_len
        )
        # Stop strings are the caller's job when the engine does not detokenize on purpose.
        validate_params_for_model(
            params, vocab_size=self.vocab_size, can_detokenize=self.detokenizes or not self.config.detokenize
        )
        self.scheduler.check_fits(len(prompt_token_ids), params)
        self.constrained.check(params)

    def add_request(
        self,
        request_id: Hashable,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        output_offset: int = 0,
    ) -> None:
        """Queue a request. ``output_offset``: it already produced that many output tokens elsewhere (a
        stream migrated off a failed worker), now the tail of ``prompt_token_ids``; ``params`` count what
        is left (max_tokens, min_tokens), and seeded sampling and the reported counts continue from it."""
        params = SamplingParams() if params is None else params
        if not isinstance(output_offset, int) or output_offset < 0 or output_offset > len(prompt_token_ids):
            raise ValueError(f"output_offset must be in [0, len(prompt)], got {output_offset!r}")
        if output_offset and params.n > 1:
            raise ValueError("n must be 1 for a request that continues earlier output (output_offset)")
        self.validate_request(prompt_token_ids, params)
        # A migrated stream's outputs so far are the prompt's tail: its matcher replays them.
        matcher = self.constrained.new(params, prompt_token_ids[len(prompt_token_ids) - output_offset :])
        seq = self.scheduler.add(request_id, list(prompt_token_ids), params)
        seq.output_offset = output_offset
        self._text[request_id] = self._new_text_state(params, prompt_token_ids)
        self._logprobs.add(request_id, params, len(prompt_token_ids))
        self.constrained.add(request_id, matcher)

    def add_migrated_request(
        self,
        request_id: Hashable,
        token_ids: Sequence[int],
        output_offset: int,
        params: SamplingParams | None = None,
    ) -> None:
        """Adopt a decoding stream moved here live (``Scheduler.add_migrated``): ``token_ids`` is its prompt
        and its ``output_offset`` output tokens so far, whose K/V (all but the last token's) fill the blocks
        ``block_manager`` holds under ``request_id``; ``params`` count what is left. Its next token is
        output ``output_offset``, sampled as the worker it came from would have. On ValueError the blocks
        stay with the caller."""
        params = SamplingParams() if params is None else params
        if params.prompt_logprobs is not None:
            raise ValueError("a live-migrated stream has sent its prompt logprobs already")
        self.validate_request(token_ids, params)
        matcher = self.constrained.new(params, token_ids[len(token_ids) - output_offset :])
        seq = self.scheduler.add_migrated(request_id, list(token_ids), output_offset, params)
        self._text[request_id] = self._new_text_state(params, token_ids)
        self._logprobs.add_prefilled(seq.seq_id, params)
        self.constrained.add(request_id, matcher)

    def suspend(self, request_id: Hashable) -> tuple[list[int], int]:
        """Hold a decoding request of one choice out of the batches, its blocks kept, at this step
        boundary (its KV is about to move): its output tokens so far (those it came with included) and the
        tokens whose K/V its blocks hold. ValueError when it is not decoding here."""
        seq = self.scheduler.suspend(request_id)
        outputs = seq.prompt_token_ids[seq.num_prompt_tokens - seq.output_offset :] + seq.output_token_ids
        return outputs, seq.num_computed_tokens

    def pin(self, request_id: Hashable) -> tuple[list[int], int]:
        """A suspended request's blocks are read elsewhere from now until ``unpin``: they stay held even
        if it ends meanwhile. Returns the blocks holding its K/V (token order) and its last token."""
        blocks = self.scheduler.pin(request_id)
        return blocks, self.scheduler.suspended[request_id].last_token_id

    def unpin(self, request_id: Hashable) -> None:
        self.scheduler.unpin(request_id)

    def resume(self, request_id: Hashable) -> bool:
        """Undo ``suspend``: the request decodes here again. False when it is not suspended."""
        return self.scheduler.resume(request_id)

    def add_resumed_choices(
        self,
        request_id: Hashable,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        choices: Sequence[tuple[int, Sequence[int]]],
    ) -> None:
        """Queue the open choices of an ``n`` > 1 request moved off a failed worker: each ``(index, the
        tokens it already output)``; ``params`` are the request's own (each choice counts what is left of
        them), and each choice's seeded sampling and reported counts continue from its tokens."""
        self.validate_request(prompt_token_ids, params)
        for _, earlier in choices:
            validate_prompt_token_ids(
                [*prompt_token_ids, *earlier], vocab_size=self.vocab_size, max_model_len=self.max_model_len
            )
        # Each choice's matcher replays its own outputs so far.
        matchers = [self.constrained.new(params, earlier) for _, earlier in choices]
        seqs = self.scheduler.add_choices(request_id, list(prompt_token_ids), params, choices)
        for seq, matcher in zip(seqs, matchers, strict=True):
            self._text[seq.seq_id] = self._new_text_state(seq.params, seq.prompt_token_ids)
            self._logprobs.add_prefilled(seq.seq_id, params)
            self.constrained.add(seq.seq_id, matcher)

    def add_prefilled_request(
        self,
        request_id: Hashable,
        prompt_token_ids: Sequence[int],
        first_token_id: int,
        params: SamplingParams | None = None,
    ) -> RequestOutputDelta:
        """Adopt a request whose prompt K/V fill the blocks ``block_manager`` holds under ``request_id``.

        ``first_token_id`` is output token 0 (sampled by the prefill worker); it
        passes the same stop checks as any token. Returns its delta: the request
        may already be finished, and then its blocks are already freed. On
        ValueError the blocks stay with the caller.
        """
        return self.add_prefilled_choices(request_id, prompt_token_ids, (first_token_id,), params)[0]

    def add_prefilled_choices(
        self,
        request_id: Hashable,
        prompt_token_ids: Sequence[int],
        first_token_ids: Sequence[int],
        params: SamplingParams | None = None,
    ) -> list[RequestOutputDelta]:
        """``add_prefilled_request`` of a request of ``params.n`` choices: ``first_token_ids`` holds each
        choice's output token 0 (the prefill worker sampled them all from the prompt's one forward), and
        choices 1.. fork from the prompt's blocks. Returns a delta per choice, in choice order."""
        params = SamplingParams() if params is None else params
        self.validate_request(prompt_token_ids, params)
        for t in first_token_ids:
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"first_token_id {t} is outside the vocabulary [0, {self.vocab_size})")
        # The prefill worker sampled each token 0 under the same grammar: each choice's matcher takes it.
        matchers = [self.constrained.new(params) for _ in first_token_ids]
        self._text[request_id] = self._new_text_state(params, prompt_token_ids)
        try:
            seqs = self.scheduler.add_prefilled_choices(
                request_id, list(prompt_token_ids), first_token_ids, params
            )
        except ValueError:
            del self._text[request_id]
            raise
        for seq, matcher in zip(seqs, matchers, strict=True):
            self._logprobs.add_prefilled(seq.seq_id, params)
            self.constrained.add(seq.seq_id, matcher)
        self._forked(seqs)
        if self.constrained:
            self._end_on_grammar(seqs)
        return [self._logprobs.attach(d, {}) for d in self._emit(seqs)]

    def abort(self, request_id: Hashable) -> bool:
        """Stop a request and free its blocks now, reserved ones never adopted included. False when the
        engine knew nothing of it."""
        for sid in {request_id, *(s.seq_id for s in self.scheduler.request_seqs(request_id))}:
            self._text.pop(sid, None)
            self._logprobs.discard(sid)
            self.constrained.drop(sid)
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_request(self, request_id: Hashable) -> bool:
        """Some choice of the request is unfinished."""
        return self.scheduler.has_request(request_id)

    def stats(self) -> EngineStats:
        s = self.scheduler
        bm = self.block_manager
        return EngineStats(
            len(s.running), len(s.waiting), bm.num_free, bm.num_blocks, s.num_preemptions, bm.num_cached
        )

    # -- stepping ------------------------------------------------------------
    def step(self) -> list[RequestOutputDelta]:
        """Run one prefill or decode batch; returns a delta per request that got a token."""
        batch = self.last_batch = self.scheduler.schedule()
        if batch is None:
            return []
        self.num_steps += 1
        seqs = [it.seq for it in batch.sample_items]
        # The constrained rows' masks are filled while the forward runs.
        masks = self.constrained.start_masks([s.seq_id for s in seqs]) if self.constrained else None
        if self.speculator is not None and batch.kind is BatchKind.DECODE:
            began = time.perf_counter()
            proposals = self._propose(batch)
            if proposals is not None:
                deltas = self._speculative_step(batch, proposals, masks)
                rows = len(batch.items) + sum(map(len, proposals))
            else:
                deltas = self._plain_step(batch, masks)
                rows = len(batch.items)
            # (what the adaptive rule weighs a proposed token's cost by)
            self.speculator.observe_step(rows, time.perf_counter() - began)
            return deltas
        return self._plain_step(batch, masks)

    def _plain_step(self, batch: Batch, masks: Future[TokenMask] | None) -> list[RequestOutputDelta]:
        seqs = [it.seq for it in batch.sample_items]
        if self._logprobs:  # (some request asked for logprobs: the other steps do no work for them)
            return self._logprob_step(batch, masks)
        logits = self._forward(batch)  # [n_sample, V]
        if self.scheduler.choices.num_forking and batch.kind is not BatchKind.DECODE:
            return self._step_forking(batch, logits, seqs, masks)
        return self._finish_step(batch, self._sample(batch, logits, masks))

    def _sample(self, batch: Batch, logits: torch.Tensor, masks: Future[TokenMask] | None) -> list[int]:
        seqs = [it.seq for it in batch.sample_items]
        if masks is None and all(s.params.argmax_only for s in seqs):  # (greedy: no per-row sampler work)
            return self.sampler.argmax_tokens(logits)
        rows = [
            SampleRow(
                s.params, len(s.output_token_ids), s.output_offset, s.prompt_token_ids, s.output_token_ids
            )
            for s in seqs
        ]
        return self.sampler(logits, rows, None if masks is None else masks.result())

    def _finish_step(self, batch: Batch, tokens: list[int]) -> list[RequestOutputDelta]:
        """Append the step's tokens (advancing each constrained sequence's grammar); their deltas."""
        done = self.scheduler.postprocess(batch, tokens)
        if self.constrained:
            self._end_on_grammar(done)
        return self._emit(done)

    # -- structured output ---------------------------------------------------
    def _end_on_grammar(self, seqs: list[EngineSequence]) -> None:
        """Advance each constrained sequence's matcher past its new token; one whose grammar took eos (or
        refused the token) finishes with "stop", whatever ignore_eos and min_tokens say."""
        accept, finish = self.constrained.accept, self.scheduler.finish
        for seq in seqs:
            if accept(seq.seq_id, seq.output_token_ids[-1]) and not seq.is_finished:
                finish(seq, FinishReason.STOP)

    def _step_forking(
        self, batch: Batch, logits: torch.Tensor, seqs: list[EngineSequence], masks: Future[TokenMask] | None
    ) -> list[RequestOutputDelta]:
        """The rest of a step in which some sequences computed the last token of an ``n`` > 1 request's
        prompt: each samples every choice's first token from its one row of logits (under its grammar's
        mask), and the other choices fork from it (``engine.choices``) with copies of its matcher and
        their own logprobs."""
        index, plist = fork_rows(seqs)
        rows = [
            SampleRow(p, len(s.output_token_ids), s.output_offset, s.prompt_token_ids, s.output_token_ids)
            for p, s in zip(plist, (seqs[i] for i in index), strict=True)
        ]
        logits = logits[index]
        tokens = self.sampler(logits, rows, None if masks is None else masks.result().spread(index))
        lp = self._logprobs
        sampled = lp.sampled_rows(fork_row_ids(seqs), plist, logits, tokens) if lp else {}
        for s in seqs:
            if s.forks:  # (before its matcher takes its own token)
                self.constrained.fork(s.seq_id, child_ids(s))
                lp.forked(s.seq_id, child_ids(s))
        out = self.scheduler.postprocess(batch, *split_first_tokens(seqs, tokens))
        self._forked(out)
        if self.constrained:
            self._end_on_grammar(out)
        return [lp.attach(d, sampled) for d in self._emit(out)] if lp else self._emit(out)

    def _forked(self, seqs: list[EngineSequence]) -> None:
        """After choices forked: copy the partial blocks they got copies of, and give each new choice its
        detokenizer (primed with the prompt, as the choice it forked from)."""
        copies = self.scheduler.choices.block_copies
        if copies:
            self.runner.copy_blocks(copies)
            copies.clear()
        texts = self._text
        for s in seqs:
            if s.seq_id not in texts:
                texts[s.seq_id] = self._new_text_state(s.params, s.prompt_token_ids)

    def _forward(self, batch: Batch) -> torch.Tensor:
        bm = self.block_manager
        if batch.kind is BatchKind.DECODE:
            seqs = [it.seq for it in batch.items]
            return self.runner.decode_columns(
                [s.last_token_id for s in seqs],
                [it.start for it in batch.items],
                bm.live_tables([s.seq_id for s in seqs]),
            )
        pre, dec = self._step_items(batch)
        # [n_items, V]: the decodes' rows, then each prefill chunk's last token
        logits = self.runner.step(pre, dec) if dec else self.runner.prefill(pre)
        return self._sample_rows(batch, logits)

    @staticmethod
    def _sample_rows(batch: Batch, logits: torch.Tensor) -> torch.Tensor:
        keep = [i for i, it in enumerate(batch.items) if it.sample]
        return logits if len(keep) == len(batch.items) else logits[keep]

    def _step_items(self, batch: Batch) -> tuple[list[PrefillItem], list[DecodeItem]]:
        """A prefill or mixed batch's items as the runner takes them."""
        bm = self.block_manager
        n_dec = batch.decodes
        dec_items = batch.items[:n_dec]
        tables = bm.block_tables([it.seq.seq_id for it in dec_items])
        dec = [
            DecodeItem(it.seq.last_token_id, it.start, table)
            for it, table in zip(dec_items, tables, strict=True)
        ]
        pre = [
            PrefillItem(it.token_ids, bm.block_table(it.seq.seq_id), it.start) for it in batch.items[n_dec:]
        ]
        return pre, dec

    # -- speculative decoding ------------------------------------------------
    def _propose(self, batch: Batch) -> list[list[int]] | None:
        """Each decoding stream's proposal for this step; None when no stream proposes. A stream's
        lookahead blocks are reserved before it is asked (a draft writes K/V there), and one that cannot
        get them proposes nothing. Streams under a grammar and requests that turned speculation off
        propose nothing."""
        spec = self.speculator
        assert spec is not None
        reserve = self.scheduler.reserve_lookahead
        constrained, max_len = self.constrained, self.max_model_len
        seqs = [it.seq for it in batch.items]
        spec.plan(len(seqs))
        limits: list[int] = []
        for seq in seqs:
            p = seq.params
            n = 0
            if p.speculative and not (constrained and seq.seq_id in constrained):
                n_out = len(seq.output_token_ids)
                total = len(seq.prompt_token_ids) + n_out
                # The step makes one token anyway; each accepted proposal one more.
                n = spec.limit(seq, min(p.max_tokens - n_out, max_len - total) - 1)
                if n and not reserve(seq, total + n):
                    n = 0
            limits.append(n)
        if not any(limits):
            return None
        proposals = spec.propose(seqs, limits)
        return proposals if any(proposals) else None

    def _speculative_step(
        self, batch: Batch, proposals: list[list[int]], masks: Future[TokenMask] | None
    ) -> list[RequestOutputDelta]:
        """A decode step that verifies proposals: one forward over each stream's last token and its
        proposal (as decode rows), the target's sample at every position, and each stream's
        samples up to the first that differs from its proposal, applied token by token as single steps
        would (stop checks, stop strings, grammar, logprobs). One delta per stream."""
        assert self.speculator is not None
        items = batch.items
        seqs = [it.seq for it in items]
        tables = self.block_manager.live_tables([s.seq_id for s in seqs])
        # Each position of each stream is a decode item of its own: every item's K/V are stored before
        # any attends, so position j attends to the proposals before it, with the paged decode kernel
        # single steps use (its cost grows with the positions, not with a copy of the context).
        token_ids: list[int] = []
        positions: list[int] = []
        rows_tables: list[list[int]] = []
        row_seq: list[int] = []
        for i, (it, prop, table) in enumerate(zip(items, proposals, tables, strict=True)):
            token_ids.append(it.seq.last_token_id)
            token_ids += prop
            positions += range(it.start, it.start + len(prop) + 1)
            rows_tables += [table] * (len(prop) + 1)
            row_seq += [i] * (len(prop) + 1)
        logits = self.runner.decode_columns(token_ids, positions, rows_tables)
        tokens = self._sample_speculative(seqs, proposals, logits, row_seq, masks)
        spec = self.speculator
        spec.stats.verify_steps += 1
        lp = self._logprobs
        deltas: list[RequestOutputDelta] = []
        row = 0
        for seq, prop in zip(seqs, proposals, strict=True):
            samples = tokens[row : row + len(prop) + 1]
            accepted = accepted_prefix(prop, samples)
            if prop:
                spec.record(seq, len(prop), accepted)
            got: list[RequestOutputDelta] = []
            for token in samples[: accepted + 1]:
                if seq.is_finished:  # a stop, or aborted between schedule and now
                    break
                self.scheduler.append_verified(seq, token)
                if self.constrained:
                    self._end_on_grammar([seq])
                got += self._emit([seq])
            if got:
                delta = _merged(got)
                if lp and seq.seq_id in lp.ids:
                    top = seq.params.logprobs
                    entries = None
                    if top is not None:
                        emitted = list(delta.new_token_ids)
                        entries = token_logprobs(
                            logits[row : row + len(emitted)], emitted, [top] * len(emitted)
                        )
                    delta = lp.attach(delta, {})
                    if entries is not None:
                        delta = delta._replace(logprobs=tuple(entries))
                deltas.append(delta)
            row += len(prop) + 1
        return deltas

    def _sample_speculative(
        self,
        seqs: list[EngineSequence],
        proposals: list[list[int]],
        logits: torch.Tensor,
        row_seq: list[int],
        masks: Future[TokenMask] | None,
    ) -> list[int]:
        """The target's sample at every row of a verify forward: row ``j`` of a stream samples as its
        output token ``n + j`` would without speculation, the proposals before it taken as its outputs
        (seeded noise, min_tokens and penalties see them)."""
        if masks is None and all(s.params.argmax_only for s in seqs):
            return self.sampler.argmax_tokens(logits)
        rows: list[SampleRow] = []
        for seq, prop in zip(seqs, proposals, strict=True):
            p, outs = seq.params, seq.output_token_ids
            for j in range(len(prop) + 1):
                seen = outs + prop[:j] if j and p.adjusts_logits else outs
                rows.append(SampleRow(p, len(outs) + j, seq.output_offset, seq.prompt_token_ids, seen))
        return self.sampler(logits, rows, None if masks is None else masks.result().spread(row_seq))

    # -- logprobs ------------------------------------------------------------
    def _logprob_step(self, batch: Batch, masks: Future[TokenMask] | None) -> list[RequestOutputDelta]:
        """``step`` where some request asked for logprobs: the prompt chunks of those whose prompt logprobs
        are due keep every position (``ModelRunner.prefill_keeping``); the sampled tokens are the same."""
        lp = self._logprobs
        keep = lp.keep(batch)
        if any(keep):
            pre, dec = self._step_items(batch)
            if dec:
                logits, kept = self.runner.step_keeping(pre, dec, keep)
            else:
                logits, kept = self.runner.prefill_keeping(pre, keep)
            logits = self._sample_rows(batch, logits)
            lp.gather_prompt(batch, keep, kept)
        else:
            logits = self._forward(batch)
        if self.scheduler.choices.num_forking and batch.kind is not BatchKind.DECODE:
            return self._step_forking(batch, logits, [it.seq for it in batch.sample_items], masks)
        tokens = self._sample(batch, logits, masks)
        sampled = lp.sampled([it.seq for it in batch.sample_items], logits, tokens)
        return [lp.attach(d, sampled) for d in self._finish_step(batch, tokens)]

    # -- text ----------------------------------------------------------------
    def _new_text_state(self, params: SamplingParams, prompt_token_ids: Sequence[int]) -> _TextState:
        if self.tokenizer is None or not self.config.detokenize:
            return _TextState(None, None)
        # Primed with the prompt's tail: the first output token decodes in context.
        stream = self.tokenizer.decode_stream(prompt_token_ids=prompt_token_ids)
        return _TextState(stream.step_int, StopStringMatcher(params.stop) if params.stop else None)

    def _emit(self, seqs: list[EngineSequence]) -> list[RequestOutputDelta]:
        """Detokenize each sequence's newest token, apply stop strings, and describe the step."""
        # Runs for every sequence every step: names bound once, list lengths rather than the Sequence
        # properties.
        texts, finish = self._text, self.scheduler.finish
        stop = FinishReason.STOP
        delta = RequestOutputDelta
        deltas: list[RequestOutputDelta] = []
        add = deltas.append
        for seq in seqs:
            sid = seq.seq_id
            st = texts[sid]
            outputs = seq.output_token_ids
            token = outputs[-1]
            reason = seq.finish_reason
            text = ""
            # A stop token's own text is never emitted (vLLM's include_stop_str_in_output=False).
            if st.step is not None and reason is not stop:
                text = st.step(token) or ""
                matcher = st.matcher
                if matcher is not None:
                    # vLLM semantics: stop strings count only once min_tokens tokens exist.
                    match = matcher.feed(text, can_stop=len(outputs) > seq.params.min_tokens)
                    text = match.text
                    if match.stopped:
                        finish(seq, stop)
                        reason = seq.finish_reason
            why = None
            if reason is not None:  # finished (its blocks are already free)
                if st.matcher is not None:
                    text += st.matcher.flush()
                del texts[sid]
                self.constrained.drop(sid)
                why = reason.value
            offset = seq.output_offset
            prompt = len(seq.prompt_token_ids) - offset
            cached = seq.num_cached_tokens
            add(
                delta(
                    seq.request_id,
                    (token,),
                    text,
                    why,
                    prompt,
                    offset + len(outputs),
                    min(cached, prompt),
                    None,
                    None,
                    seq.index,
                )
            )
        return deltas


class _TruncatedTarget:
    """The self-speculative draft (``SpeculativeMethod.DRAFT``): the target's first ``num_layers`` layers,
    its final norm and LM head, greedy. It reads and writes those layers' K/V in the target's own cache:
    what it writes past a stream's computed length is written again by the verify forward."""

    def __init__(self, runner: ModelRunner, block_manager: BlockManager, num_layers: int) -> None:
        if runner.backend is Backend.TRITON:
            raise ValueError("speculative method 'draft' runs on the CPU backends only")
        self.runner, self.block_manager, self.num_layers = runner, block_manager, num_layers

    def next_tokens(
        self, seqs: list[EngineSequence], token_ids: list[int], positions: list[int]
    ) -> list[int]:
        tables = self.block_manager.live_tables([s.seq_id for s in seqs])
        items = [DecodeItem(t, p, tb) for t, p, tb in zip(token_ids, positions, tables, strict=True)]
        logits = self.runner.decode(items, num_layers=self.num_layers)
        return self.runner.argmax(logits).tolist()


def _merged(deltas: list[RequestOutputDelta]) -> RequestOutputDelta:
    """One stream's consecutive single-token deltas of a step as one."""
    if len(deltas) == 1:
        return deltas[0]
    return deltas[-1]._replace(
        new_token_ids=tuple(t for d in deltas for t in d.new_token_ids),
        new_text="".join(d.new_text for d in deltas),
    )


def engine_config_fields() -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(EngineConfig) if f.init)
