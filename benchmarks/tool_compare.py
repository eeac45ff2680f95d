"""``pdserve bench`` (gRPC) against a third-party OpenAI-API load tool (guidellm, HTTP) on one workload.

    python -m benchmarks.tool_compare --state-dir DIR [--input-len 128 --output-len 32 --num-prompts 16
                                 --concurrency 1 --rounds 2] [--save-result FILE]

Needs a cluster ``pdserve up --http-port PORT`` started (``make bench-openai`` does it all); see the README.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pdserve.bench.datasets import WorkloadConfig
from pdserve.bench.machine import machine_info
from pdserve.bench.serve import BenchConfig, BenchResult, run_benchmark

_Z95 = 1.96


@dataclass(frozen=True)
class Workload:
    input_len: int = 128
    output_len: int = 32
    num_prompts: int = 16  # measured requests per tool and round
    concurrency: int = 1
    rounds: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("input_len", "output_len", "num_prompts", "concurrency", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.output_len < 2:
            raise ValueError("output_len must be >= 2: ITL needs two tokens")


@dataclass(frozen=True)
class Samples:
    """One tool's measured requests (warmup excluded)."""

    ttft_ms: tuple[float, ...]
    itl_ms: tuple[float, ...]  # per request: mean gap between tokens
    prompt_tokens: tuple[int, ...]
    output_tokens: tuple[int, ...]
    failed: int = 0
    unreported: int = 0  # sent, but in none of the tool's report's lists (guidellm's end-of-run race)


@dataclass(frozen=True)
class Agreement:
    metric: str
    a_mean: float
    a_half_ci: float  # 95% interval of the mean: mean +- this
    b_mean: float
    b_half_ci: float
    diff: float  # b - a
    diff_half_ci: float  # 95% interval of the difference, from the spread of the samples
    round_spread: float  # the largest gap between two rounds' means of the same tool
    noise: float  # max(diff_half_ci, round_spread)
    ratio: float  # b / a
    agree: bool  # |diff| <= noise
    a_round_means: tuple[float, ...]
    b_round_means: tuple[float, ...]
    round_ratios: tuple[float, ...]  # b / a within each round: the two ran back to back, under one load
    n_a: int
    n_b: int


def _mean_and_se(xs: Sequence[float]) -> tuple[float, float]:
    mean = statistics.fmean(xs)
    se = statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else math.inf
    return mean, se


def _spread(means: Sequence[float]) -> float:
    return max(means) - min(means) if means else 0.0


def agreement(
    metric: str, a_rounds: Sequence[Sequence[float]], b_rounds: Sequence[Sequence[float]]
) -> Agreement:
    """Compare two tools' means, each measured in rounds.

    Two yardsticks of noise: the 95% interval of the difference (Welch: the
    standard errors add in quadrature), which sees the spread between requests;
    and the gap between rounds of one tool, which sees what the machine's load
    did between runs (the requests of one run share it, so the interval alone
    misses it on a shared machine). The tools agree when their difference is
    within the larger.
    """
    a = [x for r in a_rounds for x in r]
    b = [x for r in b_rounds for x in r]
    if not a or not b:
        raise ValueError(f"{metric}: both tools need measured requests (got {len(a)} and {len(b)})")
    a_mean, a_se = _mean_and_se(a)
    b_mean, b_se = _mean_and_se(b)
    diff, diff_half = b_mean - a_mean, _Z95 * math.hypot(a_se, b_se)
    a_means = tuple(statistics.fmean(r) for r in a_rounds if r)
    b_means = tuple(statistics.fmean(r) for r in b_rounds if r)
    spread = max(_spread(a_means), _spread(b_means))
    noise = max(diff_half, spread)
    return Agreement(
        metric=metric,
        a_mean=a_mean,
        a_half_ci=_Z95 * a_se,
        b_mean=b_mean,
        b_half_ci=_Z95 * b_se,
        diff=diff,
        diff_half_ci=diff_half,
        round_spread=spread,
        noise=noise,
        ratio=b_mean / a_mean if a_mean else math.nan,
        agree=abs(diff) <= noise,
        a_round_means=a_means,
        b_round_means=b_means,
        round_ratios=tuple(y / x if x else math.nan for x, y in zip(a_means, b_means, strict=False)),
        n_a=len(a),
        n_b=len(b),
    )


# ---- guidellm -----------------------------------------------------------------------------------------


def guidellm_requests(w: Workload) -> int:
    """What guidellm is asked to send: warmup, the measured requests, then a tail of ``concurrency``."""
    # The tail is never measured: guidellm 0.8 can end its run before the last request's update reaches
    # its report (its collector stops on a poll timeout once the scheduler counts every request done).
    return w.concurrency + w.num_prompts + w.concurrency


