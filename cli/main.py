"""The ``pdserve`` command line.

Local cluster (background processes, found again through ``--state-dir``):
    up, scale, autoscale, status, generate, down
Foreground pieces for deployments:
    router, worker, drain (one worker, through the router: a preStop hook)

Environment is read here only (``engine.env.EngineEnv``: the model cache directory).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import grpc

from pdserve.cli import client, cluster_cmds, lifeline
from pdserve.deploy.local import cluster
from pdserve.engine.device import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEVICE_HELP,
    DTYPE_CHOICES,
    check_device,
    check_gpu_memory_utilization,
)
from pdserve.engine.quant import QUANTIZATIONS
from pdserve.router.config import DEFAULT_HOST, DEFAULT_MODEL, DEFAULT_PORT, RouterConfig
from pdserve.worker.args import KV_PUTS, WorkerArgs
from pdserve.worker.role import Role
from pdserve.worker.tls import TLSConfig, TLSError

DEFAULT_STATE_DIR = ".pdserve"
# ``pdserve worker --role R`` runs ``serve(args: WorkerArgs)`` from this module.
POOL_MODULES = {
    Role.PREFILL: "pdserve.prefill_pool.servicer",
    Role.DECODE: "pdserve.decode_pool.servicer",
    Role.BOTH: "pdserve.decode_pool.servicer",
}


def _nonneg(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an int in [low, high] (what the request's proto field holds)."""

    def parse(text: str) -> int:
        n = int(text)
        if not low <= n <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {n}")
        return n

    return parse


