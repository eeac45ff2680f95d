"""Decode steps with the KV cache in shared memory (``--kv-shared-memory``) against anonymous huge pages.

    python -m tools.kv_shared_steps [--batch 32] [--prompt-len 600] [--dtype bfloat16] [--rounds 2]

Shared memory has huge pages only where ``shmem_enabled`` allows, and decode streams the cache every step;
the ratio is shared / anonymous (above 1: shared is slower).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from pdserve.bench.report import emit_json

STEPS = 24


def measure(model: str, batch: int, prompt_len: int, dtype: torch.dtype, rounds: int) -> dict[str, Any]:
    from benchmarks.engine_steps import runner_decode_steps
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.engine.registry import resolve_model

    path = resolve_model(model)
    blocks = batch * -(-(prompt_len + STEPS) // 16) + 8
    medians: dict[str, list[float]] = {"anonymous": [], "shared": []}
    for _ in range(rounds):
        for kind in medians:
            runner = ModelRunner(
                path, dtype=dtype, num_blocks=blocks, block_size=16, kv_shared=kind == "shared"
            )
            prompts = [list(range(10 + i, 10 + i + prompt_len)) for i in range(batch)]
            steps = runner_decode_steps(runner, prompts, STEPS)[3:]  # the first steps warm up
            medians[kind].append(round(statistics.median(steps) * 1e3, 3))
            del runner
    best = {kind: min(ms) for kind, ms in medians.items()}
    return {
        "step_ms": medians,
        "best_step_ms": best,
        "shared_over_anonymous": round(best["shared"] / best["anonymous"], 3),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=600)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", help="write the JSON report here too")
    args = parser.parse_args(argv)
    if min(args.batch, args.prompt_len, args.threads, args.rounds) < 1:
        parser.error("--batch, --prompt-len, --threads and --rounds must be >= 1")
    torch.set_num_threads(args.threads)
    from pdserve.bench.machine import machine_info
    from pdserve.engine.hugepages import shared_memory_huge_pages

    report = {
        "machine": {**machine_info(), "threads": args.threads},
        "shared_memory_huge_pages": shared_memory_huge_pages(),
        "model": args.model,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "dtype": args.dtype,
        **measure(args.model, args.batch, args.prompt_len, getattr(torch, args.dtype), args.rounds),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    emit_json(report, args.out)


if __name__ == "__main__":
    main()
