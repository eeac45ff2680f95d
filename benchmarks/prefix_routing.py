"""KV-aware routing against load-only routing on a 1P+2D cluster, side by side in one run:
``python -m benchmarks.prefix_routing [--save]``.

Each policy gets a fresh cluster (``pdserve up --prefill 1 --decode 2 --colocated 0 --routing-policy P``),
the decode workers' KV caches sized to hold ``--cache-prefixes`` of the prompts' prefixes, and the same
seeded stream: ``--num-prefixes`` prefixes x ``--suffixes`` suffixes, shuffled, ``--output-len`` tokens,
EOS ignored. Every cluster is stopped when the run ends, whatever happens.

Per-request KV figures are exact, read from the decode workers' counters: at most ``--concurrency``
requests are in flight, but a request is released only once every request in flight has its first token,
so no two prefills or KV transfers overlap. Around each one the decode workers' ``/metrics`` are read
(before its release, and after its first token once no transfer is in flight): the bytes that landed on a
worker between the two reads (``pdserve_kv_transfer_bytes_total{role="decode"}``) are that request's, and
the worker whose counters moved (bytes, transfers, prefilled or cache-looked-up prompt tokens) served it. A
full-prefix transfer is a request whose decode worker received at least ``--prefix-len`` tokens' worth of
KV (tokens x layers x 2 x KV heads x head dim x dtype bytes). Details: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from benchmarks.local_cluster import free_port, pdserve

POLICIES = ("kv-aware", "load")
RESULTS_DIR = Path("benchmarks/results")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
START_TIMEOUT_S = 600
SETTLE_TIMEOUT_S = 30.0
# What moves on a decode worker when it takes a request: KV landing (remote prefill), a completed transfer,
# prompt tokens prefilled or looked up in its prefix cache (local prefill).
ACTIVITY = (
    ("pdserve_kv_transfer_bytes_total", {"role": "decode"}),
    ("pdserve_kv_transfer_bytes_not_sent_total", {"role": "decode"}),
    ("pdserve_kv_transfer_seconds_count", {"role": "decode"}),
    ("pdserve_prefill_tokens_total", {"role": "decode"}),
    ("pdserve_prefix_cache_queries_tokens_total", {}),
)
LANDED = ACTIVITY[0]
NOT_SENT = ACTIVITY[1]
INFLIGHT = ("pdserve_kv_transfer_inflight", {"role": "decode"})
CACHE_HITS = ("pdserve_prefix_cache_hits_tokens_total", {})
ROUTES = "pdserve_router_routes_total"
PREDICTED = "pdserve_router_predicted_cached_tokens_total"


def _log(msg: str) -> None:
    print(f"[prefix_routing] {msg}", file=sys.stderr, flush=True)


# ---- sizing -------------------------------------------------------------------------------------------


def kv_bytes_per_token(model_config: Mapping[str, Any], dtype: str) -> int:
    """KV cache bytes one token takes: layers x 2 (K and V) x KV heads x head dim x dtype bytes."""
    heads = int(model_config["num_attention_heads"])
    kv_heads = int(model_config.get("num_key_value_heads") or heads)
    head_dim = int(model_config.get("head_dim") or model_config["hidden_size"] // heads)
    return int(model_config["num_hidden_layers"]) * 2 * kv_heads * head_dim * DTYPE_BYTES[dtype]


def kv_cache_mib(per_token: int, cfg: argparse.Namespace) -> int:
    """``--kv-cache-mib`` for a decode worker holding ``cache_prefixes`` prefixes while ``concurrency``
    requests run on it: their prefixes are among the cached ones, their suffixes and outputs come on top."""
    tokens = cfg.cache_prefixes * cfg.prefix_len + cfg.concurrency * (cfg.suffix_len + cfg.output_len)
    return math.ceil(tokens * per_token / 2**20)


# ---- the workload -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    token_ids: tuple[int, ...]
    prefix: int  # which of the shared prefixes it starts with


def workload(cfg: argparse.Namespace, token_space: Any) -> tuple[list[Prompt], list[Prompt]]:
    """The measured prompts (every prefix with each of its suffixes, in a seeded shuffled order) and two
    warmup prompts that share nothing with them."""
    import numpy as np

    from pdserve.bench.datasets import DatasetName, WorkloadConfig, sample_requests

    shared = WorkloadConfig(
        DatasetName.SHARED_PREFIX,
        input_len=cfg.suffix_len,
        output_len=cfg.output_len,
        prefix_len=cfg.prefix_len,
        num_prefix_groups=cfg.num_prefixes,
    )
    data_seq, warm_seq = np.random.SeedSequence(cfg.seed).spawn(2)
    n = cfg.num_prefixes * cfg.suffixes
    samples = sample_requests(shared, n, np.random.default_rng(data_seq), token_space)
    measured = [Prompt(s.prompt_token_ids or (), s.group or 0) for s in samples]
    plain = WorkloadConfig(input_len=cfg.prefix_len + cfg.suffix_len, output_len=cfg.output_len)
    warm = [
        Prompt(s.prompt_token_ids or (), -1)
        for s in sample_requests(plain, 2, np.random.default_rng(warm_seq), token_space)
    ]
    return measured, warm


# ---- metrics ------------------------------------------------------------------------------------------

Sample = tuple[str, frozenset[tuple[str, str]]]


def parse_metrics(text: str) -> dict[Sample, float]:
    """Every sample of a Prometheus text page, by name and labels."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, frozenset(s.labels.items())): float(s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(page: Mapping[Sample, float], name: str, labels: Mapping[str, str]) -> float:
    """The sum of ``name``'s samples that carry ``labels`` (0 where there is none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in page.items() if n == name and want <= ls)


def by_label(page: Mapping[Sample, float], name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for (n, ls), v in page.items():
        if n == name:
            key = dict(ls).get(label, "")
            out[key] = out.get(key, 0.0) + v
    return out


def scrape(url: str) -> dict[Sample, float]:
    with urllib.request.urlopen(url, timeout=10) as r:  # noqa: S310 - the cluster's loopback /metrics
        return parse_metrics(r.read().decode())


@dataclass(frozen=True)
class Attribution:
    worker: str | None  # the decode worker whose counters moved; None: none did, or several
    kv_bytes: float  # KV bytes that landed on it
    not_sent_bytes: float  # bytes its prefix cache already held, so the prefill worker did not send them


def attribute(
    before: Mapping[str, Mapping[Sample, float]], after: Mapping[str, Mapping[Sample, float]]
) -> Attribution:
    """Which decode worker took the one request between two reads of every decode worker's metrics, and
    the KV bytes it received (exact while that request is the only one prefilling)."""
    moved = [w for w in after if any(value(after[w], *m) != value(before[w], *m) for m in ACTIVITY)]
    landed = sum(value(after[w], *LANDED) - value(before[w], *LANDED) for w in after)
    not_sent = sum(value(after[w], *NOT_SENT) - value(before[w], *NOT_SENT) for w in after)
    return Attribution(moved[0] if len(moved) == 1 else None, landed, not_sent)


# ---- one policy ---------------------------------------------------------------------------------------


@dataclass
class RequestResult:
    index: int
    prefix: int
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    output_tokens: int = 0
    error: str | None = None
    decode_worker: str | None = None
    kv_bytes: float = 0.0
    not_sent_bytes: float = 0.0
    full_prefix: bool = False
    first_token: threading.Event = field(default_factory=threading.Event, repr=False)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "first_token"}


def stream(
    stub: Any, prompt: Prompt, result: RequestResult, output_len: int, timeout_s: float, request_id: str
) -> None:
    """One request through the router, timed; every failure ends up in ``result.error``."""
    from pdserve.proto import generation_pb2

    req = generation_pb2.GenerateRequest(request_id=request_id)
    req.prompt_token_ids.ids.extend(prompt.token_ids)
    req.sampling.max_tokens, req.sampling.ignore_eos, req.sampling.temperature = output_len, True, 0.0
    t0 = time.perf_counter()
    try:
        for m in stub.Generate(req, timeout=timeout_s):
            if m.token_ids:
                if result.ttft_ms is None:
                    result.ttft_ms = (time.perf_counter() - t0) * 1e3
                    result.first_token.set()
                result.output_tokens += len(m.token_ids)
        result.e2e_ms = (time.perf_counter() - t0) * 1e3
        if result.output_tokens != output_len:
            result.error = f"{result.output_tokens} tokens, not {output_len}"
    except Exception as e:  # noqa: BLE001 - one failed request is recorded, the run goes on
        result.error = f"{type(e).__name__}: {e}"
    finally:
        result.first_token.set()


def _settle(
    decoders: Mapping[str, str], before: Mapping[str, Mapping[Sample, float]]
) -> dict[str, dict[Sample, float]]:
    """The decode workers' metrics once no transfer is in flight and one of them shows the request."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        after = {w: scrape(url) for w, url in decoders.items()}
        idle = all(value(p, *INFLIGHT) == 0 for p in after.values())
        if (idle and attribute(before, after).worker is not None) or time.monotonic() > deadline:
            return after
        time.sleep(0.05)


