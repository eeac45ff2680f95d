"""What moving KV between tensor-parallel groups of different sizes costs beyond the writes themselves: the
writer's packing and the receiver's unpacking (``kv_transfer.tp_pack``), side by side with one plain copy
of the same bytes, in one run:

    python -m benchmarks.tp_pack [--tokens 1024] [--reps 9] [--dtype bfloat16] [--out FILE]

SmolLM2-135M's KV layout (30 layers, 3 KV heads, head dim 64, block 16), one torch thread. For each pair of
group sizes (prefill ranks -> decode ranks) it times, median of ``--reps``: packing every piece of every
layer (the source blocks contiguous), unpacking every destination rank that got packed runs (the
destination blocks in runs of 4), and a copy of the request's whole KV (every byte once: what moving it
costs at the least). The attention kernels are untouched by this scheme: it costs these copies only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from pdserve.bench.machine import machine_info
from pdserve.bench.report import emit_json
from pdserve.kv_transfer.testing.spec import head_split
from pdserve.kv_transfer.tp_pack import pack, unpack_received
from pdserve.kv_transfer.tp_plan import needs_unpack, pieces

LAYERS, HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16
SIZES = ((3, 1), (1, 3), (3, 3), (6, 1))  # (6: each KV head on two prefill ranks)


def _median_s(fn: Any, reps: int) -> float:
    fn()  # warm-up: first touch of every page
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _row(p: int, d: int, n: int, reps: int, dtype: torch.dtype) -> dict[str, Any]:
    src_blocks = list(range(n))
    dst_blocks = [b for b in range(2 * n) if b % 5 != 4][:n]  # runs of 4
    src_heads, dst_heads = head_split(HEADS, p), head_split(HEADS, d)
    plan = pieces(src_heads, dst_heads)
    src = [torch.randn(LAYERS, n, 2, BLOCK, len(h), HEAD_DIM).to(dtype) for h in src_heads]
    dst = [torch.zeros(LAYERS, 2 * n, 2, BLOCK, len(h), HEAD_DIM, dtype=dtype) for h in dst_heads]
    whole = torch.randn(LAYERS, n, 2, BLOCK, HEADS, HEAD_DIM).to(dtype)
    into = torch.empty_like(whole)

    def pack_all() -> None:
        for layer in range(LAYERS):
            for piece in plan:
                if not piece.direct:
                    pack(src[piece.src_rank], layer, src_blocks, piece)

    copy_s = _median_s(lambda: into.copy_(whole), reps)
    pack_s = _median_s(pack_all, reps) if not all(q.direct for q in plan) else 0.0
    packed_ranks = any(needs_unpack(plan, j) for j in range(d))
    unpack = lambda: unpack_received(dst, plan, dst_blocks, LAYERS)  # noqa: E731
    unpack_s = _median_s(unpack, reps) if packed_ranks else 0.0
    return {
        "prefill_ranks": p,
        "decode_ranks": d,
        "pieces_per_layer": len(plan),
        "packed_pieces_per_layer": sum(not q.direct for q in plan),
        "kv_bytes": whole.numel() * whole.element_size(),
        "copy_ms": round(copy_s * 1e3, 3),
        "pack_ms": round(pack_s * 1e3, 3),
        "unpack_ms": round(unpack_s * 1e3, 3),
        "pack_vs_copy": round(pack_s / copy_s, 2),
        "unpack_vs_copy": round(unpack_s / copy_s, 2),
    }


def measure(tokens: int, reps: int, dtype: torch.dtype) -> list[dict[str, Any]]:
    n = -(-tokens // BLOCK)
    rows = []
    for p, d in SIZES:
        rows.append(_row(p, d, n, reps, dtype))
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = measure(args.tokens, args.reps, getattr(torch, args.dtype))
    doc = {
        "benchmark": "tp_pack",
        "command": "python -m benchmarks.tp_pack " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {**machine_info(), "threads": 1},
        "layout": {"layers": LAYERS, "kv_heads": HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK},
        "tokens": args.tokens,
        "dtype": args.dtype,
        "rows": rows,
    }
    emit_json(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
