"""``pdserve bench soak``: minutes to hours of mixed traffic while workers are SIGKILLed on a schedule.

It answers: is any request lost that a healthy worker could have served, are KV blocks leaked, does any
process's memory grow? Load: ``bench.soak_load``; kills and leaks: ``bench.soak_cluster``; memory:
``bench.soak_rss``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import random
import shlex
import signal
import sys
import threading
import uuid
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc

from pdserve.bench.machine import machine_info
from pdserve.bench.report import write_json
from pdserve.bench.soak_cluster import (
    DeathWatch,
    Target,
    kill_and_replace,
    leak_check,
    restore_shape,
    scrape,
    soak_cluster,
)
from pdserve.bench.soak_load import (
    Consistency,
    Front,
    Outcome,
    SoakRecord,
    WorkloadMix,
    make_pool,
    make_spec,
    run_grpc,
    run_openai,
    wall_clock,
)
from pdserve.bench.soak_rss import RssSampler, plot
from pdserve.bench.sweep import ClusterSpec, Shape

RSS_FLAT_LIMIT = 0.05


@dataclass(frozen=True)
class SoakConfig:
    minutes: float
    out_dir: Path
    state_dir: Path | None = None  # a running cluster to attach to (None, or no cluster there: start one)
    prefill: int = 2
    decode: int = 2
    model: str = "smollm2-135m-instruct"
    dtype: str = "float32"
    kv_cache_mib: int = 256
    concurrency: int = 4
    kill_interval_s: float = 60.0
    first_kill_s: float | None = None  # None: kill_interval_s
    kill_roles: tuple[str, ...] = ("decode", "prefill")
    sample_interval_s: float = 2.0
    warmup_s: float = 60.0
    request_timeout_s: float = 120.0
    leak_timeout_s: float = 15.0
    seed: int = 0
    mix: WorkloadMix = field(default_factory=WorkloadMix)
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.minutes > 0:
            raise ValueError(f"minutes must be > 0, got {self.minutes}")
        if self.concurrency < 1 or min(self.prefill, self.decode) < 0 or self.decode < 1:
            raise ValueError("concurrency and decode must be >= 1, prefill >= 0")
        if not (self.kill_interval_s > 0 and self.sample_interval_s > 0 and self.warmup_s >= 0):
            raise ValueError("kill and sample intervals must be > 0, warm-up >= 0")
        if any(r not in ("prefill", "decode") for r in self.kill_roles):
            raise ValueError(f"kill roles are prefill and decode, got {self.kill_roles}")

    @property
    def duration_s(self) -> float:
        return self.minutes * 60.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["out_dir"], d["state_dir"] = str(self.out_dir), self.state_dir and str(self.state_dir)
        return d


# ---- the run ------------------------------------------------------------------------------------------


class _Progress:
    """A tqdm bar on a terminal; a line every 30 s elsewhere (a nohup log)."""

    def __init__(self, enabled: bool, total_s: float) -> None:
        from tqdm import tqdm

        self.tty = enabled and sys.stderr.isatty()
        self.bar = tqdm(total=int(total_s), desc="soak", unit="s", file=sys.stderr, disable=not self.tty)
        self.enabled, self.total_s, self.last_line = enabled, total_s, 0.0

    def update(self, t: float, figures: dict[str, int]) -> None:
        if self.tty:
            self.bar.n = min(int(t), self.bar.total)
            self.bar.set_postfix(figures, refresh=True)
        elif self.enabled and t - self.last_line >= 30.0:
            self.last_line = t
            text = ", ".join(f"{k} {v}" for k, v in figures.items())
            print(f"[soak {t / 60:.1f}/{self.total_s / 60:g} min] {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        self.bar.close()


async def _run(cfg: SoakConfig, target: Target) -> dict[str, Any]:
    import aiohttp

    from pdserve.deploy.local import cluster
    from pdserve.proto import generation_pb2_grpc
    from pdserve.worker.dial import router_aio_channel

    clock = wall_clock()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    records: list[SoakRecord] = []
    kills: list[dict[str, Any]] = []
    consistency = Consistency()
    rng, pool, counter = random.Random(cfg.seed), make_pool(cfg.seed, cfg.mix), itertools.count()
    run_id = uuid.uuid4().hex[:6]
    sampler = RssSampler()
    progress = _Progress(cfg.progress, cfg.duration_s)

    watch = DeathWatch()
    restores: list[dict[str, Any]] = []
    restore_needed = asyncio.Event()

    def processes() -> list[tuple[str, int, str]]:
        procs = [("soak-client", os.getpid(), "client")]
        with contextlib.suppress(Exception):  # the state file is replaced atomically; a read may still fail
            state = cluster.load_state(target.state_dir)
            if watch.check(state, clock()):
                loop.call_soon_threadsafe(restore_needed.set)
            if state is not None:
                procs += [(p.id, p.pid, "router") for _, p in state.routers() if cluster.alive(p)]
                procs += [
                    (w.id, w.pid, w.role.value if w.role else "?") for w in state.workers if cluster.alive(w)
                ]
        return procs

    def figures() -> dict[str, int]:
        counts = {o.value: 0 for o in Outcome}
        for r in records:
            counts[r.outcome] += 1
        return {**counts, "kills": _done(kills), "crashes": len(watch.deaths)}

    async def sleep_or_stop(seconds: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(seconds, 0.0))
        return stop.is_set()

    # The OpenAI front over HTTPS when the cluster has TLS: trust its CA, as the gRPC half does.
    connector = aiohttp.TCPConnector(ssl=target.tls.client_ssl_context() or True)
    async with (
        router_aio_channel(target.router, target.tls) as ch,
        aiohttp.ClientSession(connector=connector) as session,
    ):
        stub = generation_pb2_grpc.GenerationStub(ch)

        async def client() -> None:
            while not stop.is_set():
                spec = make_spec(rng, next(counter), cfg.mix, pool)
                rid = f"soak-{run_id}-{spec.index}"
                if spec.front is Front.OPENAI and target.http_url:
                    rec = await run_openai(
                        session, target.http_url, target.model, spec, rid, cfg.request_timeout_s, clock
                    )
                else:
                    rec = await run_grpc(stub, spec, rid, cfg.request_timeout_s, clock)
                records.append(rec)
                consistency.check(rec)
                if rec.outcome in (Outcome.REFUSED.value, Outcome.LOST.value):
                    await asyncio.sleep(0.5)  # back off: a failing cluster is not hammered in a loop

        async def killer() -> None:
            """Kills on schedule; between them, replaces crashed workers as soon as they are seen."""
            next_at = cfg.kill_interval_s if cfg.first_kill_s is None else cfg.first_kill_s
            for k in itertools.count():
                while True:
                    due = next_at - clock() if next_at < cfg.duration_s else None
                    waits = [asyncio.create_task(e.wait()) for e in (stop, restore_needed)]
                    await asyncio.wait(waits, timeout=due, return_when=asyncio.FIRST_COMPLETED)
                    for w in waits:
                        w.cancel()
                    if stop.is_set():
                        return
                    if not restore_needed.is_set():
                        break  # time for the next kill
                    restore_needed.clear()
                    restores.append(
                        {"t_s": round(clock(), 2), **await asyncio.to_thread(restore_shape, target, clock)}
                    )
                role = cfg.kill_roles[k % len(cfg.kill_roles)]
                kills.append(await asyncio.to_thread(kill_and_replace, target, role, watch, clock))
                next_at = max(next_at + cfg.kill_interval_s, clock())

        async def sample() -> None:
            while True:
                await asyncio.to_thread(sampler.sample, clock(), await asyncio.to_thread(processes))
                progress.update(clock(), figures())
                if await sleep_or_stop(cfg.sample_interval_s):
                    return

        clients = [asyncio.create_task(client()) for _ in range(cfg.concurrency)]
        helpers = [asyncio.create_task(killer()), asyncio.create_task(sample())]
        try:
            await sleep_or_stop(cfg.duration_s)
            stop.set()
            load_s = clock()
            await asyncio.gather(*clients, *helpers)  # in-flight requests end by their own timeout
        finally:
            stop.set()
            for t in (*clients, *helpers):
                t.cancel()
            await asyncio.gather(*clients, *helpers, return_exceptions=True)
            progress.close()
    drained_s = clock()
    leaks = await asyncio.to_thread(leak_check, target, cfg.leak_timeout_s)
    sampler.sample(clock(), processes())
    try:
        migrations = scrape(target.metrics_url, "pdserve_router_migrations_total")
        rejected = scrape(target.metrics_url, "pdserve_requests_rejected_total")
    except OSError as e:
        migrations, rejected = {"error": str(e)}, {}  # type: ignore[dict-item]
    events = {"kills": kills, "restores": restores, "crashes": watch.deaths}
    return _document(
        cfg, target, records, events, consistency, leaks, migrations, rejected, sampler, load_s, drained_s
    )


def _document(
    cfg: SoakConfig, target: Target, records: list[SoakRecord], events: dict[str, list[dict[str, Any]]],
    consistency: Consistency, leaks: dict[str, Any], migrations: dict[str, float], rejected: dict[str, float],
    sampler: RssSampler, load_s: float, drained_s: float,
) -> dict[str, Any]:  # fmt: skip
    counts = {o.value: sum(r.outcome == o.value for r in records) for o in Outcome}
    by_front = {
        f.value: {o.value: sum(r.outcome == o.value and r.front == f.value for r in records) for o in Outcome}
        for f in Front
    }
    kills, crashes = events["kills"], events["crashes"]
    failures = [k["t_s"] for k in kills if "worker" in k] + [c["t_s"] for c in crashes]
    lost = []
    for r in records:
        if r.outcome == Outcome.LOST.value:
            since = [r.end - t for t in failures if t <= r.end]
            lost.append({**r.as_dict(), "s_after_last_failure": round(min(since), 2) if since else None})
    ready = {w: e["replaced_s"] for e in kills + events["restores"] for w in e.get("replacement", ())}
    flatness = sampler.report(cfg.warmup_s, ready)
    judged = {f["name"]: f["max_rise"] for f in flatness if f["max_rise"] is not None}
    drift = {f["name"]: f["max_drift"] for f in flatness if f["max_drift"] is not None}
    raw_rise = {f["name"]: f["max_rise_raw"] for f in flatness if f.get("max_rise_raw") is not None}
    tokens = sum(r.tokens for r in records if r.outcome == Outcome.COMPLETED.value)
    return {
        "date": datetime.now(tz=UTC).isoformat(),
        "machine": machine_info(),  # the cluster's too: started here, or attached through a local --state-dir
        "config": cfg.as_dict(),
        "cluster": {
            "attached": target.attached,
            "router": target.router,
            "model": target.model,
            "shape": target.shape,
            "openai_front": bool(target.http_url),
        },
        "load_s": round(load_s, 1),
        "drained_s": round(drained_s, 1),
        "requests": {"sent": len(records), **counts, "mismatched": len(consistency.mismatched)},
        "requests_by_front": by_front,
        "completed_output_tokens_per_s": round(tokens / load_s, 2) if load_s > 0 else None,
        "lost": lost,
        "mismatched": consistency.mismatched,
        "pooled_prompts_compared": sum(r.pool_key is not None and r.outcome == "completed" for r in records),
        **events,
        "migrations": {**migrations, "total": sum(v for v in migrations.values() if isinstance(v, float))},
        "router_rejected": rejected,
        "kv_blocks_leaked": leaks["kv_blocks_leaked"],
        "leak_check": leaks,
        "rss": {
            "warmup_s": cfg.warmup_s,
            "flat_limit": RSS_FLAT_LIMIT,
            "max_rise": judged,  # judged (see soak_rss.py)
            "max_rise_raw": raw_rise,  # reported: the rise on unsmoothed samples
            "max_drift": drift,  # reported: the distance either way from each baseline
            "flat": all(d <= RSS_FLAT_LIMIT for d in judged.values()) if judged else None,
            "processes": flatness,
            "series": sampler.as_dict(),
        },
        "ok": counts["lost"] == 0 and leaks["clean"] and not consistency.mismatched and not crashes,
        "_records": [r.as_dict() for r in records],
    }


def run_soak(cfg: SoakConfig, command: str = "") -> dict[str, Any]:
    """One soak; writes ``soak.json``, ``soak_rss.png``, ``requests.json.gz``, ``summary.md`` and returns the
    document.

    Attach to the cluster in ``--state-dir``, else start one (stopped at the end, whatever happens); run
    ``--concurrency`` clients for ``--minutes`` while the busiest worker of the next role is SIGKILLed every
    ``--kill-interval`` s and the shape restored (the next kill waits for the replacement, so a healthy
    worker of every role is always there; a worker dying unkilled is a crash, replaced at once) and RSS is
    sampled; then let in-flight requests finish, ask every worker (``GetLoad``, no heartbeat lag) until it
    holds no KV blocks, and read the router's migrations from /metrics.
    """
    import uvloop

    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    spec = ClusterSpec(
        model=cfg.model,
        dtype=cfg.dtype,
        threads=1,
        pin_cpus=False,
        timeout_s=300.0,
        extra_up_args=("--http-port", "0", "--kv-cache-mib", str(cfg.kv_cache_mib)),
    )
    shape = Shape(prefill=cfg.prefill, decode=cfg.decode)
    with soak_cluster(cfg.state_dir, cfg.out_dir / "cluster", shape, spec) as target:
        doc = uvloop.run(_run(cfg, target))
    doc["command"] = command
    records = doc.pop("_records")
    write_json(cfg.out_dir / "requests.json.gz", {"requests": records})
    title = (
        f"pdserve soak: {target.shape['prefill']}P+{target.shape['decode']}D {target.model}, "
        f"{cfg.minutes:g} min, {_done(doc['kills'])} SIGKILLs; {doc['requests']['completed']} completed, "
        f"{doc['requests']['lost']} lost, {doc['kv_blocks_leaked']} KV blocks leaked"
    )
    rss = doc["rss"]
    doc["plot"] = str(
        plot(
            rss["series"], rss["processes"], doc["kills"], RSS_FLAT_LIMIT, title, cfg.out_dir / "soak_rss.png"
        )
    )
    write_json(cfg.out_dir / "soak.json", doc)
    (cfg.out_dir / "summary.md").write_text(
        f"# pdserve bench soak, {doc['date'][:10]}\n\n`{command}`\n\n```\n{format_summary(doc)}\n```\n"
    )
    return doc


def _done(kills: list[dict[str, Any]]) -> int:
    """Kills that killed (a kill is skipped where its pool has a single live worker)."""
    return sum(1 for k in kills if "skipped" not in k)


def format_summary(doc: dict[str, Any]) -> str:
    r, rss = doc["requests"], doc["rss"]
    done = _done(doc["kills"])
    lines = [
        f"soak: {doc['load_s'] / 60:.1f} min of load, {done} kills"
        + (f" ({len(doc['kills']) - done} skipped)" if done < len(doc["kills"]) else "")
        + f", shape {doc['cluster']['shape']}",
        f"requests: {r['sent']} sent, {r['completed']} completed, {r['lost']} lost, {r['refused']} refused, "
        f"{r['cancelled']} cancelled (by the client), {r['mismatched']} with wrong tokens",
        f"migrations: {doc['migrations']}",
        f"KV blocks leaked: {doc['kv_blocks_leaked']} (clean: {doc['leak_check']['clean']})",
        f"RSS rise after {rss['warmup_s']:g} s warm-up (limit {rss['flat_limit']:.0%}; flat: {rss['flat']}): "
        + (", ".join(f"{k} {v:.1%}" for k, v in rss["max_rise"].items()) or "no process sampled long enough"),
        "RSS rise on unsmoothed samples: "
        + (", ".join(f"{k} {v:.1%}" for k, v in rss["max_rise_raw"].items()) or "-"),
        "RSS distance from the baseline, either way: "
        + (", ".join(f"{k} {v:.1%}" for k, v in rss["max_drift"].items()) or "-"),
    ]
    for k in doc["kills"]:
        if "skipped" in k:  # a pool with one worker left is not emptied by the soak
            lines.append(f"  kill at {k['t_s']:.0f} s skipped: {k['role']} pool has {k['skipped']}")
            continue
        busy = f" ({k['in_flight_at_kill']} in flight)" if "in_flight_at_kill" in k else ""
        who = f"{k.get('worker', '-')}{busy} -> {k.get('replacement')}"
        lines.append(f"  kill at {k['t_s']:.0f} s: {who} {k.get('error', '')}")
    lines.append(f"worker crashes (died without being killed): {len(doc['crashes'])}")
    for c in doc["crashes"]:
        lines.append(f"  {c['worker']} died at {c['t_s']:.0f} s")
    for x in doc["lost"][:10]:
        lines.append(f"  lost {x['request_id']} ({x['front']}): {x['error']}")
    lines.append("verdict: " + ("OK" if doc["ok"] else "FAILED (lost, leaked, wrong tokens or a crash)"))
    return "\n".join(lines)


# ---- command line -------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = SoakConfig(minutes=1, out_dir=Path("."))
    p.add_argument("--minutes", type=float, required=True, help="how long the load runs")
    p.add_argument("--out-dir", type=Path, default=None, help="where results go (default runs/soak-<time>)")
    p.add_argument(
        "--state-dir", type=Path, default=None,
        help="attach to the cluster `pdserve up` runs there "
        "(default: start one under --out-dir, stop it after)",
    )  # fmt: skip
    p.add_argument("--prefill", type=int, default=d.prefill, help="a started cluster's prefill workers")
    p.add_argument("--decode", type=int, default=d.decode, help="a started cluster's decode workers")
    p.add_argument("--model", default=d.model, help="a started cluster's model")
    p.add_argument("--dtype", default=d.dtype, help="a started cluster's dtype")
    p.add_argument("--kv-cache-mib", type=int, default=d.kv_cache_mib, help="each started worker's KV cache")
    p.add_argument(
        "--concurrency", type=int, default=d.concurrency, help="clients, one request in flight each"
    )
    p.add_argument("--kill-interval", type=float, default=d.kill_interval_s, help="seconds between SIGKILLs")
    p.add_argument(
        "--first-kill", type=float, default=None, help="seconds to the first (default: the interval)"
    )
    p.add_argument(
        "--sample-interval", type=float, default=d.sample_interval_s, help="RSS sampling period (s)"
    )
    p.add_argument(
        "--warmup", type=float, default=d.warmup_s, help="seconds of each process's RSS not judged"
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=d.request_timeout_s,
        help="each request's deadline (s)",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="the traffic's random seed")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


def config_from_args(args: argparse.Namespace) -> SoakConfig:
    out = args.out_dir or Path("runs") / f"soak-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    return SoakConfig(
        minutes=args.minutes,
        out_dir=out,
        state_dir=args.state_dir,
        prefill=args.prefill,
        decode=args.decode,
        model=args.model,
        dtype=args.dtype,
        kv_cache_mib=args.kv_cache_mib,
        concurrency=args.concurrency,
        kill_interval_s=args.kill_interval,
        first_kill_s=args.first_kill,
        sample_interval_s=args.sample_interval,
        warmup_s=args.warmup,
        request_timeout_s=args.request_timeout,
        seed=args.seed,
        progress=not args.no_progress,
    )


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through soak_cluster, which stops a cluster it started


def run_from_args(args: argparse.Namespace) -> int:
    """0: the soak ran and lost, leaked and corrupted nothing; 3: it ran and did; 1: it could not run."""
    try:
        import psutil  # noqa: F401
    except ImportError:
        print(
            "pdserve bench soak: needs psutil (pip install psutil, or pdserve's test extras)", file=sys.stderr
        )
        return 1
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        cfg = config_from_args(args)
        doc = run_soak(cfg, shlex.join(["pdserve", *sys.argv[1:]]))
    except (RuntimeError, ValueError, OSError, grpc.RpcError) as e:
        print(f"pdserve bench soak: {e}", file=sys.stderr)
        return 1
    print(format_summary(doc), flush=True)
    print(f"pdserve bench soak: results in {cfg.out_dir}", file=sys.stderr)
    return 0 if doc["ok"] else 3
