"""``pdserve bench``: an async gRPC load generator against a running router.

One run (``run_benchmark``): plan the seeded requests (``bench.plan``), connect, send the warmup, release each
measured request at its send time under ``--max-concurrency`` (``bench.client``; a multi-turn conversation's
turns one after the other, the conversation holding one slot), aggregate
(``bench.metrics``). Nothing is global, so a sweep runs many in one process; the ``pdserve`` CLI mounts it
with ``add_arguments`` and ``run_from_args``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pdserve.bench.arrivals import ArrivalConfig
from pdserve.bench.client import stream_request, to_proto
from pdserve.bench.datasets import DatasetName, SampleRequest, TokenSpace, WorkloadConfig
from pdserve.bench.machine import machine_info
from pdserve.bench.metrics import RequestRecord, Slo, compute_metrics, parse_slo
from pdserve.bench.plan import RunPlan, plan_run
from pdserve.bench.report import format_summary, write_json
from pdserve.proto import generation_pb2_grpc
from pdserve.worker.dial import router_aio_channel
from pdserve.worker.tls import NO_TLS, TLSConfig

DEFAULT_STATE_DIR = Path(".pdserve")  # the same default as the other `pdserve` subcommands
DEFAULT_MODEL = "smollm2-135m-instruct"


class BenchError(RuntimeError):
    """A run that cannot start: no router, no cluster state."""


# A week: far longer request deadlines (inf among them) overflow gRPC's and fail every request at once.
MAX_REQUEST_TIMEOUT_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class BenchConfig:
    router: str  # host:port
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    arrivals: ArrivalConfig = field(default_factory=ArrivalConfig)
    num_prompts: int = 100
    warmup: int = 0
    seed: int = 0
    max_concurrency: int | None = None  # None: unbounded
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 30.0
    slo: Slo = field(default_factory=Slo)
    temperature: float | None = None  # None: the server's default
    model: str = DEFAULT_MODEL  # whose tokenizer synthetic prompts draw token ids from
    progress: bool = False
    tls: TLSConfig = NO_TLS  # the router's gRPC over TLS (``worker.tls``)

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.warmup < 0 or self.seed < 0:
            raise ValueError(f"warmup and seed must be >= 0, got {self.warmup}, {self.seed}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not (self.request_timeout_s > 0 and self.connect_timeout_s > 0):
            raise ValueError("request_timeout_s and connect_timeout_s must be > 0")
        if not self.request_timeout_s <= MAX_REQUEST_TIMEOUT_S:  # (gRPC's deadline overflows past it)
            raise ValueError(
                f"request_timeout_s must be at most {MAX_REQUEST_TIMEOUT_S:g} s, got {self.request_timeout_s}"
            )

    def as_dict(self) -> dict[str, Any]:
        w, a = self.workload, self.arrivals
        multi_turn = w.dataset == DatasetName.MULTI_TURN
        return {
            "router": self.router,
            "dataset_name": str(w.dataset),
            "dataset_path": None if w.dataset_path is None else str(w.dataset_path),
            "input_len": w.input_len,
            "output_len": w.output_len,
            "range_ratio": w.range_ratio,
            "prefix_len": w.prefix_len,
            "num_prefix_groups": w.num_prefix_groups,
            "turns": w.turns if multi_turn else None,
            "num_conversations": -(-self.num_prompts // w.turns) if multi_turn else None,
            "ignore_eos": w.ignore_eos,
            "num_prompts": self.num_prompts,
            "warmup": self.warmup,
            "seed": self.seed,
            "request_rate": a.request_rate,
            "burstiness": a.burstiness,
            "max_concurrency": self.max_concurrency,
            "request_timeout_s": self.request_timeout_s,
            "goodput_slo": self.slo.as_dict(),
            "temperature": self.temperature,
            "model": self.model,
        }


@dataclass(frozen=True)
class BenchResult:
    config: BenchConfig
    metrics: Mapping[str, Any]  # bench.metrics.compute_metrics
    records: tuple[RequestRecord, ...]
    started_unix: float  # wall clock at t = 0 of the records' timeline
    cpu_count: int | None
    warmup_failed: int = 0
    # bench.machine.machine_info of the machine this client ran on (the router and workers may be elsewhere).
    machine: Mapping[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The saved result: vLLM's keys, the config and one record per measured request."""
        return {
            **self.metrics,
            "goodput_slo": self.config.slo.as_dict(),
            "date": datetime.fromtimestamp(self.started_unix, tz=UTC).isoformat(),
            "benchmark_start_unix": self.started_unix,
            "config": {**self.config.as_dict(), "cpu_count": self.cpu_count},
            "client_machine": self.machine,
            "warmup_requests": self.config.warmup,
            "warmup_failed": self.warmup_failed,
            "requests": [r.as_dict() for r in self.records],
        }

    def summary(self) -> str:
        return format_summary(self.to_dict())

    def save(self, path: Path) -> None:
        write_json(path, self.to_dict())


