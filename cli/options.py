"""The command line's option parsing parts: argparse value types, and the option groups several subcommands
share (state dir, model, device, cluster token, TLS, router and worker tuning)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path

from pdserve.cli.common import TOKEN_FILE_VAR
from pdserve.engine.device import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEVICE_HELP,
    DTYPE_CHOICES,
    check_device,
    check_gpu_memory_utilization,
)
from pdserve.engine.quant import QUANTIZATIONS
from pdserve.router.config import DEFAULT_MODEL, RouterConfig
from pdserve.worker.args import KV_PUTS, WorkerArgs

DEFAULT_STATE_DIR = ".pdserve"


def nonneg(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an int in [low, high] (what the request's proto field holds)."""

    def parse(text: str) -> int:
        n = int(text)
        if not low <= n <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {n}")
        return n

    return parse


def seconds(positive: bool) -> Callable[[str], float]:
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


def device_args(p: argparse.ArgumentParser, command: str) -> None:
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


def state_dir_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--state-dir",
        type=Path,
        default=Path(DEFAULT_STATE_DIR),
        help=f"where `up` keeps the cluster's state file and logs (default ./{DEFAULT_STATE_DIR})",
    )


def model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="model name or path (default: %(default)s)")
    p.add_argument(
        "--cache-dir", type=Path, default=None, help="model cache (default: $PDSERVE_CACHE_DIR or user cache)"
    )


def token_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cluster-token-file",
        type=Path,
        default=None,
        help=f"the cluster token the router requires of workers and the CLI (default: ${TOKEN_FILE_VAR}; "
        "none: an open control plane). `up` makes one per cluster.",
    )


def tls_args(p: argparse.ArgumentParser, server: bool) -> None:
    if server:
        cert = "serve gRPC over TLS with this certificate (PEM; also HTTPS on --http-port) and present it "
        ca = "mutual TLS: require peers' certificates signed by this CA (PEM), and check peers against it"
    else:
        cert = "present this client certificate (PEM) to a router that requires one (mutual TLS)"
        ca = "call the router over TLS, checking it against this CA (PEM)"
    p.add_argument("--tls-cert", type=Path, default=None, help=cert + " (default: plain gRPC)")
    p.add_argument("--tls-key", type=Path, default=None, help="the private key of --tls-cert (PEM)")
    p.add_argument("--tls-ca", type=Path, default=None, help=ca)


def router_tuning(p: argparse.ArgumentParser) -> None:
    d = RouterConfig()
    p.add_argument("--max-waiting", type=nonneg, default=d.max_waiting, help="router queue bound")
    p.add_argument(
        "--max-migrations",
        type=nonneg,
        default=d.max_migrations,
        help="times a stream moves to a healthy worker when its worker fails (0: never; default %(default)s)",
    )
    p.add_argument(
        "--max-prefill-queue-tokens",
        type=nonneg,
        default=d.max_prefill_queue_tokens,
        help="prompt tokens queued on one prefill worker beyond which new requests are refused at once "
        "(RESOURCE_EXHAUSTED; 0: no bound; default %(default)s)",
    )
    p.add_argument(
        "--queue-timeout",
        type=seconds(True),
        default=d.queue_timeout_s,
        help="seconds a request may wait in the router's queue for a decode worker with room, then "
        "UNAVAILABLE (HTTP 503)",
    )
    p.add_argument(
        "--local-prefill-threshold",
        type=nonneg,
        default=d.local_prefill_threshold,
        help="prompts shorter than this many tokens prefill on the decode worker",
    )
    p.add_argument(
        "--heartbeat-interval",
        type=seconds(True),
        default=d.heartbeat_interval_s,
        help="seconds between workers' heartbeats",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=seconds(True),
        default=d.heartbeat_timeout_s,
        help="seconds without a heartbeat after which a worker is dropped and its requests move",
    )
    p.add_argument(
        "--request-timeout",
        type=seconds(False),
        default=d.request_timeout_s,
        help="deadline for requests that set none (0: none)",
    )
    p.add_argument(
        "--metrics-port",
        type=int_in(0, 65535),
        default=d.metrics_port,
        help="the router's /metrics port (0: any)",
    )
    p.add_argument(
        "--http-port",
        type=int_in(0, 65535),
        default=None,
        help="serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions) on this port "
        "(0: a free one; default: off)",
    )


def worker_tuning(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-size", type=positive, default=16, help="tokens per KV block")
    p.add_argument(
        "--kv-blocks", type=nonneg, default=0, help="KV cache blocks (0: from --kv-cache-mib or default)"
    )
    p.add_argument(
        "--kv-cache-mib", type=nonneg, default=0, help="KV cache size in MiB (0: the engine default)"
    )
    p.add_argument("--max-running", type=positive, default=64, help="decode batch bound")
    p.add_argument(
        "--max-batched-tokens",
        type=positive,
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
        type=seconds(True),
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
