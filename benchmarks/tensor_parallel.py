"""A tensor-parallel engine's decode on one host's CPUs, side by side with one process, in one run:

    python -m benchmarks.tensor_parallel [--sizes 3] [--steps 64] [--rounds 3] [--out FILE]

SmolLM2-135M-Instruct in float32, one torch thread per rank, greedy ``--steps`` tokens for two prompts (9
and 27 tokens). For each size it times the generation (after a warm-up) of one process, and of the group
with its collectives through shared memory (the default, ``engine.tp_host``) and through gloo's loopback
(``PDSERVE_TP_COLLECTIVES=gloo``), the engines in turn, the order reversed every other round; median of
``--rounds``. A group of more ranks than the host has cores shares them: what is measured is the
collectives' cost, not a speed-up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from pdserve.bench.machine import machine_info
from pdserve.bench.report import emit_json

PROMPTS = [[1, 9690, 198, 2683, 359, 253, 5356, 5646, 30] * k for k in (1, 3)]


def _log(msg: str) -> None:
    print(f"[tensor_parallel] {msg}", file=sys.stderr, flush=True)


def _engine(size: int, collectives: str) -> Any:
    from pdserve.engine import LLM

    os.environ["PDSERVE_TP_COLLECTIVES"] = collectives  # read when the group starts
    return LLM(dtype="float32", threads=1, num_blocks=64, tensor_parallel_size=size)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="3", help="tensor-parallel sizes, comma-separated (default 3)")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here (default: stdout only)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    from pdserve.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.steps, ignore_eos=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    engines = {"one process": _engine(1, "shared")}
    for n in sizes:
        for collectives in ("shared", "gloo"):
            engines[f"tp{n} {collectives}"] = _engine(n, collectives)
    os.environ.pop("PDSERVE_TP_COLLECTIVES", None)
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list[list[int]]] = {}
    try:
        for llm in engines.values():  # warm-up
            llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        for rnd in range(args.rounds):
            order = list(engines.items())
            if rnd % 2:
                order.reverse()
            for name, llm in order:
                t0 = time.perf_counter()
                got = llm.generate(PROMPTS, params, use_tqdm=False)
                seconds[name].append(time.perf_counter() - t0)
                outputs[name] = [o.outputs[0].token_ids for o in got]
            _log(f"round {rnd}: " + ", ".join(f"{n} {s[-1]:.2f} s" for n, s in seconds.items()))
    finally:
        for llm in engines.values():
            llm.engine.close()
    one = statistics.median(seconds["one process"])
    results = {
        name: {
            "seconds_median": round(statistics.median(s), 3),
            "seconds": [round(x, 3) for x in s],
            "ms_per_step": round(statistics.median(s) / args.steps * 1e3, 2),
            "vs_one_process": round(statistics.median(s) / one, 3),
            "same_tokens_as_one_process": outputs[name] == outputs["one process"],
        }
        for name, s in seconds.items()
    }
    for n in sizes:
        shared, gloo = results[f"tp{n} shared"], results[f"tp{n} gloo"]
        shared["gloo_over_shared"] = round(gloo["seconds_median"] / shared["seconds_median"], 2)
    doc = {
        "benchmark": "tensor_parallel",
        "command": "python -m benchmarks.tensor_parallel " + " ".join(argv or sys.argv[1:]),
        "machine": machine_info(),
        "model": "smollm2-135m-instruct",
        "dtype": "float32",
        "threads_per_rank": 1,
        "prompts_tokens": [len(p) for p in PROMPTS],
        "steps": args.steps,
        "results": results,
    }
    emit_json(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