def send_all(
    address: str,
    decoders: Mapping[str, str],
    prompts: Sequence[Prompt],
    cfg: argparse.Namespace,
    per_token: int,
    tag: str,
) -> list[RequestResult]:
    """Send ``prompts`` in order, at most ``cfg.concurrency`` in flight, each released once every request
    in flight has its first token; attribute each one's KV to its decode worker (module docstring)."""
    import grpc

    from pdserve.proto import generation_pb2_grpc

    results = [RequestResult(i, p.prefix) for i, p in enumerate(prompts)]
    full = cfg.prefix_len * per_token
    with grpc.insecure_channel(address) as channel, ThreadPoolExecutor(cfg.concurrency) as pool:
        stub = generation_pb2_grpc.GenerationStub(channel)
        running: set[Future[None]] = set()
        for prompt, result in zip(prompts, results, strict=True):
            if len(running) >= cfg.concurrency:
                _, running = wait(running, return_when=FIRST_COMPLETED)
            before = {w: scrape(url) for w, url in decoders.items()}
            rid = f"prefix-routing-{tag}-{result.index}"
            running.add(pool.submit(stream, stub, prompt, result, cfg.output_len, cfg.request_timeout, rid))
            result.first_token.wait()
            got = attribute(before, _settle(decoders, before))
            result.decode_worker, result.kv_bytes, result.not_sent_bytes = (
                got.worker,
                got.kv_bytes,
                got.not_sent_bytes,
            )
            result.full_prefix = got.kv_bytes >= full
        wait(running)
    return results