def guidellm_argv(
    exe: str, http_url: str, model: str, tokenizer_dir: Path, w: Workload, out: Path, seed: int
) -> list[str]:
    """guidellm 0.8's command for the workload: streaming completions, ``ignore_eos``, ``max_tokens``."""
    backend = f"kind=openai_http,target={http_url},model={model},request_format=/v1/completions"
    data = f"kind=synthetic_text,prompt_tokens={w.input_len},output_tokens={w.output_len}"
    return [
        exe,
        "run",
        "--backend",
        backend,
        "--profile",
        f"kind=concurrent,streams={w.concurrency}",
        "--data",
        data,
        "--constraint",
        f"kind=max_requests,count={guidellm_requests(w)}",
        "--tokenizer",
        f"kind=hf_auto,model={tokenizer_dir}",
        "--seed",
        f"kind=static,value={seed}",
        "--output",
        f"kind=json,path={out}",
        "--disable-console",
    ]


def guidellm_samples(doc: dict[str, Any], warmup: int, measured: int, sent: int | None = None) -> Samples:
    """Per-request figures from guidellm's JSON report.

    By start time: the ``warmup`` earliest requests are dropped, the next ``measured`` kept, the rest
    (the tail) dropped. ``sent``: how many guidellm was asked for; any it reported in none of its lists
    are counted as ``unreported`` (not as failed: the server answered them; see ``guidellm_requests``).
    """
    (benchmark,) = doc["benchmarks"]
    requests = benchmark["requests"]
    successful = requests["successful"] or []
    ok = sorted(successful, key=lambda r: r["request_start_time"])[warmup : warmup + measured]
    failed = len(requests.get("errored") or []) + len(requests.get("incomplete") or [])
    reported = len(successful) + failed
    return Samples(
        ttft_ms=tuple(float(r["time_to_first_token_ms"]) for r in ok),
        itl_ms=tuple(float(r["inter_token_latency_ms"]) for r in ok),
        prompt_tokens=tuple(int(r["prompt_tokens"]) for r in ok),
        output_tokens=tuple(int(r["output_tokens"]) for r in ok),
        failed=failed,
        unreported=max(0, sent - reported) if sent is not None else 0,
    )


def find_guidellm() -> str:
    """The ``guidellm`` beside this interpreter (the project's venv), else on PATH."""
    beside = Path(sys.executable).parent / "guidellm"
    found = str(beside) if beside.is_file() else shutil.which("guidellm")
    if found is None:
        raise RuntimeError("guidellm is not installed (pip install '.[test]')")
    return found


def run_guidellm(argv: list[str], out: Path, w: Workload, timeout_s: float) -> Samples:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # the tokenizer is a local directory; never reach a hub
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0 or not out.is_file():
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
        raise RuntimeError(f"guidellm failed (exit {proc.returncode}):\n{tail}")
    return guidellm_samples(json.loads(out.read_text()), w.concurrency, w.num_prompts, guidellm_requests(w))


# ---- pdserve bench ------------------------------------------------------------------------------------


def bench_samples(result: BenchResult) -> Samples:
    ok = [r for r in result.records if r.ok and r.ttft is not None and r.itl]
    return Samples(
        ttft_ms=tuple(r.ttft * 1000.0 for r in ok),  # type: ignore[operator]
        itl_ms=tuple(statistics.fmean(r.itl) * 1000.0 for r in ok),
        prompt_tokens=tuple(r.prompt_tokens for r in ok),
        output_tokens=tuple(r.output_tokens for r in ok),
        failed=len(result.records) - len(ok),
    )


def bench_config(router: str, model: str, w: Workload, seed: int) -> BenchConfig:
    return BenchConfig(
        router=router,
        workload=WorkloadConfig(input_len=w.input_len, output_len=w.output_len),
        num_prompts=w.num_prompts,
        warmup=w.concurrency,
        seed=seed,
        max_concurrency=w.concurrency,
        model=model,
    )


# ---- a comparison -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    router: str  # gRPC host:port
    http_url: str
    model: str  # the served model name
    model_dir: Path  # its directory: guidellm's tokenizer