# ---- a run --------------------------------------------------------------------------------------------


def model_token_space(model: str) -> TokenSpace:
    """Token ids a random prompt may use for ``model``: its vocabulary minus special tokens."""
    from pdserve.engine.registry import resolve_model
    from pdserve.engine.tokenizer import Tokenizer

    model_dir = resolve_model(model, progress=False)
    tok = Tokenizer.from_dir(model_dir)
    special = {i for i, t in tok.backend.get_added_tokens_decoder().items() if t.special}
    special.update(tok.eos_token_ids)
    if tok.bos_token_id is not None:
        special.add(tok.bos_token_id)
    vocab = tok.vocab_size
    config_path = model_dir / "config.json"
    if config_path.is_file():
        # The router bounds ids by the model's embedding rows, which may be fewer than the tokenizer's.
        vocab = min(vocab, int(json.loads(config_path.read_text()).get("vocab_size") or vocab))
    return TokenSpace(vocab_size=vocab, excluded_ids=frozenset(special))


def _progress_bar(enabled: bool, total: int, desc: str) -> tqdm:
    return tqdm(total=total, desc=desc, file=sys.stderr, disable=not (enabled and sys.stderr.isatty()))


def send_chains(samples: Sequence[SampleRequest]) -> list[list[int]]:
    """The order requests go in: chains of indices, each sent one after the other (a multi-turn
    conversation's turns), chains side by side. A request outside any conversation is a chain of its own;
    chains are listed by their first index."""
    chains: dict[tuple[str, int], list[int]] = {}
    for i, sample in enumerate(samples):
        key = ("conversation", sample.conversation) if sample.conversation is not None else ("request", i)
        chains.setdefault(key, []).append(i)
    for chain in chains.values():
        chain.sort(key=lambda i: samples[i].turn or 0)
    return sorted(chains.values(), key=lambda c: c[0])


async def _send_all(
    stub: generation_pb2_grpc.GenerationStub,
    samples: Sequence[SampleRequest],
    send_times: Sequence[float],
    config: BenchConfig,
    id_prefix: str,
    desc: str,
) -> list[RequestRecord]:
    """Release each chain (``send_chains``) at its first request's send time (seconds from now), then each
    next request of it once the one before finished; one record per request, in order. A chain holds one
    ``max_concurrency`` slot from its first request to its last: a conversation is one client."""
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    bar = _progress_bar(config.progress, len(samples), desc)
    records: list[RequestRecord | None] = [None] * len(samples)

    async def chain_of(indices: list[int]) -> None:
        async with slots if slots is not None else contextlib.nullcontext():
            for k, i in enumerate(indices):
                sample = samples[i]
                # A later turn is due when the one before it finished.
                at = send_times[i] if k == 0 else clock()
                records[i] = await stream_request(
                    stub,
                    to_proto(sample, f"{id_prefix}-{i}", config.temperature),
                    index=i,
                    scheduled_time=at,
                    prompt_len=sample.prompt_len,
                    timeout_s=config.request_timeout_s,
                    clock=clock,
                )
                bar.update(1)

    tasks: list[asyncio.Task[None]] = []
    try:
        for chain in sorted(send_chains(samples), key=lambda c: send_times[c[0]]):
            delay = send_times[chain[0]] - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(chain_of(chain)))
        await asyncio.gather(*tasks)
        assert all(r is not None for r in records)
        return [r for r in records if r is not None]
    finally:
        # Reached early only when the run itself is cancelled: stop every stream still open.
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        bar.close()