def cluster_view(state_dir: Path) -> tuple[str, str, dict[str, str]]:
    """The router's gRPC address and metrics URL, and each decode worker's metrics URL by id."""
    status = json.loads(pdserve("status", "--json", "--state-dir", str(state_dir), timeout=60))
    decoders = {w["id"]: w["metrics_url"] for w in status["workers"] if w["role"] == "decode"}
    return status["router"]["address"], status["router"]["metrics_url"], decoders


def run_policy(
    policy: str,
    cfg: argparse.Namespace,
    prompts: Sequence[Prompt],
    warm: Sequence[Prompt],
    per_token: int,
    mib: int,
    work: Path,
) -> dict[str, Any]:
    """One fresh cluster under ``policy``: warm it up, send the workload, stop it."""
    state_dir = work / policy
    up = [
        "up", "--prefill", "1", "--decode", "2", "--colocated", "0", "--routing-policy", policy,
        "--kv-cache-mib", str(mib), "--threads", str(cfg.threads), "--dtype", cfg.dtype,
        "--model", cfg.model, "--port", str(free_port()), "--state-dir", str(state_dir),
        "--timeout", str(START_TIMEOUT_S), "--no-http",
    ]  # fmt: skip
    _log(f"{policy}: pdserve {' '.join(up)}")
    try:
        pdserve(*up)
        address, router_metrics, decoders = cluster_view(state_dir)
        if len(decoders) != 2:
            raise RuntimeError(f"expected 2 decode workers, the router lists {sorted(decoders)}")
        # Warm both decode workers and the transfer path (first forward, endpoints) with prompts that share
        # nothing with the workload; the counters are read after it.
        warm_cfg = argparse.Namespace(**{**vars(cfg), "concurrency": 2})
        warm_results = send_all(address, decoders, warm, warm_cfg, per_token, "warmup")
        router0 = scrape(router_metrics)
        decode0 = {w: scrape(url) for w, url in decoders.items()}
        t0 = time.perf_counter()
        results = send_all(address, decoders, prompts, cfg, per_token, "run")
        duration = time.perf_counter() - t0
        router1 = scrape(router_metrics)
        decode1 = {w: scrape(url) for w, url in decoders.items()}
    finally:
        subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "down", "--state-dir", str(state_dir)],
            capture_output=True,
            timeout=180,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    return summarize_policy(policy, results, warm_results, (router0, router1), (decode0, decode1), duration)