def compare(target: Target, w: Workload, guidellm: str, timeout_s: float = 600.0) -> dict[str, Any]:
    """Run both tools ``w.rounds`` times, alternating; the agreement of their TTFT and ITL."""
    grpc_rounds: list[Samples] = []
    http_rounds: list[Samples] = []
    commands: list[list[str]] = []
    with tempfile.TemporaryDirectory(prefix="pdserve-compare-") as tmp:
        for i in range(w.rounds):
            seed = w.seed + i
            out = Path(tmp) / f"guidellm-{i}.json"
            argv = guidellm_argv(guidellm, target.http_url, target.model, target.model_dir, w, out, seed)
            commands.append(argv)

            def grpc_run(seed: int = seed) -> Samples:
                return bench_samples(
                    asyncio.run(run_benchmark(bench_config(target.router, target.model, w, seed)))
                )

            def http_run(argv: list[str] = argv, out: Path = out) -> Samples:
                return run_guidellm(argv, out, w, timeout_s)

            first, second = (grpc_run, http_run) if i % 2 == 0 else (http_run, grpc_run)
            results = {f: f() for f in (first, second)}
            grpc_rounds.append(results[grpc_run])
            http_rounds.append(results[http_run])
    return {
        "workload": asdict(w),
        "target": {**asdict(target), "model_dir": str(target.model_dir)},
        "date_unix": time.time(),
        "guidellm_commands": commands,
        "pdserve_bench": [asdict(r) for r in grpc_rounds],  # one entry per round
        "guidellm": [asdict(r) for r in http_rounds],
        "agreement": [
            asdict(agreement(m, [getattr(r, m) for r in grpc_rounds], [getattr(r, m) for r in http_rounds]))
            for m in ("ttft_ms", "itl_ms")
        ],
    }


def format_report(doc: dict[str, Any]) -> str:
    head = f"{'metric':<8}{'pdserve bench (gRPC)':>22}{'guidellm (HTTP)':>22}"
    head += f"{'diff':>9}{'noise':>8}{'ratio':>7}  agree"
    lines = [head]
    for a in doc["agreement"]:
        lines.append(
            f"{a['metric']:<8}{a['a_mean']:>12.2f} +- {a['a_half_ci']:<6.2f}{a['b_mean']:>12.2f} +- "
            f"{a['b_half_ci']:<6.2f}{a['diff']:>+9.2f}{a['noise']:>8.2f}{a['ratio']:>7.3f}  "
            f"{'yes' if a['agree'] else 'NO'}"
        )
    for a in doc["agreement"]:
        rounds_a = ", ".join(f"{x:.1f}" for x in a["a_round_means"])
        rounds_b = ", ".join(f"{x:.1f}" for x in a["b_round_means"])
        ratios = ", ".join(f"{x:.3f}" for x in a["round_ratios"])
        lines.append(
            f"{a['metric']} per round: pdserve bench {rounds_a}; guidellm {rounds_b}; ratio {ratios}"
        )
    n_a, n_b = doc["agreement"][0]["n_a"], doc["agreement"][0]["n_b"]
    failed = [sum(r["failed"] for r in doc[tool]) for tool in ("pdserve_bench", "guidellm")]
    unreported = sum(r.get("unreported", 0) for r in doc["guidellm"])
    lines.append(
        f"requests measured: {n_a} and {n_b}; failed: {failed[0]} and {failed[1]}"
        + (f"; left out of guidellm's report: {unreported}" if unreported else "")
    )
    lines.append("noise: the larger of the difference's 95% interval and the gap between one tool's rounds")
    return "\n".join(lines)


def target_from_state(state_dir: Path) -> Target:
    from pdserve.deploy.local.cluster import cluster_status, load_state, state_tls, state_token
    from pdserve.engine.registry import resolve_model

    state = load_state(state_dir)
    if state is None:
        raise RuntimeError(f"no cluster in {state_dir} (pdserve up --http-port PORT --state-dir {state_dir})")
    http_url = cluster_status(state.router_address, token=state_token(state), tls=state_tls(state)).http_url
    if not http_url:
        raise RuntimeError(
            "the cluster's router has no HTTP front: start it with `pdserve up --http-port PORT`"
        )
    return Target(state.router_address, http_url, state.model, resolve_model(state.model, progress=False))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.tool_compare", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--state-dir", type=Path, default=Path(".pdserve"))
    d = Workload()
    for name in ("input_len", "output_len", "num_prompts", "concurrency", "rounds", "seed"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    p.add_argument("--guidellm", default=None, help="the guidellm executable (default: the venv's)")
    p.add_argument("--save-result", type=Path, default=None)
    args = p.parse_args(argv)
    try:
        w = Workload(
            args.input_len, args.output_len, args.num_prompts, args.concurrency, args.rounds, args.seed
        )
        doc = compare(target_from_state(args.state_dir), w, args.guidellm or find_guidellm())
    except (RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
        print(f"benchmarks.tool_compare: {e}", file=sys.stderr)
        return 1
    print(format_report(doc), flush=True)
    if args.save_result is not None:
        doc = {**doc, "machine": machine_info()}  # the cluster's too: target_from_state is a local `up`
        args.save_result.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