async def run_benchmark(config: BenchConfig, *, token_space: TokenSpace | None = None) -> BenchResult:
    """One benchmark run against ``config.router``. Raises BenchError when the router is unreachable."""
    if token_space is None and config.workload.dataset != DatasetName.JSONL:
        token_space = await asyncio.to_thread(model_token_space, config.model)
    plan: RunPlan = plan_run(
        config.workload, config.arrivals, config.num_prompts, config.warmup, config.seed, token_space
    )
    run_id = uuid.uuid4().hex[:8]  # request ids only: tells runs apart in router logs
    async with router_aio_channel(config.router, config.tls) as channel:
        try:
            await asyncio.wait_for(channel.channel_ready(), config.connect_timeout_s)
        except TimeoutError:
            raise BenchError(
                f"router {config.router} not reachable within {config.connect_timeout_s:g} s"
            ) from None
        stub = generation_pb2_grpc.GenerationStub(channel)
        # Warmup: all at once under the concurrency bound; only its failures are kept.
        warm = await _send_all(
            stub, plan.warmup, [0.0] * len(plan.warmup), config, f"bench-{run_id}-w", "warmup"
        )
        started_unix = time.time()
        records = await _send_all(stub, plan.requests, plan.send_times, config, f"bench-{run_id}", "bench")
    return BenchResult(
        config=config,
        metrics=compute_metrics(records, config.slo),
        records=tuple(records),
        started_unix=started_unix,
        cpu_count=os.cpu_count(),
        warmup_failed=sum(not r.ok for r in warm),
        machine=machine_info(),
    )


# ---- command line -------------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _nonneg_int(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``pdserve bench`` options (including ``--router`` and ``--state-dir``)."""
    where = parser.add_argument_group("target")
    where.add_argument("--router", default=None, help="router address host:port (default: from --state-dir)")
    where.add_argument(
        "--tls-ca", type=Path, default=None, help="call the router over TLS, checked against this CA"
    )
    where.add_argument("--tls-cert", type=Path, default=None, help="client certificate for mutual TLS (PEM)")
    where.add_argument("--tls-key", type=Path, default=None, help="its private key (PEM)")
    where.add_argument(
        "--state-dir",
        type=Path,
        default=DEFAULT_STATE_DIR,
        help=f"the local cluster `pdserve up` started (default ./{DEFAULT_STATE_DIR})",
    )
    where.add_argument(
        "--model",
        default=None,
        help=f"tokenizer for random prompts (default: the cluster's model, else {DEFAULT_MODEL})",
    )
    add_workload_arguments(parser)
    add_load_arguments(parser, request_rate=True)
    out = add_result_arguments(parser)
    out.add_argument("--save-result", type=Path, default=None, metavar="FILE", help="write the result JSON")


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """What is sent: the dataset, prompt and output lengths, temperature."""
    data = parser.add_argument_group("workload")
    data.add_argument(
        "--dataset-name",
        choices=[d.value for d in DatasetName],
        default=None,
        help="random (default), shared-prefix, multi-turn, or jsonl (implied by --dataset-path)",
    )
    data.add_argument(
        "--dataset-path", type=Path, default=None, help='JSONL: {"prompt"|"messages", "output_len"?}'
    )
    data.add_argument(
        "--input-len", type=_positive_int, default=1024, help="prompt tokens (random workloads)"
    )
    data.add_argument("--output-len", type=_positive_int, default=128, help="max_tokens (exact for random)")
    data.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*[1-r, 1+r]")
    data.add_argument("--prefix-len", type=_nonneg_int, default=0, help="shared prefix tokens per prompt")
    data.add_argument(
        "--num-prefix-groups", type=_positive_int, default=8, help="distinct prefixes (shared-prefix)"
    )
    data.add_argument(
        "--num-conversations",
        type=_positive_int,
        default=None,
        help="multi-turn: conversations (requests: this x --turns; default: --num-prompts / --turns)",
    )
    data.add_argument(
        "--turns",
        type=_positive_int,
        default=4,
        help="multi-turn: requests per conversation, each resending the history, sent in order",
    )
    data.add_argument("--ignore-eos", action="store_true", help="jsonl: generate max_tokens whatever the EOS")
    data.add_argument("--temperature", type=float, default=None, help="default: the server's")


