"""The option groups several subcommands share: state dir, model, cluster token, TLS, and the cluster-wide
device flags of ``up`` and ``scale`` (the worker's and router's own: ``worker.flags``, ``router_flags``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pdserve.cli.common import TOKEN_FILE_VAR
from pdserve.engine.device import DEFAULT_GPU_MEMORY_UTILIZATION, DEVICE_HELP
from pdserve.router.config import DEFAULT_MODEL
from pdserve.worker.flagspec import device, fraction

DEFAULT_STATE_DIR = ".pdserve"


def cluster_device_args(p: argparse.ArgumentParser, command: str) -> None:
    """--device and --gpu-memory-utilization as ``up`` takes them for every worker it starts, or ``scale``
    for the new ones (its default: as the cluster was started). ``worker``'s own are in ``worker.flags``."""
    if command == "scale":
        device_help = f"where the new workers run: {DEVICE_HELP} (default: as the cluster was started)"
        util_help = "the share of the GPU's memory each new worker may use (default: what `up` gave each)"
    else:
        device_help = f"where every worker runs: {DEVICE_HELP} (default: cpu); all of them share the GPU"
        util_help = (
            "the share of the GPU's memory each worker may use, its weights and KV cache included, as "
            f"vLLM means it (default: {DEFAULT_GPU_MEMORY_UTILIZATION} shared evenly among the workers "
            "`up` starts on the GPU); ignored on CPU"
        )
    p.add_argument("--device", type=device, default=None if command == "scale" else "cpu", help=device_help)
    p.add_argument(
        "--gpu-memory-utilization", type=fraction, default=None, metavar="FRACTION", help=util_help
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