def _seconds(positive: bool) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds, > 0 (``positive``) or >= 0."""

    def parse(text: str) -> float:
        x = float(text)
        if not math.isfinite(x) or (x <= 0 if positive else x < 0):
            bound = "> 0" if positive else ">= 0"
            raise argparse.ArgumentTypeError(f"must be a number of seconds {bound}, got {text}")
        return x

    return parse


def _device(text: str) -> str:
    try:
        return check_device(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _fraction(text: str) -> float:
    try:
        return check_gpu_memory_utilization(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1], e.g. 0.9; got {text!r}") from None


def _device_args(p: argparse.ArgumentParser, command: str) -> None:
    """--device, --gpu-memory-utilization and (not on scale) --dtype and --quantization; ``command``: up |
    scale | worker (scale's workers take the cluster's)."""
    if command != "scale":
        p.add_argument(
            "--dtype",
            choices=DTYPE_CHOICES,
            default="auto",
            help="auto (default): bfloat16 on CUDA and on CPUs with native bf16 dot products "
            "(AVX512-BF16, AMX), float32 elsewhere",
        )
        p.add_argument(
            "--quantization",
            choices=QUANTIZATIONS,
            default="none",
            help="int8: weight-only int8 with a scale per row and 64 inputs (about a quarter of float32's "
            "weight bytes; activations and the KV cache keep --dtype); none (default): weights in --dtype",
        )
    if command == "scale":
        device_help = f"where the new workers run: {DEVICE_HELP} (default: as the cluster was started)"
        util_help = "the share of the GPU's memory each new worker may use (default: what `up` gave each)"
    elif command == "up":
        device_help = f"where every worker runs: {DEVICE_HELP} (default: cpu); all of them share the GPU"
        util_help = (
            "the share of the GPU's memory each worker may use, its weights and KV cache included, as "
            f"vLLM means it (default: {DEFAULT_GPU_MEMORY_UTILIZATION} shared evenly among the workers "
            "`up` starts on the GPU); ignored on CPU"
        )
    else:
        device_help = f"where the worker runs: {DEVICE_HELP} (default: cpu)"
        util_help = (
            "the share of the GPU's memory this worker may use, its weights and KV cache included, as vLLM "
            "means it; the KV cache gets what is left unless --kv-blocks or --kv-cache-mib is given; "
            "ignored on CPU (default: %(default)s)"
        )
    p.add_argument("--device", type=_device, default=None if command == "scale" else "cpu", help=device_help)
    p.add_argument(
        "--gpu-memory-utilization",
        type=_fraction,
        default=DEFAULT_GPU_MEMORY_UTILIZATION if command == "worker" else None,
        metavar="FRACTION",
        help=util_help,
    )


def _state_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--state-dir",
        type=Path,
        default=Path(DEFAULT_STATE_DIR),
        help=f"where `up` keeps the cluster's state file and logs (default ./{DEFAULT_STATE_DIR})",
    )


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="model name or path (default: %(default)s)")
    p.add_argument(
        "--cache-dir", type=Path, default=None, help="model cache (default: $PDSERVE_CACHE_DIR or user cache)"
    )


TOKEN_FILE_VAR = "PDSERVE_CLUSTER_TOKEN_FILE"


def _token_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cluster-token-file",
        type=Path,
        default=None,
        help=f"the cluster token the router requires of workers and the CLI (default: ${TOKEN_FILE_VAR}; "
        "none: an open control plane). `up` makes one per cluster.",
    )


def cluster_token(args: argparse.Namespace) -> str:
    """The token from --cluster-token-file or $PDSERVE_CLUSTER_TOKEN_FILE ("" when neither is set)."""
    import os

    from pdserve.worker.auth import read_token_file

    path = args.cluster_token_file or os.environ.get(TOKEN_FILE_VAR, "").strip()
    return read_token_file(path) if path else ""


def _tls_args(p: argparse.ArgumentParser, server: bool) -> None:
    if server:
        cert = "serve gRPC over TLS with this certificate (PEM; also HTTPS on --http-port) and present it "
        ca = "mutual TLS: require peers' certificates signed by this CA (PEM), and check peers against it"
    else:
        cert = "present this client certificate (PEM) to a router that requires one (mutual TLS)"
        ca = "call the router over TLS, checking it against this CA (PEM)"
    p.add_argument("--tls-cert", type=Path, default=None, help=cert + " (default: plain gRPC)")
    p.add_argument("--tls-key", type=Path, default=None, help="the private key of --tls-cert (PEM)")
    p.add_argument("--tls-ca", type=Path, default=None, help=ca)


def tls_config(args: argparse.Namespace) -> TLSConfig:
    """The TLS files of --tls-cert/--tls-key/--tls-ca, read (NO_TLS when none is given)."""
    return TLSConfig.load(args.tls_cert, args.tls_key, args.tls_ca)


def _router_tuning(p: argparse.ArgumentParser) -> None:
    d = RouterConfig()
    p.add_argument("--max-waiting", type=_nonneg, default=d.max_waiting, help="router queue bound")
    p.add_argument(
        "--max-migrations",
        type=_nonneg,
        default=d.max_migrations,
        help="times a stream moves to a healthy worker when its worker fails (0: never; default %(default)s)",
    )
    p.add_argument(
        "--max-prefill-queue-tokens",
        type=_nonneg,
        default=d.max_prefill_queue_tokens,
        help="prompt tokens queued on one prefill worker beyond which new requests are refused at once "
        "(RESOURCE_EXHAUSTED; 0: no bound; default %(default)s)",
    )
    p.add_argument(
        "--queue-timeout",
        type=_seconds(True),
        default=d.queue_timeout_s,
        help="seconds a request may wait in the router's queue for a decode worker with room, then "
        "UNAVAILABLE (HTTP 503)",
    )
    p.add_argument(
        "--local-prefill-threshold",
        type=_nonneg,
        default=d.local_prefill_threshold,
        help="prompts shorter than this many tokens prefill on the decode worker",
    )
    p.add_argument(
        "--heartbeat-interval",
        type=_seconds(True),
        default=d.heartbeat_interval_s,
        help="seconds between workers' heartbeats",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=_seconds(True),
        default=d.heartbeat_timeout_s,
        help="seconds without a heartbeat after which a worker is dropped and its requests move",
    )
    p.add_argument(
        "--request-timeout",
        type=_seconds(False),
        default=d.request_timeout_s,
        help="deadline for requests that set none (0: none)",
    )
    p.add_argument(
        "--metrics-port",
        type=_int_in(0, 65535),
        default=d.metrics_port,
        help="the router's /metrics port (0: any)",
    )
    p.add_argument(
        "--http-port",
        type=_int_in(0, 65535),
        default=None,
        help="serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions) on this port "
        "(0: a free one; default: off)",
    )


def _worker_tuning(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-size", type=_positive, default=16, help="tokens per KV block")
    p.add_argument(
        "--kv-blocks", type=_nonneg, default=0, help="KV cache blocks (0: from --kv-cache-mib or default)"
    )
    p.add_argument(
        "--kv-cache-mib", type=_nonneg, default=0, help="KV cache size in MiB (0: the engine default)"
    )
    p.add_argument("--max-running", type=_positive, default=64, help="decode batch bound")
    p.add_argument(
        "--max-batched-tokens",
        type=_positive,
        default=2048,
        help="token budget per step (a running stream's decode counts one; longer prompts are chunked)",
    )
    p.add_argument(
        "--mixed-steps",
        action="store_true",
        help="one step decodes the running streams and prefills waiting prompts in the rest of the "
        "budget (default: a step either prefills or decodes, prefill first; mixed steps measured slower "
        "on CPU, see the README)",
    )
    p.add_argument(
        "--kv-stall-timeout",
        type=_seconds(True),
        default=WorkerArgs.kv_stall_timeout_s,
        help="seconds a started KV transfer may make no progress before the decode worker fails it: no "
        "layer landed, or with one-sided writes (puts, cross-memory, shared memory) none reported put by "
        "the prefill worker, which reports them at most every half second as its forward goes "
        "(default %(default)s)",
    )
    p.add_argument(
        "--kv-interface",
        default="",
        help="network devices the KV transfer (UCX) uses, in UCX_NET_DEVICES syntax, e.g. eth0 or "
        "mlx5_0:1,eth0; 'all': every device (default: $UCX_NET_DEVICES, else the interface carrying --host)",
    )
    p.add_argument(
        "--no-kv-cross-memory",
        dest="kv_cross_memory",
        action="store_false",
        help="never write a decode worker of this host by cross-memory attach (process_vm_writev; host "
        "memory) or CUDA IPC (device memory); all KV goes through UCX (default: those writes where the "
        "kernel and the GPUs permit them)",
    )
    p.add_argument(
        "--kv-shared-memory",
        action="store_true",
        help="decode workers on CPU keep the KV cache in shared memory, which prefill workers of this host "
        "write with plain copies (on a kernel whose cross-memory writes are slow: a 1,024-token transfer "
        "1.25-1.41x faster end to end, the copies alone 2.5x); shared memory has huge pages only where the "
        "kernel allows them for it (transparent_hugepage/shmem_enabled), decode attention read 2-9%% slower "
        "without (default: off)",
    )
    p.add_argument(
        "--kv-puts",
        choices=KV_PUTS,
        default="auto",
        help="how KV reaches a decode worker: auto (one-sided writes: RDMA, CUDA IPC, cross-memory on one "
        "host; UCX puts over tcp while UCX_TCP_TX_SEG_SIZE is at least 64K, pdserve's default, else tagged "
        "messages, measured faster with UCX's own 8K segments), always (UCX puts over tcp whatever the "
        "segment size), never (tagged messages only, cross-memory writes off as well); both ends must allow "
        "puts for a transfer to use them (default %(default)s)",
    )
    p.add_argument("--kv-fault-delay", type=float, default=0.0, help=argparse.SUPPRESS)  # tests only
    p.add_argument(
        "--worker-module",
        default=None,
        help="module whose `async serve(args: WorkerArgs)` runs the worker (default: the role's pool)",
    )


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default unless the text already says it (or there is none)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            action.option_strings
            and "default" not in text
            and default is not None
            and default is not False  # (a store_true flag; 0 is a default worth showing)
            and default != argparse.SUPPRESS
            and not (isinstance(default, (list, tuple)) and not default)
        ):
            text = f"{text} (default: %(default)s)" if text else "(default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pdserve", description="Prefill/decode disaggregated LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("up", help="start a router and workers as local background processes")
    p.add_argument("--prefill", type=_nonneg, default=1, help="prefill workers")
    p.add_argument("--decode", type=_nonneg, default=1, help="decode workers")
    p.add_argument("--colocated", type=_nonneg, default=0, help="workers that prefill and decode (role both)")
    _model_args(p)
    _device_args(p, "up")
    p.add_argument("--host", default=DEFAULT_HOST, help="the address every process binds to")
    p.add_argument("--port", type=_int_in(1, 65535), default=DEFAULT_PORT, help="the router's gRPC port")
    p.add_argument(
        "--threads",
        type=_positive,
        default=None,
        help="torch threads per worker (default: cores / workers, at least 1)",
    )
    p.add_argument(
        "--pin-cpus",
        action="store_true",
        help="pin every worker to its own cores (its --threads of them, least used first), so that "
        "cluster shapes with the same worker count run on the same cores",
    )
    p.add_argument(
        "--timeout", type=_seconds(True), default=600.0, help="seconds to wait for everything to be ready"
    )
    p.add_argument(
        "--prometheus", action="store_true", help="also start a Prometheus server scraping the cluster"
    )
    p.add_argument(
        "--prometheus-port", type=_int_in(1, 65535), default=9090, help="its HTTP port (default %(default)s)"
    )
    p.add_argument(
        "--scrape-interval", type=_seconds(True), default=5.0, help="its scrape interval in seconds"
    )
    p.add_argument(
        "--alertmanager",
        action="store_true",
        help="also start an Alertmanager that the Prometheus sends its alerts to (implies --prometheus)",
    )
    p.add_argument(
        "--alertmanager-port",
        type=_int_in(1, 65535),
        default=9093,
        help="its HTTP port (default %(default)s)",
    )
    p.add_argument(
        "--alert-for",
        type=_seconds(False),
        default=None,
        help="seconds every alert must hold before it fires, instead of each rule's own (minutes): "
        "for a demo or a test",
    )
    _router_tuning(p)
    _worker_tuning(p)
    _tls_args(p, server=True)
    _state_dir(p)
    cluster_cmds.autoscale_arguments(p, on_up=True)

    p = sub.add_parser("scale", help="grow or shrink the pools of the local cluster")
    p.add_argument(
        "--prefill", type=_nonneg, default=None, help="prefill workers wanted (default: unchanged)"
    )
    p.add_argument("--decode", type=_nonneg, default=None, help="decode workers wanted (default: unchanged)")
    p.add_argument(
        "--colocated", type=_nonneg, default=None, help="colocated workers wanted (default: as now)"
    )
    p.add_argument(
        "--timeout",
        type=_seconds(False),
        default=600.0,
        help="seconds to wait for new workers / drains (0: removed workers stop at once)",
    )
    _device_args(p, "scale")
    _state_dir(p)

    p = sub.add_parser(
        "autoscale",
        help="size the local cluster's prefill and decode pools from their load (foreground; "
        "`up --autoscale` starts it in the background)",
    )
    p.add_argument("--metrics-port", type=_nonneg, default=0, help="its /metrics port (0: any free)")
    cluster_cmds.autoscale_arguments(p, on_up=False)
    _state_dir(p)

    p = sub.add_parser("status", help="workers, their state and load")
    p.add_argument("--json", action="store_true", help="the whole status as JSON")
    p.add_argument("--router", default=None, help="router address (default: from the state file)")
    _token_arg(p)
    _tls_args(p, server=False)
    _state_dir(p)

    p = sub.add_parser("generate", help="stream a completion to stdout")
    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    unset = "(default: the engine's, as for an unset field)"
    p.add_argument(
        "--max-tokens", type=_int_in(1, 2**32 - 1), default=None, help=f"tokens to generate {unset}"
    )
    p.add_argument("--temperature", type=float, default=None, help=f"0: greedy {unset}")
    p.add_argument("--top-p", type=float, default=None, help=f"nucleus sampling mass {unset}")
    p.add_argument("--seed", type=_int_in(0, 2**64 - 1), default=None, help="a seed: reproducible sampling")
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="one JSON object per streamed message")
    p.add_argument(
        "--timeout", type=_seconds(False), default=600.0, help="the request's deadline in seconds (0: none)"
    )
    p.add_argument("--router", default=None, help="router address (default: from the state file)")
    _tls_args(p, server=False)
    _state_dir(p)

    p = sub.add_parser(
        "drain",
        help="drain one worker through the router and wait until it has left (a Kubernetes preStop hook)",
    )
    p.add_argument("--worker-id", required=True, help="the id the worker registered with")
    p.add_argument("--router", default=None, help="router address (default: from the state file)")
    p.add_argument("--timeout", type=_seconds(False), default=300.0, help="seconds to wait for it to leave")
    _token_arg(p)
    _tls_args(p, server=False)
    _state_dir(p)

    p = sub.add_parser("down", help="stop the local cluster: drain, SIGTERM, then SIGKILL")
    p.add_argument(
        "--timeout", type=_seconds(False), default=60.0, help="seconds workers get to drain (0: stop at once)"
    )
    _state_dir(p)

    p = sub.add_parser("router", help="run the router in the foreground")
    p.add_argument("--host", default=DEFAULT_HOST, help="the address to bind")
    p.add_argument("--port", type=_int_in(0, 65535), default=DEFAULT_PORT, help="the gRPC port (0: any)")
    _model_args(p)
    _router_tuning(p)
    _token_arg(p)
    _tls_args(p, server=True)

    p = sub.add_parser("worker", help="run a worker in the foreground")
    p.add_argument("--role", choices=[r.value for r in Role], required=True, help="the worker's pool")
    p.add_argument("--router", required=True, help="the router's address, host:port")
    p.add_argument("--host", default=DEFAULT_HOST, help="the address to bind and register (a pod IP)")
    p.add_argument("--port", type=_int_in(0, 65535), default=0, help="0: pick a free port")
    _model_args(p)
    _device_args(p, "worker")
    p.add_argument("--threads", type=_positive, default=None, help="torch threads (default: all cores)")
    p.add_argument(
        "--cpus",
        type=cluster.parse_cpu_list,
        default=None,
        help="pin the worker to these cores, e.g. 0 or 0,2-3 (default: not pinned)",
    )
    p.add_argument("--worker-id", default=None, help="default: ROLE-HOST-PID")
    p.add_argument(
        "--standby",
        action="store_true",
        help="join the warm pool: load and register, but take requests only once promoted (the autoscaler)",
    )
    p.add_argument(
        "--drain-timeout", type=float, default=300.0, help="seconds a drain waits for requests in flight"
    )
    p.add_argument(
        "--load-failure-linger",
        type=float,
        default=0.0,
        help="when the model fails to load, keep /metrics up this many seconds before exiting, so "
        "Prometheus sees pdserve_model_load_failed (default: exit at once)",
    )
    p.add_argument("--metrics-port", type=_nonneg, default=0, help="the worker's /metrics port (0: any free)")
    _worker_tuning(p)
    _token_arg(p)
    _tls_args(p, server=True)

    p = sub.add_parser("bench", help="load-test a running router (workloads, arrivals, goodput under SLOs)")
    # bench adds its own --router / --state-dir.
    from pdserve.bench.serve import add_arguments as bench_arguments

    bench_arguments(p)
    from pdserve.bench import sweep

    modes = p.add_subparsers(dest="bench_mode", metavar="{sweep,compare,soak}", required=False)
    q = modes.add_parser(
        "sweep",
        help="bring up one cluster shape, sweep request rates, find its goodput",
        description="Bring up a cluster shape (e.g. 1P+1D or 2C), sweep request rates and find its goodput: "
        "the highest rate at which --attainment of the requests meet both the TTFT and TPOT SLOs.",
    )
    sweep.add_arguments(q, compare=False)
    q = modes.add_parser(
        "compare",
        help="goodput of two shapes with the same worker count, on the same request stream, in one run",
        description="Bring up every shape, sweep the same request stream over all of them (alternating), "
        "and write the goodput ratio (first / second shape), SLO-attainment curves and TTFT/ITL CDF plots.",
    )
    sweep.add_arguments(q, compare=True)
    from pdserve.bench import soak

    q = modes.add_parser(
        "soak",
        help="mixed traffic for N minutes with a worker SIGKILLed a minute: lost requests, leaks, RSS",
        description="Run mixed traffic (gRPC and OpenAI streams, cancels) against a local cluster, SIGKILL "
        "one worker a minute and scale its pool back, then report requests completed/lost/refused, "
        "migrations, KV blocks leaked and each process's RSS over time (soak.json, soak_rss.png).",
    )
    soak.add_arguments(q)
    return parser


def _options_follow_the_mode(parser: argparse.ArgumentParser, argv: list[str], mode: str) -> None:
    """``bench --num-prompts 4 sweep ...``: argparse lets the mode's own defaults overwrite what was given
    before the mode word, silently (a goodput SLO, the state dir of a cluster to attach to). Refused."""
    start, end = argv.index("bench") + 1, argv.index(mode)
    before = [a for a in argv[start:end] if a.startswith("-")]
    if before:
        parser.error(
            f"{' '.join(before)} before `{mode}`: the options of `pdserve bench {mode}` go after it "
            f"(pdserve bench {mode} {' '.join(argv[start:end])} ...)"
        )


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench_mode in ("sweep", "compare"):
        from pdserve.bench.sweep import run_from_args as run_sweep

        return run_sweep(args, compare=args.bench_mode == "compare")
    if args.bench_mode == "soak":
        from pdserve.bench.soak import run_from_args as run_soak

        return run_soak(args)
    from pdserve.bench.serve import run_from_args

    return run_from_args(args)


def router_config(args: argparse.Namespace) -> RouterConfig:
    from pdserve.engine.env import EngineEnv

    cache_dir = args.cache_dir or EngineEnv.from_environ().cache_dir
    return RouterConfig(
        host=args.host,
        port=args.port,
        model=args.model,
        cache_dir=cache_dir,
        max_waiting=args.max_waiting,
        max_migrations=args.max_migrations,
        max_prefill_queue_tokens=args.max_prefill_queue_tokens,
        queue_timeout_s=args.queue_timeout,
        local_prefill_threshold=args.local_prefill_threshold,
        heartbeat_interval_s=args.heartbeat_interval,
        heartbeat_timeout_s=args.heartbeat_timeout,
        request_timeout_s=args.request_timeout,
        metrics_port=args.metrics_port,
        http_port=args.http_port,
        cluster_token=cluster_token(args),
        tls=tls_config(args),
    )


def worker_args(args: argparse.Namespace, hostname: str, pid: int, cpus: int) -> WorkerArgs:
    from pdserve.engine.env import EngineEnv

    role = Role(args.role)
    return WorkerArgs(
        role=role,
        router=args.router,
        worker_id=args.worker_id or f"{role.value}-{hostname}-{pid}",
        host=args.host,
        port=args.port,
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        gpu_memory_utilization=args.gpu_memory_utilization,
        threads=args.threads or cluster.default_threads(1, cpus),
        block_size=args.block_size,
        kv_blocks=args.kv_blocks,
        kv_cache_bytes=args.kv_cache_mib << 20,
        max_running=args.max_running,
        max_batched_tokens=args.max_batched_tokens,
        mixed_steps=args.mixed_steps,
        kv_stall_timeout_s=args.kv_stall_timeout,
        kv_fault_delay_s=args.kv_fault_delay,
        cache_dir=args.cache_dir or EngineEnv.from_environ().cache_dir,
        drain_timeout_s=args.drain_timeout,
        load_failure_linger_s=args.load_failure_linger,
        metrics_port=args.metrics_port,
        cluster_token=cluster_token(args),
        kv_interface=args.kv_interface,
        kv_cross_memory=args.kv_cross_memory,
        kv_shared_memory=args.kv_shared_memory,
        kv_puts=args.kv_puts,
        tls=tls_config(args),
        standby=args.standby,
    )


# ---- foreground pieces --------------------------------------------------------------------------------


def cmd_router(args: argparse.Namespace) -> int:
    from pdserve.router.server import ListenError
    from pdserve.router.server import main as serve_router

    try:
        config = router_config(args)
    except ValueError as e:  # a setting out of range: one line, naming it
        print(f"pdserve router: {e}", file=sys.stderr)
        return 1
    try:
        serve_router(config)
    except ListenError as e:
        print(f"pdserve router: {e}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:
        # A model that does not resolve or load: one line for `up` to show, not a traceback.
        print(f"pdserve router: cannot serve model {args.model!r}: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    import importlib
    import os
    import socket

    if args.cpus is not None:
        try:
            os.sched_setaffinity(0, args.cpus)
        except (AttributeError, OSError) as e:
            print(f"pdserve worker: cannot pin to cpus {args.cpus}: {e}", file=sys.stderr)
            return 2
    if args.device != "cpu":
        from pdserve.engine.device import resolve_device

        try:
            resolve_device(args.device)  # no GPU, or not that one: one line, before anything starts
        except ValueError as e:
            print(f"pdserve worker: {e}", file=sys.stderr)
            return 2
    # The cores this process may run on (taskset, a container's cpuset), not the machine's.
    cpus = len(args.cpus) if args.cpus is not None else len(os.sched_getaffinity(0)) or 1
    try:
        wargs = worker_args(args, socket.gethostname(), os.getpid(), cpus)
    except ValueError as e:  # e.g. a --host no interface of this machine carries
        print(f"pdserve worker: {e}", file=sys.stderr)
        return 2
    module_name = args.worker_module or POOL_MODULES[wargs.role]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        print(
            f"pdserve worker: the {wargs.role.value} pool ({module_name}) is not available: {e}",
            file=sys.stderr,
        )
        return 2
    import torch
    import uvloop

    # Set before the model loads: every worker shares the machine's cores with the others.
    torch.set_num_threads(wargs.threads)
    from pdserve.worker.agent import RegistrationError
    from pdserve.worker.bringup import WorkerFailed

    code = 0
    try:
        uvloop.run(module.serve(wargs))
    except (WorkerFailed, RegistrationError) as e:
        # One line: the message says it all (a refusal names the flags to match); a failed worker's
        # cause is in its log. A supervisor restarts on the exit status.
        print(f"pdserve worker: {e}", file=sys.stderr)
        code = 1
    _exit_now(code)


def _exit_now(code: int) -> NoReturn:
    """End a worker whose serve loop is over (its servers, transfers and loops closed, its KV cache a
    memfd the kernel frees) without the interpreter's teardown: collecting torch's modules took a
    second after every drain, and a scale-down or ``down`` waited for it."""
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---- the local cluster --------------------------------------------------------------------------------


def _router_address(args: argparse.Namespace) -> str:
    if getattr(args, "router", None):
        return args.router
    return _state(args).router_address


def _state(args: argparse.Namespace) -> cluster.ClusterState:
    """The local cluster these client commands talk to (its router must run)."""
    state = cluster.load_state(args.state_dir)
    if state is None:
        raise cluster.ClusterError(
            f"no cluster in {args.state_dir} (run `pdserve up` there first, or pass --router)"
        )
    if not cluster.alive(state.router):
        raise cluster.ClusterError(
            f"the router of the cluster in {args.state_dir} (pid {state.router.pid}) has exited: "
            "`pdserve down`, then `pdserve up` again"
        )
    return state


def _router_tls(args: argparse.Namespace) -> TLSConfig:
    """How to call the router: the TLS flags when given (or with --router), else the cluster's own."""
    if args.router or args.tls_cert or args.tls_ca:
        return tls_config(args)
    return cluster.state_tls(_state(args))


