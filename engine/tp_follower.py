"""A tensor-parallel follower rank (``engine.tensor_parallel``): started by rank 0, it loads its shard of
the model, hands rank 0 its KV cache (shared memory, on CPU), and makes each call rank 0 sends, until rank
0 closes the pipe or dies."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from pdserve.engine.config import ModelConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.tensor_parallel import (
    COLLECTIVE_TIMEOUT,
    GroupBackend,
    RankPlacement,
    ShardLayout,
    TensorParallel,
    hand_over_cache,
    host_collectives,
    make_group,
)


def follow(runner: ModelRunner, pipe: Connection) -> None:
    """A follower's life: make each call rank 0 sends, until the pipe closes."""
    while True:
        try:
            name, args, kwargs = pipe.recv()
        except (EOFError, OSError):
            return
        getattr(runner, name)(*args, **kwargs)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent (rank 0) dies, however it dies."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="A tensor-parallel follower rank (started by rank 0).")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--store-port", type=int, required=True)
    ap.add_argument("--pipe-fd", type=int, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runner", required=True, help="ModelRunner keyword arguments, as JSON")
    ap.add_argument("--backend", choices=[b.value for b in GroupBackend], default="gloo")
    ap.add_argument("--devices", default="", help="every rank's device, comma-separated (default: cpu)")
    ap.add_argument("--host-channels", default="", help="CPU: the shared collectives' fds (engine.tp_host)")
    args = ap.parse_args(argv)
    _die_with_parent()
    if os.getppid() == 1:
        return 1  # rank 0 died before prctl took
    torch.set_num_threads(args.threads)
    pipe = Connection(args.pipe_fd)
    store = dist.TCPStore("127.0.0.1", args.store_port, args.size, False, timeout=COLLECTIVE_TIMEOUT)
    kwargs = json.loads(args.runner)
    model_dir = kwargs.pop("model_dir")
    config = ModelConfig.from_dir(model_dir)
    layout = ShardLayout.of(config, args.rank, args.size)
    devices = args.devices.split(",") if args.devices else ["cpu"] * args.size
    placement = RankPlacement(tuple(torch.device(d) for d in devices), GroupBackend(args.backend))
    host = host_collectives(args.rank, args.size, args.host_channels) if args.host_channels else None
    tp = TensorParallel(layout, make_group(store, args.rank, placement), placement=placement, host=host)
    tp.store = store
    if "dtype" in kwargs:
        kwargs["dtype"] = getattr(torch, kwargs["dtype"])
    runner = ModelRunner(model_dir, tensor_parallel=tp, kv_shared=True, **kwargs)
    if runner.kv_shared_fd is not None:  # (on CUDA rank 0 maps no follower's cache: no KV transfer there)
        hand_over_cache(pipe, runner.kv_shared_fd)
    follow(runner, pipe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