def summarize_policy(
    policy: str,
    results: Sequence[RequestResult],
    warm_results: Sequence[RequestResult],
    router: tuple[Mapping[Sample, float], Mapping[Sample, float]],
    decode: tuple[Mapping[str, Mapping[Sample, float]], Mapping[str, Mapping[Sample, float]]],
    duration_s: float,
) -> dict[str, Any]:
    """One policy's figures from its requests and the counters read before and after them."""
    ok = [r for r in results if r.error is None]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    served = {w: sum(r.decode_worker == w for r in results) for w in decode[1]}
    landed = {w: value(decode[1][w], *LANDED) - value(decode[0][w], *LANDED) for w in decode[1]}
    not_sent = {w: value(decode[1][w], *NOT_SENT) - value(decode[0][w], *NOT_SENT) for w in decode[1]}
    hits = {w: value(decode[1][w], *CACHE_HITS) - value(decode[0][w], *CACHE_HITS) for w in decode[1]}

    def delta(name: str, label: str) -> dict[str, float]:
        after, before = by_label(router[1], name, label), by_label(router[0], name, label)
        return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}

    counts = sorted(served.values())
    return {
        "policy": policy,
        "requests": len(results),
        "failed": len(results) - len(ok),
        "unattributed": sum(r.decode_worker is None for r in results),
        "full_prefix_transfers": sum(r.full_prefix for r in results),
        "kv_bytes_total": sum(landed.values()),
        "kv_bytes_per_request": sum(landed.values()) / max(len(results), 1),
        # The per-request deltas add up to the run's: nothing landed outside a request's window.
        "kv_bytes_attributed": sum(r.kv_bytes for r in results),
        "kv_bytes_not_sent_total": sum(not_sent.values()),
        "median_ttft_ms": statistics.median(ttft) if ttft else None,
        "mean_ttft_ms": statistics.fmean(ttft) if ttft else None,
        "p90_ttft_ms": statistics.quantiles(ttft, n=10)[-1] if len(ttft) >= 2 else None,
        "duration_s": duration_s,
        "output_tok_s": sum(r.output_tokens for r in ok) / duration_s if duration_s > 0 else None,
        "requests_per_decode_worker": served,
        "busier_over_other": counts[-1] / counts[0] if counts and counts[0] else None,
        "kv_bytes_per_decode_worker": landed,
        "decode_prefix_cache_hit_tokens": hits,
        "routes": delta(ROUTES, "reason"),
        "predicted_cached_tokens": delta(PREDICTED, "leg"),
        "warmup": [r.as_dict() for r in warm_results],
        "per_request": [r.as_dict() for r in results],
    }


# ---- the comparison -----------------------------------------------------------------------------------