def cmd_status(args: argparse.Namespace) -> int:
    address = _router_address(args)
    token = cluster_token(args) if args.router else cluster.state_token(_state(args))
    doc = client.status_dict(cluster.cluster_status(address, token=token, tls=_router_tls(args)))
    state = None if args.router else _state(args)
    if state is not None:
        # Workers this cluster started whose process runs but the router does not list (loading, hung,
        # or dropped for missed heartbeats): the router's list alone hid them.
        # And those whose process is gone (crashed, killed): the router forgot them, the state file still
        # counts them, and `scale` would drop them; without a row the pool just looked smaller.
        listed = {w["id"] for w in doc["workers"]}
        doc["unregistered"], doc["exited"] = [], []
        for w in state.workers:
            if w.id not in listed:
                row = {"id": w.id, "role": w.role.value if w.role else "unknown", "pid": w.pid}
                row["device"] = w.device or "cpu"
                if cluster.alive(w):
                    doc["unregistered"].append(row)
                else:
                    doc["exited"].append({**row, "log": w.log})
    scaler = None if state is None else cluster_cmds.autoscaler_status(state, args.state_dir)
    if scaler is not None:
        doc["autoscaler"] = scaler
    table = client.status_table(doc) + (
        "" if scaler is None else "\n" + cluster_cmds.autoscaler_table(scaler)
    )
    print(json.dumps(doc, indent=2) if args.json else table, flush=True)
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    """The router stops sending the worker requests and tells it to drain; the worker finishes what it
    has in flight, deregisters and exits. Returns once it is gone from the router's list (0: drained, or
    dropped for missed heartbeats, which the router's list does not tell apart), or 1 when ``--timeout``
    passes first."""
    import time

    address = _router_address(args)
    token = cluster_token(args) if args.router else cluster.state_token(_state(args))
    tls = _router_tls(args)
    if not cluster.drain_worker(address, args.worker_id, token, tls):
        cluster_cmds.say(f"{args.worker_id} is not registered with the router at {address}: nothing to drain")
        return 0
    cluster_cmds.say(f"draining {args.worker_id}")
    give_up = time.monotonic() + args.timeout
    while any(
        e.info.worker_id == args.worker_id
        for e in cluster.cluster_status(address, token=token, tls=tls).workers
    ):
        if time.monotonic() > give_up:
            cluster_cmds.say(f"{args.worker_id} still registered after {args.timeout:.0f}s")
            return 1
        time.sleep(0.5)
    # (The router also drops a worker that stops answering heartbeats while draining: a hung one. If that
    # process comes back, it registers straight into its drain: router/registry.py.)
    cluster_cmds.say(f"{args.worker_id} has left the router (drained, or dropped for missed heartbeats)")
    if not args.router:
        cluster_cmds.forget_worker(args.state_dir, args.worker_id)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    for what, text in (("the prompt", args.prompt), *(("a --stop string", s) for s in args.stop)):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # argv bytes that are not UTF-8 (Python keeps them as surrogates)
            cluster_cmds.say(f"pdserve generate: {what} is not valid UTF-8 text")
            return 2
    req = client.build_request(
        args.prompt,
        chat=args.chat,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
    )
    client.print_stream(
        client.stream(_router_address(args), req, args.timeout or None, _router_tls(args)),
        sys.stdout,
        sys.stderr,
        args.json,
    )
    return 0


