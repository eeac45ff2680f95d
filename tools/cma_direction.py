"""Cross-memory copies between two processes of this host, by direction: what bounds one-host KV writes.

    python -m tools.cma_direction [--layers 30] [--layer-kib 768] [--reps 31] [--out FILE]

pdserve's one-host sender writes the decode worker's KV (``process_vm_writev``), UCX's shared-memory
rendezvous reads (``process_vm_readv``), and some kernels copy one way much slower. ``ratio``: read / write.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

from pdserve.bench.report import emit_json
from pdserve.kv_transfer.writers import cma


def _buffer(nbytes: int) -> Any:
    import torch

    from pdserve.engine.hugepages import zeros_huge_pages

    t = zeros_huge_pages(nbytes, dtype=torch.uint8)
    t.fill_(1)  # touched: no page faults in the timed part
    return t


def _hold(nbytes: int, conn: Any) -> None:
    """The peer: a buffer, its address sent, kept until told to go."""
    buf = _buffer(nbytes)
    conn.send((os.getpid(), buf.data_ptr()))
    conn.recv()


def _median_s(fn: Callable[[], None], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(layers: int, layer_bytes: int, reps: int) -> dict[str, Any]:
    total = layers * layer_bytes
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_hold, args=(total, child), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise RuntimeError("the peer process did not start")
        pid, remote = parent.recv()
        buf = _buffer(total)  # kept: the copies read and write its memory
        local = buf.data_ptr()
        libc = cma._libc()
        rows: dict[str, Any] = {}
        for name, fn in (("write", libc.process_vm_writev), ("read", libc.process_vm_readv)):

            def per_layer(fn: Any = fn) -> None:
                for i in range(layers):
                    at = i * layer_bytes
                    if cma._call(fn, pid, local + at, remote + at, layer_bytes) != layer_bytes:
                        raise OSError(f"short or failed {fn.__name__}")

            def whole(fn: Any = fn) -> None:
                if cma._call(fn, pid, local, remote, total) != total:
                    raise OSError(f"short or failed {fn.__name__}")

            per_layer()  # warm-up
            rows[name] = {
                "per_layer_ms": round(_median_s(per_layer, reps) * 1e3, 3),
                "one_call_ms": round(_median_s(whole, reps) * 1e3, 3),
            }
        for key in ("per_layer_ms", "one_call_ms"):
            gbps = {d: round(total / rows[d][key] / 1e6, 2) for d in ("write", "read")}
            rows[key.replace("_ms", "_gbps")] = gbps
            rows[key.replace("_ms", "_ratio")] = round(rows["read"][key] / rows["write"][key], 3)
        return rows
    finally:
        parent.send("go")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(10)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--layer-kib", type=int, default=768)
    parser.add_argument("--reps", type=int, default=31)
    parser.add_argument("--out", help="write the JSON report here too")
    args = parser.parse_args(argv)
    if args.layers < 1 or args.layer_kib < 1 or args.reps < 1:
        parser.error("--layers, --layer-kib and --reps must be >= 1")
    if not cma.host_identity():
        parser.error("no /proc here: cross-memory copies are not available")
    from pdserve.bench.machine import machine_info

    report = {
        "machine": {**machine_info(), "kernel": platform.release()},
        "layers": args.layers,
        "layer_bytes": args.layer_kib << 10,
        "reps": args.reps,
        **measure(args.layers, args.layer_kib << 10, args.reps),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    emit_json(report, args.out)


if __name__ == "__main__":
    main()