def acceptance(by_policy: Mapping[str, Mapping[str, Any]], num_prefixes: int) -> list[dict[str, Any]]:
    """The targets, each with the figures it compares and pass or fail (None where a figure is missing)."""
    kv, load = by_policy.get("kv-aware"), by_policy.get("load")
    lines: list[dict[str, Any]] = []
    if kv is None:
        return lines
    bound = 1.25 * num_prefixes
    lines.append({
        "target": f"kv-aware full-prefix transfers <= 1.25 x {num_prefixes} prefixes",
        "value": kv["full_prefix_transfers"], "bound": bound, "pass": kv["full_prefix_transfers"] <= bound,
    })  # fmt: skip
    ratio = kv.get("busier_over_other")
    lines.append({
        "target": "kv-aware: the busier decode worker served <= 1.5 x the other's requests",
        "value": ratio, "bound": 1.5, "pass": None if ratio is None else ratio <= 1.5,
    })  # fmt: skip
    if load is None:
        return lines
    kv_b, load_b = kv["kv_bytes_per_request"], load["kv_bytes_per_request"]
    saved = 1 - kv_b / load_b if load_b else None
    lines.append({
        "target": "kv-aware KV bytes per request >= 40% below load-only's",
        "value": saved, "bound": 0.40, "pass": None if saved is None else saved >= 0.40,
    })  # fmt: skip
    kv_t, load_t = kv["median_ttft_ms"], load["median_ttft_ms"]
    lines.append({
        "target": "kv-aware median TTFT below load-only's",
        "value": None if kv_t is None or load_t is None else kv_t / load_t, "bound": 1.0,
        "pass": None if kv_t is None or load_t is None else kv_t < load_t,
    })  # fmt: skip
    return lines


def report(result: Mapping[str, Any]) -> str:
    m, w = result["machine"], result["workload"]
    lines = [
        f"{m['cpu']} ({m['isa']}), {m['cores']} cores; {result['dtype']}, {result['threads_per_worker']} "
        f"thread(s) per worker, decode KV cache {result['kv_cache_mib']} MiB "
        f"(~{w['cache_prefixes']} prefixes)",
        f"workload: {w['num_prefixes']} prefixes x {w['suffixes']} suffixes, "
        f"{w['prefix_len']}+{w['suffix_len']} tokens, {w['output_len']} out, concurrency {w['concurrency']}, "
        f"seed {w['seed']}",
        "",
        "| policy | full-prefix transfers | KV MiB / request | median TTFT ms | requests per decode worker "
        "| routes | failed |",
        "|---|---|---|---|---|---|---|",
    ]
    for p, r in result["policies"].items():
        served = ", ".join(f"{k}: {v}" for k, v in r["requests_per_decode_worker"].items())
        routes = ", ".join(f"{k} {v:g}" for k, v in r["routes"].items())
        ttft = "-" if r["median_ttft_ms"] is None else f"{r['median_ttft_ms']:.0f}"
        lines.append(
            f"| {p} | {r['full_prefix_transfers']} | {r['kv_bytes_per_request'] / 2**20:.2f} | {ttft} "
            f"| {served} | {routes} | {r['failed']} |"
        )
    lines.append("")
    for a in result["acceptance"]:
        verdict = {True: "PASS", False: "FAIL", None: "N/A "}[a["pass"]]
        shown = "-" if a["value"] is None else f"{a['value']:.3g}"
        lines.append(f"{verdict} {a['target']}: {shown}")
    return "\n".join(lines) + "\n"


