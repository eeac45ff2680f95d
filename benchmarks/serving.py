"""Serving-path figures, measured side by side in one run: ``python -m benchmarks.serving [--out FILE]``.

TTFT through 1P+1D against one colocated worker, and the inter-token latency the router adds; both
clusters are stopped when the run ends, whatever happens. Details: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch

from pdserve.bench.machine import machine_info
from pdserve.bench.report import emit_json
from pdserve.deploy.local.cluster import load_state, state_token
from pdserve.proto import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.worker.auth import token_metadata


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


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


def _stream_times(call) -> tuple[list[float], list[int]]:
    """Arrival time of every token of a stream (a message of k tokens: k arrivals at its time)."""
    times: list[float] = []
    ids: list[int] = []
    for m in call:
        now = time.perf_counter()
        ids.extend(m.token_ids)
        times.extend([now] * len(m.token_ids))
    return times, ids


def ttft_once(address: str, prompt: list[int]) -> float:
    with grpc.insecure_channel(address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        req = generation_pb2.GenerateRequest(prompt_token_ids=generation_pb2.TokenIds(ids=prompt))
        req.sampling.max_tokens = 2
        req.sampling.temperature = 0.0
        t0 = time.perf_counter()
        for m in stub.Generate(req, timeout=300):
            if m.token_ids:
                return (time.perf_counter() - t0) * 1000
    raise RuntimeError("stream ended without a token")


def itl_via_router(address: str, prompt: list[int], n: int) -> list[float]:
    with grpc.insecure_channel(address) as ch:
        req = generation_pb2.GenerateRequest(prompt_token_ids=generation_pb2.TokenIds(ids=prompt))
        req.sampling.max_tokens, req.sampling.temperature, req.sampling.ignore_eos = n, 0.0, True
        times, _ = _stream_times(generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=300))
    return [(b - a) * 1000 for a, b in zip(times[1:], times[2:], strict=False)]


def itl_direct(worker_address: str, prompt: list[int], n: int, rid: str, token: str = "") -> list[float]:
    with grpc.insecure_channel(worker_address) as ch:
        s = generation_pb2.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        req = worker_pb2.WorkerGenerateRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=s, mode=worker_pb2.PREFILL_MODE_LOCAL
        )
        call = worker_pb2_grpc.WorkerStub(ch).Generate(req, timeout=300, metadata=token_metadata(token))
        times, _ = _stream_times(call)
    return [(b - a) * 1000 for a, b in zip(times[1:], times[2:], strict=False)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--threads", type=int, default=2, help="torch threads per worker, the same in both shapes")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--itl-tokens", type=int, default=96)
    args = p.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="pdserve-bench-serving-"))
    shapes = {
        "disaggregated": [
            "--prefill",
            "1",
            "--decode",
            "1",
            "--colocated",
            "0",
            "--port",
            "50171",
            "--local-prefill-threshold",
            "1",
        ],
        "colocated": ["--prefill", "0", "--decode", "0", "--colocated", "1", "--port", "50172"],
    }
    addr = {"disaggregated": "127.0.0.1:50171", "colocated": "127.0.0.1:50172"}
    started: list[Path] = []
    try:
        for name, extra in shapes.items():
            sd = tmp / name
            started.append(sd)
            _pdserve(
                "up",
                *extra,
                "--no-http",
                "--dtype",
                args.dtype,
                "--threads",
                str(args.threads),
                "--state-dir",
                str(sd),
            )
        status = json.loads(_pdserve("status", "--json", "--state-dir", str(tmp / "colocated")))
        worker_addr = status["workers"][0]["address"]
        # The worker takes calls only with the cluster token `up` made (worker.auth).
        state = load_state(tmp / "colocated")
        assert state is not None
        token = state_token(state)
        # Warm both paths (first forward, UCX endpoint, handshake).
        for name in shapes:
            ttft_once(addr[name], _prompt(args.prompt_len, 999))
        ttft: dict[str, list[float]] = {n: [] for n in shapes}
        for r in range(args.rounds):
            order = list(shapes) if r % 2 == 0 else list(reversed(shapes))
            for name in order:
                ttft[name].append(ttft_once(addr[name], _prompt(args.prompt_len, r)))
        via, direct = [], []
        short = _prompt(32, 12345)
        for r in range(args.rounds):
            via += itl_via_router(addr["colocated"], short, args.itl_tokens)
            direct += itl_direct(worker_addr, short, args.itl_tokens, f"bench-direct-{r}", token)
    finally:
        for sd in started:
            subprocess.run(
                [sys.executable, "-m", "pdserve.cli", "down", "--state-dir", str(sd)],
                capture_output=True,
                timeout=120,
                stdin=subprocess.DEVNULL,
            )
    med = {n: statistics.median(v) for n, v in ttft.items()}
    result = {
        "machine": {**machine_info(), "threads_per_worker": args.threads},
        "dtype": args.dtype,
        "prompt_len": args.prompt_len,
        "ttft_ms": {n: {"median": med[n], "all": v} for n, v in ttft.items()},
        "ttft_ratio_pd_over_colocated": med["disaggregated"] / med["colocated"],
        "itl_ms": {
            "via_router_p50": statistics.median(via),
            "direct_p50": statistics.median(direct),
            "router_added_p50": statistics.median(via) - statistics.median(direct),
            "via_router_mean": statistics.fmean(via),
            "direct_mean": statistics.fmean(direct),
            "tokens": len(via),
        },
    }
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
