"""Overload with and without the TTFT budget, side by side in one run: ``python -m benchmarks.overload``.

A 1P+1D cluster is offered about three times the prefill it can do (1,024-token prompts, no shared prefix,
at 2 requests/s for 20 s, 8 output tokens each), once as is and once with ``--admission-ttft-s 5``. For
each run: requests served and refused, p99 TTFT of the served, the slowest refusal (from sending to the
error), and what the cluster could prefill in the window plus the budget (its measured prefill rate, from the
prefill worker's metrics, times that time, over the prompt length). The budget's run passes when every
served request's TTFT is under the budget at p99, every refusal came within 100 ms, and it served at least
80% of that capacity. Both clusters are stopped whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench.machine import machine_info
from pdserve.bench.report import emit_json
from pdserve.proto import generation_pb2, generation_pb2_grpc


def _pdserve(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    if out.returncode != 0:
        raise RuntimeError(f"pdserve {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}")
    return out.stdout


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 40000, length).tolist() for _ in range(n)]


async def _one(stub, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    req = generation_pb2.GenerateRequest(prompt_token_ids=generation_pb2.TokenIds(ids=prompt))
    req.sampling.max_tokens, req.sampling.temperature, req.sampling.ignore_eos = max_tokens, 0.0, True
    t0 = time.perf_counter()
    ttft = None
    try:
        async for m in stub.Generate(req, timeout=600):
            if ttft is None and m.token_ids:
                ttft = time.perf_counter() - t0
        return {"outcome": "served", "ttft_s": ttft}
    except grpc.aio.AioRpcError as e:
        return {"outcome": e.code().name, "after_s": time.perf_counter() - t0, "details": e.details()[:200]}


async def _offer(address: str, prompts: list[list[int]], rate: float, max_tokens: int) -> list[dict]:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        tasks = []
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
            tasks.append(asyncio.create_task(_one(stub, prompt, max_tokens)))
        return list(await asyncio.gather(*tasks))


def _prefill_rate(state_dir: Path) -> float:
    """Prompt tokens per second of the prefill worker's forwards so far (its metrics)."""
    status = json.loads(_pdserve("status", "--json", "--state-dir", str(state_dir)))
    (p,) = [w for w in status["workers"] if w["role"] == "prefill"]
    with urllib.request.urlopen(p["metrics_url"], timeout=10) as resp:
        text = resp.read().decode()
    values = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    return values["pdserve_prefill_tokens_total"] / values["pdserve_prefill_time_seconds_sum"]


def _summary(results: list[dict], budget_s: float, capacity: float) -> dict[str, Any]:
    served = [r["ttft_s"] for r in results if r["outcome"] == "served"]
    refused = [r["after_s"] for r in results if r["outcome"] == "RESOURCE_EXHAUSTED"]
    other = [r for r in results if r["outcome"] not in ("served", "RESOURCE_EXHAUSTED")]
    out: dict[str, Any] = {
        "offered": len(results),
        "served": len(served),
        "refused": len(refused),
        "failed_otherwise": len(other),
        "ttft_p50_s": float(np.percentile(served, 50)) if served else None,
        "ttft_p99_s": float(np.percentile(served, 99)) if served else None,
        "slowest_refusal_ms": 1000 * max(refused) if refused else None,
        "served_over_capacity": len(served) / capacity if capacity else None,
        "other_failures": sorted({f"{r['outcome']}: {r['details']}" for r in other})[:5],
    }
    if budget_s:
        out["checks"] = {
            "ttft_p99_under_budget": bool(served) and out["ttft_p99_s"] < budget_s,
            "refusals_within_100ms": all(t < 0.1 for t in refused),
            "served_at_least_80pct_of_capacity": len(served) >= 0.8 * capacity,
            "nothing_else_failed": not other,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.overload", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--rate", type=float, default=2.0, help="requests per second")
    p.add_argument("--seconds", type=float, default=20.0, help="how long requests arrive")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--budget", type=float, default=5.0, help="--admission-ttft-s of the second run")
    p.add_argument("--port", type=int, default=50181)
    args = p.parse_args(argv)

    n = int(args.rate * args.seconds)
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-bench-overload-"))
    runs: dict[str, Any] = {}
    for name, budget in (("no_budget", 0.0), ("budget", args.budget)):
        sd = tmp / name
        up = [
            "up",
            "--prefill",
            "1",
            "--decode",
            "1",
            "--colocated",
            "0",
            "--port",
            str(args.port),
            "--no-http",
        ]
        up += ["--dtype", args.dtype, "--threads", str(args.threads), "--state-dir", str(sd)]
        if budget:
            up += ["--admission-ttft-s", str(budget)]
        try:
            _pdserve(*up)
            address = f"127.0.0.1:{args.port}"
            # Warm up (first forward, the transfer's handshake) and let the prefill worker measure its rate.
            asyncio.run(_offer(address, _prompts(2, args.prompt_len, 999), 1.0, 2))
            t0 = time.perf_counter()
            results = asyncio.run(
                _offer(address, _prompts(n, args.prompt_len, 7), args.rate, args.max_tokens)
            )
            elapsed = time.perf_counter() - t0
            rate = _prefill_rate(sd)
        finally:
            subprocess.run(
                [sys.executable, "-m", "pdserve.cli", "down", "--state-dir", str(sd)],
                capture_output=True,
                timeout=120,
                stdin=subprocess.DEVNULL,
            )
        capacity = rate * (args.seconds + args.budget) / args.prompt_len
        runs[name] = {
            "admission_ttft_s": budget,
            "elapsed_s": elapsed,
            "prefill_tokens_per_s": rate,
            "capacity_requests": capacity,
            **_summary(results, budget, capacity),
        }
    result = {
        "command": "python -m benchmarks.overload " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {**machine_info(), "threads_per_worker": args.threads},
        "workload": {
            "prompt_len": args.prompt_len,
            "rate_per_s": args.rate,
            "seconds": args.seconds,
            "requests": n,
            "max_tokens": args.max_tokens,
            "dtype": args.dtype,
            "offered_over_capacity": n
            / (runs["no_budget"]["prefill_tokens_per_s"] * args.seconds / args.prompt_len),
        },
        "runs": runs,
        "pass": all(runs["budget"]["checks"].values()),
    }
    emit_json(result, args.out)
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
