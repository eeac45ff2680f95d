"""Live migration on a local cluster of the default model (float32 on AVX2 hosts, bfloat16 with AVX-512
BF16), one thread per worker, each pinned to its own core:

    python -m benchmarks.live_migration drain [--streams 8] [--remaining 2000] [--out FILE]
    python -m benchmarks.live_migration rebalance [--streams 12] [--tokens 400] [--out FILE]

drain: one decode worker runs ``--streams`` greedy streams; a second decode worker joins (``pdserve
scale``); once every stream has 16 tokens the first is drained (the router's DrainWorker, as `pdserve
drain` asks). Reported: from the drain request to every stream moved (the router's live-move counter) and
to the worker gone, the KV bytes moved, the cross-memory bandwidth of the KV transfer measured on this host
in the same run (``benchmarks.kv_transfer``'s pair, SmolLM2's layout, the moved streams' mean context), and
the bound 2 s + bytes / bandwidth. Every stream must end with all its tokens, nothing may move by
re-prefill, and the survivor must hold no KV block once idle.

rebalance: the same start with ``--streams`` streams of ``--tokens`` tokens and the second worker joining
idle, run twice, the router's rebalancer off then on. Reported per run: how long until the batches were
within two streams of each other (on; the rebalancer stops within 1.2x the mean), and the inter-token
latency (median, p99) after the join of the streams that moved (on) and of the same streams (off).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.local_cluster import free_port, pdserve
from pdserve.bench.machine import machine_info
from pdserve.bench.report import emit_json

_WARM_TOKENS = 16


def _log(msg: str) -> None:
    print(f"[live_migration] {msg}", file=sys.stderr, flush=True)


def _metric(url: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


class _Cluster:
    """A local cluster of one decode worker (more join with ``grow``), stopped on exit."""

    def __init__(self, extra: tuple[str, ...] = ()) -> None:
        # (Its logs go with it: PDSERVE_BENCH_KEEP=1 keeps the state dir.)
        self.dir = tempfile.mkdtemp(prefix="pdserve-live-migration-")
        self.port = free_port()
        self.extra = extra

    def __enter__(self) -> _Cluster:
        args = ("--prefill", "0", "--decode", "1", "--colocated", "0", "--no-http", "--threads", "1")
        pdserve("up", *args, "--pin-cpus", "--port", str(self.port), "--state-dir", self.dir, *self.extra)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            pdserve("down", "--state-dir", self.dir, "--timeout", "30", timeout=180)
        finally:
            if not os.environ.get("PDSERVE_BENCH_KEEP"):
                shutil.rmtree(self.dir, ignore_errors=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def status(self) -> dict[str, Any]:
        return json.loads(pdserve("status", "--json", "--state-dir", self.dir, timeout=60))

    def grow(self) -> None:
        pdserve("scale", "--decode", "2", "--state-dir", self.dir)

    def token_metadata(self) -> tuple[tuple[str, str], ...]:
        from pdserve.deploy.local import cluster
        from pdserve.worker.auth import token_metadata

        state = cluster.load_state(Path(self.dir))
        assert state is not None
        return token_metadata(cluster.state_token(state))

    def drain(self, worker_id: str) -> None:
        import grpc

        from pdserve.proto import worker_pb2, worker_pb2_grpc

        with grpc.insecure_channel(self.address) as ch:
            worker_pb2_grpc.RegistryStub(ch).DrainWorker(
                worker_pb2.DrainWorkerRequest(worker_id=worker_id), timeout=30, metadata=self.token_metadata()
            )


class _Streams:
    """Greedy streams in threads: each one's token count and message times."""

    def __init__(self, address: str, n: int, max_tokens: int, seed: int = 3) -> None:
        rng = random.Random(seed)
        self.times: list[list[float]] = [[] for _ in range(n)]
        self.tokens = [0] * n
        self.errors: list[BaseException] = []
        self._threads = []
        for i in range(n):
            prompt = [rng.randrange(100, 40000) for _ in range(32)]
            t = threading.Thread(target=self._run, args=(address, i, prompt, max_tokens), daemon=True)
            self._threads.append(t)
            t.start()

    def _run(self, address: str, i: int, prompt: list[int], max_tokens: int) -> None:
        import grpc

        from pdserve.proto import generation_pb2, generation_pb2_grpc

        req = generation_pb2.GenerateRequest(
            request_id=f"s{i}", prompt_token_ids=generation_pb2.TokenIds(ids=prompt)
        )
        req.sampling.max_tokens = max_tokens
        req.sampling.ignore_eos = True
        try:
            with grpc.insecure_channel(address) as ch:
                for m in generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=1800):
                    now = time.monotonic()
                    self.times[i] += [now] * len(m.token_ids)
                    self.tokens[i] += len(m.token_ids)
        except BaseException as e:  # noqa: BLE001 - reported by the run
            self.errors.append(e)

    def wait_tokens(self, n: int, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while min(self.tokens) < n:
            if self.errors or time.monotonic() > end:
                raise RuntimeError(f"streams did not reach {n} tokens: {self.tokens} {self.errors}")
            time.sleep(0.05)

    def join(self, timeout_s: float) -> None:
        for t in self._threads:
            t.join(timeout_s)


def _wait(pred: Any, timeout_s: float, what: str, poll_s: float = 0.02) -> float:
    start = time.monotonic()
    while not pred():
        if time.monotonic() - start > timeout_s:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(poll_s)
    return time.monotonic() - start


def _bandwidth(kv_bytes: float, streams: int) -> dict[str, Any]:
    """Cross-memory KV transfer bandwidth on this host, a transfer of one moved stream's mean context."""
    from benchmarks.kv_transfer import SMOLLM2, TRANSPORTS, _Pair
    from pdserve.engine.device import resolve_dtype

    dtype = resolve_dtype("auto", "cpu")
    layout = {**SMOLLM2, "dtype": dtype}
    per_token = (
        layout["num_layers"]
        * 2
        * layout["num_kv_heads"]
        * layout["head_dim"]
        * (4 if dtype == "float32" else 2)
    )
    tokens = max(int(kv_bytes / max(streams, 1) / per_token), layout["block_size"])
    tls, shm = TRANSPORTS["shm"]
    with _Pair(layout, tokens // layout["block_size"] + 8, tls, shm) as pair:
        pair.transfer(tokens)
        times = [pair.transfer(tokens)["landed_seconds"] for _ in range(9)]
    nbytes = tokens * per_token
    return {"tokens": tokens, "bytes": nbytes, "median_seconds": statistics.median(times),
            "bytes_per_s": nbytes / statistics.median(times)}  # fmt: skip


def drain(args: argparse.Namespace) -> dict[str, Any]:
    total = _WARM_TOKENS + args.remaining
    with _Cluster(("--no-rebalance",)) as c:  # (every stream stays on the first worker until its drain)
        streams = _Streams(c.address, args.streams, total)
        streams.wait_tokens(1, 600)
        c.grow()
        streams.wait_tokens(_WARM_TOKENS, 600)
        status = c.status()
        router = status["router"]["metrics_url"]
        source = next(w["id"] for w in status["workers"] if w["role"] == "decode" and w["id"].endswith("1"))
        moved0 = _metric(router, "pdserve_router_live_moves_total", outcome="moved")
        _log(f"draining {source} with {args.streams} streams at {min(streams.tokens)}+ tokens")
        start = time.monotonic()
        c.drain(source)
        moved_s = _wait(
            lambda: (
                _metric(router, "pdserve_router_live_moves_total", outcome="moved") - moved0 >= args.streams
            ),
            120,
            "every stream to move",
        )
        gone_s = _wait(
            lambda: source not in {w["id"] for w in c.status()["workers"]}, 120, "the worker to leave", 0.2
        )
        gone_s = time.monotonic() - start
        kv_bytes = _metric(router, "pdserve_router_live_move_kv_bytes_total")
        streams.join(1800)
        survivors = c.status()["workers"]
        migrations = _metric(router, "pdserve_router_migrations_total")
    bw = _bandwidth(kv_bytes, args.streams)
    bound = 2.0 + kv_bytes / bw["bytes_per_s"]
    result = {
        "streams": args.streams,
        "remaining_tokens": args.remaining,
        "all_tokens": all(n == total for n in streams.tokens) and not streams.errors,
        "re_prefill_migrations": migrations,
        "survivor_kv_blocks_used": [w.get("kv_blocks_used") for w in survivors],
        "seconds_to_every_stream_moved": moved_s,
        "seconds_to_worker_gone": gone_s,
        "kv_bytes_moved": kv_bytes,
        "transfer_bandwidth": bw,
        "bound_seconds": bound,
        "pass": moved_s < bound and migrations == 0 and all(n == total for n in streams.tokens),
    }
    _log(json.dumps(result))
    return result


def _itl(times: list[float], after: float) -> list[float]:
    ts = [t for t in times if t >= after]
    return [b - a for a, b in zip(ts, ts[1:], strict=False) if b > a]


def _spread(workers: list[dict[str, Any]], meta: tuple[tuple[str, str], ...]) -> int:
    """The largest minus the smallest decode batch (running requests, asked of each worker)."""
    import grpc

    from pdserve.proto import worker_pb2, worker_pb2_grpc

    running = []
    for w in workers:
        with grpc.insecure_channel(w["address"]) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            running.append(stub.GetLoad(worker_pb2.Empty(), timeout=5, metadata=meta).running)
    return max(running) - min(running)


def rebalance(args: argparse.Namespace) -> dict[str, Any]:
    runs = {}
    for mode in ("off", "on"):
        extra = () if mode == "on" else ("--no-rebalance",)
        with _Cluster(extra) as c:
            streams = _Streams(c.address, args.streams, args.tokens)
            streams.wait_tokens(_WARM_TOKENS, 600)
            meta = c.token_metadata()
            c.grow()
            joined = time.monotonic()
            status = c.status()
            router = status["router"]["metrics_url"]
            workers = [w for w in status["workers"] if w["role"] == "decode"]

            even_s = None
            if mode == "on":
                try:
                    even_s = _wait(lambda w=workers, m=meta: _spread(w, m) <= 2, 60, "even batches", 0.1)
                except RuntimeError:
                    even_s = None
            streams.join(1800)
            moved = _metric(router, "pdserve_router_live_moves_total", cause="rebalance", outcome="moved")
            itls = [_itl(t, joined + (even_s or 0.0)) for t in streams.times]
            runs[mode] = {
                "moved": moved,
                "seconds_to_even": even_s,
                "itl": itls,
                "errors": len(streams.errors),
            }
    # The streams that moved (on) are those whose ITL fell most after the join: compare like for like, the
    # same stream indices in both runs, the half that moved.
    k = int(runs["on"]["moved"]) or args.streams // 2
    gain = sorted(range(args.streams), key=lambda i: statistics.median(runs["on"]["itl"][i] or [0.0]))[:k]

    def summary(mode: str) -> dict[str, float]:
        xs = sorted(x for i in gain for x in runs[mode]["itl"][i])
        return {"median_ms": 1000 * statistics.median(xs), "p99_ms": 1000 * xs[int(0.99 * (len(xs) - 1))]}

    result = {
        "streams": args.streams,
        "tokens": args.tokens,
        "moved_by_rebalancer": runs["on"]["moved"],
        "seconds_to_even_batches": runs["on"]["seconds_to_even"],
        "moved_streams_itl_off": summary("off"),
        "moved_streams_itl_on": summary("on"),
        "errors": {m: runs[m]["errors"] for m in runs},
    }
    result["p99_itl_on_over_off"] = (
        result["moved_streams_itl_on"]["p99_ms"] / result["moved_streams_itl_off"]["p99_ms"]
    )
    _log(json.dumps(result))
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("drain")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--remaining", type=int, default=2000)
    p.add_argument("--out")
    p = sub.add_parser("rebalance")
    p.add_argument("--streams", type=int, default=12)
    p.add_argument("--tokens", type=int, default=400)
    p.add_argument("--out")
    args = parser.parse_args(argv)
    result = {
        "command": "python -m benchmarks.live_migration "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine_info("cpu"),
        args.what: drain(args) if args.what == "drain" else rebalance(args),
    }
    emit_json(result, Path(args.out) if args.out else None)


if __name__ == "__main__":
    main()