COMMANDS = {
    "up": cluster_cmds.cmd_up,
    "scale": cluster_cmds.cmd_scale,
    "autoscale": cluster_cmds.cmd_autoscale,
    "status": cmd_status,
    "generate": cmd_generate,
    "drain": cmd_drain,
    "down": cluster_cmds.cmd_down,
    "router": cmd_router,
    "worker": cmd_worker,
    "bench": cmd_bench,
}
# Commands that run until stopped: they stop with the process PDSERVE_EXIT_WITH_PID names (cli.lifeline).
LONG_RUNNING = ("router", "worker", "autoscale")


def main(argv: list[str] | None = None) -> int:
    from pdserve.worker.auth import TokenError

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.command == "bench" and args.bench_mode:
        _options_follow_the_mode(parser, argv, args.bench_mode)
    if args.command == "up":
        try:  # what the router would refuse seconds later, once everything started: here, naming the flags
            RouterConfig(
                heartbeat_interval_s=args.heartbeat_interval, heartbeat_timeout_s=args.heartbeat_timeout
            )
        except ValueError as e:
            parser.error(str(e))
    if args.command in ("router", "worker"):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command in LONG_RUNNING:
        try:
            parent = lifeline.exit_with_pid()
        except ValueError as e:
            cluster_cmds.say(f"pdserve {args.command}: {e}")
            return 2
        if parent is not None:
            lifeline.start_lifeline(parent, what=f"pdserve {args.command}")
    try:
        if args.command in ("router", "worker"):
            cluster_token(args)  # a bad token file fails here, in one line, before anything starts
            tls_config(args).check_server()  # and bad TLS files
        return COMMANDS[args.command](args)
    except (TokenError, TLSError) as e:
        cluster_cmds.say(f"pdserve {args.command}: {e}")
        return 2
    except cluster.ClusterError as e:
        cluster_cmds.say(f"pdserve {args.command}: {e}")
        return 1
    except grpc.RpcError as e:
        cluster_cmds.say(f"pdserve {args.command}: {e.code().name}: {e.details()}{_tls_hint(args, e)}")
        return 1
    except OSError as e:
        if args.command in LONG_RUNNING:
            raise  # a server's own fault: its traceback, in its log
        # The state dir read-only, full or a file: one line naming the path, as the other errors.
        cluster_cmds.say(f"pdserve {args.command}: {e}")
        return 1
    except KeyboardInterrupt:  # Ctrl-C: what the command started is stopped on the way out (its finally)
        cluster_cmds.say(f"pdserve {args.command}: interrupted")
        return 130


def _tls_hint(args: argparse.Namespace, err: grpc.RpcError) -> str:
    """A router given by --router that closed the connection may serve TLS (or want a client
    certificate) that the flags did not give: gRPC says only "Socket closed"."""
    if not getattr(args, "router", None) or err.code() is not grpc.StatusCode.UNAVAILABLE:
        return ""
    if getattr(args, "tls_ca", None) is None:
        return " (if the router serves TLS, give its CA with --tls-ca)"
    if getattr(args, "tls_cert", None) is None:
        return " (if the router requires client certificates, give one with --tls-cert and --tls-key)"
    return ""


if __name__ == "__main__":
    sys.exit(main())