def plot(result: Mapping[str, Any], path: Path) -> bool:
    """The four compared figures per policy; False (and no file) where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    policies = list(result["policies"])
    rs = [result["policies"][p] for p in policies]
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.6))
    panels = (
        ("full-prefix transfers", [r["full_prefix_transfers"] for r in rs]),
        ("KV MiB moved per request", [r["kv_bytes_per_request"] / 2**20 for r in rs]),
        ("median TTFT (ms)", [r["median_ttft_ms"] or 0.0 for r in rs]),
    )
    for ax, (title, values) in zip(axes, panels, strict=False):
        ax.bar(policies, values, color=["tab:blue", "tab:orange"][: len(policies)])
        ax.set_title(title, fontsize=9)
    workers = sorted({w for r in rs for w in r["requests_per_decode_worker"]})
    for i, r in enumerate(rs):
        counts = [r["requests_per_decode_worker"].get(w, 0) for w in workers]
        axes[3].bar([x + i * 0.4 for x in range(len(workers))], counts, 0.4, label=policies[i])
    axes[3].set_xticks([x + 0.2 for x in range(len(workers))], workers)
    axes[3].set_title("requests per decode worker", fontsize=9)
    axes[3].legend(fontsize=7, loc="lower center")
    fig.suptitle(
        f"KV-aware vs load-only routing, 1P+2D, {result['dtype']}, {result['machine']['cpu']}", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run(cfg: argparse.Namespace) -> dict[str, Any]:
    from pdserve.bench.machine import machine_info
    from pdserve.bench.serve import model_token_space
    from pdserve.engine.registry import resolve_model

    model_dir = resolve_model(cfg.model)
    per_token = kv_bytes_per_token(json.loads((model_dir / "config.json").read_text()), cfg.dtype)
    mib = kv_cache_mib(per_token, cfg)
    prompts, warm = workload(cfg, model_token_space(cfg.model))
    by_policy: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-prefix-routing-") as tmp:
        for policy in cfg.policies:
            by_policy[policy] = run_policy(policy, cfg, prompts, warm, per_token, mib, Path(tmp))
            _log(f"{policy}: {by_policy[policy]['full_prefix_transfers']} full-prefix transfers, "
                 f"median TTFT {by_policy[policy]['median_ttft_ms']} ms")  # fmt: skip
    return {
        "command": "python -m benchmarks.prefix_routing " + " ".join(cfg.argv),
        "machine": machine_info(),
        "model": cfg.model,
        "dtype": cfg.dtype,
        "threads_per_worker": cfg.threads,
        "kv_bytes_per_token": per_token,
        "kv_cache_mib": mib,
        "full_prefix_bytes": cfg.prefix_len * per_token,
        "workload": {
            k: getattr(cfg, k)
            for k in (
                "num_prefixes",
                "suffixes",
                "prefix_len",
                "suffix_len",
                "output_len",
                "concurrency",
                "cache_prefixes",
                "seed",
            )
        },  # fmt: skip
        "policies": by_policy,
        "acceptance": acceptance(by_policy, cfg.num_prefixes),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from pdserve.engine.device import resolve_dtype

    p = argparse.ArgumentParser(
        prog="python -m benchmarks.prefix_routing", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="auto: bfloat16 where the CPU has bf16 dot products (AVX512-BF16, AMX), float32 elsewhere",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=max(1, (os.cpu_count() or 1) // 3),
        help="torch threads per worker (default: cores / 3 workers)",
    )
    p.add_argument("--num-prefixes", type=int, default=16)
    p.add_argument("--suffixes", type=int, default=4, help="requests per prefix, each with its own suffix")
    p.add_argument("--prefix-len", type=int, default=768)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=2, help="requests in flight at most")
    p.add_argument(
        "--cache-prefixes", type=int, default=10, help="prefixes each decode worker's KV cache holds"
    )
    p.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"comma-separated, run in this order, of {', '.join(POLICIES)}",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument(
        "--out-dir",
        type=Path,
        default=Path(".pdserve/bench/prefix_routing"),
        help="where the JSON and plot go (default outside the tracked tree)",
    )
    p.add_argument(
        "--save", action="store_true", help=f"write them to {RESULTS_DIR}/ instead, as the reference result"
    )
    a = p.parse_args(argv)
    a.argv = list(argv) if argv is not None else sys.argv[1:]
    a.dtype = resolve_dtype(a.dtype, "cpu")
    a.policies = tuple(dict.fromkeys(x.strip() for x in a.policies.split(",") if x.strip()))
    if not a.policies or any(x not in POLICIES for x in a.policies):
        p.error(f"--policies: of {', '.join(POLICIES)}")
    sizes = (
        a.threads,
        a.num_prefixes,
        a.suffixes,
        a.prefix_len,
        a.suffix_len,
        a.output_len,
        a.concurrency,
        a.cache_prefixes,
    )
    if min(sizes) < 1:
        p.error("--threads, --num-prefixes, --suffixes, the lengths, --concurrency, --cache-prefixes: >= 1")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    from pdserve.bench.report import write_json

    cfg = parse_args(argv)
    result = run(cfg)
    out_dir = RESULTS_DIR if cfg.save else cfg.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "prefix_routing.json", result)
    text = report(result)
    if plot(result, out_dir / "prefix_routing.png"):
        text += f"\nwritten: {out_dir / 'prefix_routing.json'}, {out_dir / 'prefix_routing.png'}\n"
    else:
        text += f"\nwritten: {out_dir / 'prefix_routing.json'} (no plot: matplotlib is not installed)\n"
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