def add_load_arguments(parser: argparse.ArgumentParser, *, request_rate: bool) -> None:
    """How it is sent: arrivals, concurrency, warmup, seed, timeouts."""
    load = parser.add_argument_group("load")
    load.add_argument("--num-prompts", type=_positive_int, default=100, help="measured requests")
    if request_rate:
        load.add_argument(
            "--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)"
        )
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    load.add_argument(
        "--max-concurrency", type=_positive_int, default=None, help="requests in flight at most"
    )
    load.add_argument("--warmup", type=_nonneg_int, default=0, help="requests sent first, not measured")
    load.add_argument("--seed", type=_nonneg_int, default=0, help="fixes prompts, lengths and arrival times")
    load.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds before a stream is cancelled"
    )
    load.add_argument("--connect-timeout", type=float, default=30.0, help="seconds to reach the router")


def add_result_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    out = parser.add_argument_group("results")
    out.add_argument(
        "--goodput", nargs="+", default=[], metavar="NAME:MS", help="SLOs, e.g. ttft:500 tpot:50 (also e2el)"
    )
    out.add_argument("--no-progress", action="store_true", help="no progress bar (also off when not a TTY)")
    return out


def resolve_target(router: str | None, state_dir: Path) -> tuple[str, str | None, TLSConfig]:
    """The router address and, when read from the cluster's state file, the cluster's model and TLS files."""
    if router:
        return router, None, NO_TLS
    from pdserve.deploy.local.cluster import load_state, state_tls

    state = load_state(state_dir)
    if state is None:
        raise BenchError(f"no cluster in {state_dir} (run `pdserve up` there first, or pass --router)")
    return state.router_list, state.model, state_tls(state)


def workload_from_args(args: argparse.Namespace) -> WorkloadConfig:
    dataset = DatasetName(args.dataset_name) if args.dataset_name else None
    if dataset is None:
        dataset = DatasetName.JSONL if args.dataset_path is not None else DatasetName.RANDOM
    return WorkloadConfig(
        dataset=dataset,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        prefix_len=args.prefix_len,
        num_prefix_groups=args.num_prefix_groups,
        turns=args.turns,
        dataset_path=args.dataset_path,
        ignore_eos=args.ignore_eos,
    )


def config_from_args(
    args: argparse.Namespace, *, router: str | None = None, model: str | None = None
) -> BenchConfig:
    """The run ``args`` describe; ``router``/``model`` given: a cluster the caller started (sweeps)."""
    tls = NO_TLS
    if router is None:
        router, cluster_model, tls = resolve_target(args.router, args.state_dir)
        model = args.model or cluster_model
    if getattr(args, "tls_cert", None) or getattr(args, "tls_ca", None):
        tls = TLSConfig.load(args.tls_cert, args.tls_key, args.tls_ca)
    workload = workload_from_args(args)
    num_prompts = args.num_prompts
    if workload.dataset == DatasetName.MULTI_TURN and args.num_conversations is not None:
        num_prompts = args.num_conversations * workload.turns
    return BenchConfig(
        router=router,
        workload=workload,
        arrivals=ArrivalConfig(
            request_rate=getattr(args, "request_rate", math.inf), burstiness=args.burstiness
        ),
        num_prompts=num_prompts,
        warmup=args.warmup,
        seed=args.seed,
        max_concurrency=args.max_concurrency,
        request_timeout_s=args.request_timeout,
        connect_timeout_s=args.connect_timeout,
        slo=parse_slo(args.goodput),
        temperature=args.temperature,
        model=model or DEFAULT_MODEL,
        progress=not args.no_progress,
        tls=tls,
    )


def run_from_args(args: argparse.Namespace) -> int:
    """Run, print the summary on stdout, save the JSON when asked. 0 on success, 1 when it cannot run."""
    import uvloop

    try:
        config = config_from_args(args)
        result = uvloop.run(run_benchmark(config))
    except (BenchError, ValueError, OSError) as e:
        print(f"pdserve bench: {e}", file=sys.stderr)
        return 1
    print(result.summary(), flush=True)
    if args.save_result is not None:
        result.save(args.save_result)
        print(f"pdserve bench: result saved to {args.save_result}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pdserve bench", description="Load-test a pdserve router over gRPC."
    )
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
