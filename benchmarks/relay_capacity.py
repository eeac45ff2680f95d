"""How many tokens per second one router process relays, and its CPU per relayed token, with one router and
with two sharing the load: ``python -m benchmarks.relay_capacity [--quick] [--out FILE]``.

Fake decode workers (``benchmarks.fake_decode_worker``: no model, tokens as fast as the stream takes them)
register with two ``pdserve router`` processes. For each front (gRPC ``Generation/Generate``, HTTP
streaming ``/v1/completions``) and each concurrency, load processes (``benchmarks.relay_load``) run that
many streams for fixed windows after a warm-up, all against router A and split evenly over A and B in
turn. Every process's utime + stime (``/proc/PID/stat``) is read at each window's start and end, so the
routers' CPU-seconds per relayed token stand beside what the load and the workers used on the same cores.
Every process started here is stopped when the run ends, whatever happens. Details: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from pdserve.proto import worker_pb2, worker_pb2_grpc

FRONTS = ("grpc", "http")
# Text whose tokens each decode to a whole word: every relayed token is one text event on HTTP.
STREAM_TEXT = " the cat sat on the mat and looked at a dog"
PROMPT_TEXT = " a short prompt of a few words"
START_TIMEOUT_S = 120.0
SETTLE_TIMEOUT_S = 30.0
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _log(msg: str) -> None:
    print(f"[relay_capacity] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (every thread), in seconds."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def machine_busy_seconds() -> float:
    """CPU-seconds every core of the machine spent busy (``/proc/stat``: all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / CLK_TCK


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def check_alive(self) -> None:
        if self.popen.poll() is not None:
            tail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{tail}")


class Processes:
    """Every process the run starts, each in its own process group; ``stop_all`` ends them all."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[Proc] = []

    def start(self, name: str, argv: Sequence[str], pipes: bool = False) -> Proc:
        """``pipes``: its stdin and stdout are pipes to this process (else stdin is empty, stdout its log)."""
        log = self.log_dir / f"{name}.log"
        env = {k: v for k, v in os.environ.items() if k != "PDSERVE_CLUSTER_TOKEN_FILE"}
        with log.open("wb") as err:
            popen = subprocess.Popen(
                [sys.executable, "-m", *argv],
                stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
                stdout=subprocess.PIPE if pipes else err,
                stderr=err,
                start_new_session=True,
                env=env,
            )
        p = Proc(name, popen, log)
        self.procs.append(p)
        return p

    def stop(self, p: Proc, grace_s: float = 5.0) -> None:
        if p.popen.poll() is None:
            with_group(p.pid, signal.SIGTERM)
            try:
                p.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        with_group(p.pid, signal.SIGKILL)  # (anything the group left behind)
        if p.popen.poll() is None:
            p.popen.wait(5.0)
        for pipe in (p.popen.stdin, p.popen.stdout):
            if pipe is not None:
                pipe.close()

    def stop_all(self) -> None:
        for p in reversed(self.procs):
            try:
                self.stop(p)
            except Exception as e:  # noqa: BLE001 - the others are stopped all the same
                _log(f"stopping {p.name}: {e!r}")
        self.procs.clear()


def with_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class Router:
    proc: Proc
    grpc_address: str
    http_url: str

    def status(self) -> worker_pb2.ClusterStatus:
        with grpc.insecure_channel(self.grpc_address) as ch:
            return worker_pb2_grpc.RegistryStub(ch).GetClusterStatus(worker_pb2.Empty(), timeout=5.0)


def wait_until(predicate, timeout_s: float, what: str, procs: Sequence[Proc]) -> None:
    give_up = time.monotonic() + timeout_s
    while True:
        for p in procs:
            p.check_alive()
        try:
            if predicate():
                return
        except grpc.RpcError:
            pass  # (not up yet)
        if time.monotonic() > give_up:
            raise RuntimeError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.1)


def generation_serving(address: str) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="pdserve.v1.Generation"), timeout=2.0
        )
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def start_routers(procs: Processes, n: int, model: str) -> list[Router]:
    routers = []
    for i in range(n):
        port, http_port = free_port(), free_port()
        argv = [
            "pdserve.cli", "router", "--host", "127.0.0.1", "--port", str(port),
            "--http-port", str(http_port), "--metrics-port", "0", "--model", model,
            "--max-waiting", "4096", "--heartbeat-timeout", "10",
        ]  # fmt: skip
        p = procs.start(f"router{i}", argv)
        routers.append(Router(p, f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}"))
    for r in routers:
        wait_until(lambda r=r: generation_serving(r.grpc_address), START_TIMEOUT_S, "the routers", [r.proc])
    return routers


def start_workers(
    procs: Processes, n: int, routers: Sequence[Router], token_ids: Sequence[int]
) -> list[Proc]:
    workers = []
    for i in range(n):
        argv = [
            "benchmarks.fake_decode_worker", "--routers", ",".join(r.grpc_address for r in routers),
            "--worker-id", f"fake-decode-{i}", "--token-ids", ",".join(map(str, token_ids)),
        ]  # fmt: skip
        workers.append(procs.start(f"worker{i}", argv))

    def all_ready() -> bool:
        for r in routers:
            ready = [w for w in r.status().workers if w.load.state == worker_pb2.WORKER_STATE_READY]
            if len(ready) < n:
                return False
        return True

    wait_until(
        all_ready, START_TIMEOUT_S, "the fake workers to register", [*workers, *(r.proc for r in routers)]
    )
    return workers


def settle(routers: Sequence[Router], procs: Sequence[Proc]) -> None:
    """Until no router has a request in flight (the last case's cut streams are gone)."""

    def idle() -> bool:
        return all(r.status().requests_running == 0 for r in routers)

    wait_until(idle, SETTLE_TIMEOUT_S, "the routers to finish the last case's requests", procs)


def wait_for_line(p: Proc, expected: bytes, timeout_s: float) -> None:
    """Until ``p`` prints ``expected`` on its stdout (bounded; its exit or another line is an error)."""
    assert p.popen.stdout is not None
    ready, _, _ = select.select([p.popen.stdout], [], [], timeout_s)
    line = p.popen.stdout.readline().strip() if ready else b""
    if line != expected:
        p.check_alive()
        raise RuntimeError(f"{p.name}: expected {expected!r} within {timeout_s:.0f}s, got {line!r}")


def split(streams: int, parts: int) -> list[int]:
    """``streams`` over ``parts`` load processes as evenly as can be (none empty)."""
    parts = min(parts, streams)
    return [streams // parts + (1 if i < streams % parts else 0) for i in range(parts)]


def measure(
    procs: Processes,
    cfg: argparse.Namespace,
    front: str,
    streams: int,
    routers: Sequence[Router],
    all_routers: Sequence[Router],
    workers: Sequence[Proc],
    prompt_ids: Sequence[int],
    profile: bool = False,
) -> dict[str, Any]:
    """One window of one front, concurrency and router count: load processes (two, or one for a single
    stream) spread over ``routers``, each router taking the same share. Raw sums, pooled by ``pool``."""
    shares = split(streams, 2)
    targets = [routers[i % len(routers)] for i in range(len(shares))]
    clients = []
    for i, (n, r) in enumerate(zip(shares, targets, strict=True)):
        argv = [
            "benchmarks.relay_load", "--front", front,
            "--target", r.grpc_address if front == "grpc" else r.http_url,
            "--streams", str(n), "--max-tokens", str(cfg.max_tokens),
            "--prompt-ids", ",".join(map(str, prompt_ids)),
        ]  # fmt: skip
        clients.append(procs.start(f"load-{front}-{streams}-{len(routers)}r-{i}", argv, pipes=True))
    watched = {"router": [r.proc for r in routers], "worker": list(workers), "load": clients}
    profiler = None
    try:
        for c in clients:  # each imported and ready: the window is the same for all
            wait_for_line(c, b"READY", START_TIMEOUT_S)
        start = time.monotonic() + cfg.warmup
        end = start + cfg.duration
        for c in clients:
            assert c.popen.stdin is not None
            c.popen.stdin.write(f"{start:.6f} {end:.6f}\n".encode())
            c.popen.stdin.flush()
        time.sleep(max(start - time.monotonic(), 0.0))
        for p in (*clients, *workers, *(r.proc for r in all_routers)):
            p.check_alive()
        before = {k: [cpu_seconds(p.pid) for p in ps] for k, ps in watched.items()}
        busy0 = machine_busy_seconds()
        t0 = time.monotonic()
        if profile:
            profiler = start_profile(cfg, procs, routers[0], front, streams)
        time.sleep(max(end - time.monotonic(), 0.0))
        after = {k: [cpu_seconds(p.pid) for p in ps] for k, ps in watched.items()}
        busy1 = machine_busy_seconds()
        t1 = time.monotonic()
        results = []
        for c in clients:
            out, _ = c.popen.communicate(timeout=60.0)
            if c.popen.returncode != 0:
                raise RuntimeError(f"{c.name} exited with {c.popen.returncode}:\n{c.log.read_text()[-2000:]}")
            results.append(json.loads(out.decode().strip().splitlines()[-1]))
    finally:
        for c in clients:
            procs.stop(c)
            procs.procs.remove(c)
    late = [c.name for c, r in zip(clients, results, strict=True) if r["late"]]
    if late:  # its window started after the CPU readings did: its tokens would be undercounted
        raise RuntimeError(f"{', '.join(late)} started after the window began: give it a --warmup")
    prof = finish_profile(profiler, procs) if profiler is not None else None
    settle(all_routers, [r.proc for r in all_routers])
    m: dict[str, Any] = {
        "window_s": t1 - t0,
        "tokens": sum(r["window_tokens"] for r in results),
        "tokens_per_router": [
            sum(res["window_tokens"] for res, t in zip(results, targets, strict=True) if t is r)
            for r in routers
        ],
        "streams_per_router": [
            sum(n for n, t in zip(shares, targets, strict=True) if t is r) for r in routers
        ],
        "cpu_s": {k: sum(a - b for a, b in zip(after[k], before[k], strict=True)) for k in watched},
        "router_cpu_s_per_router": [a - b for a, b in zip(after["router"], before["router"], strict=True)],
        "machine_busy_s": busy1 - busy0,
        **{
            k: sum(r[k] for r in results)
            for k in ("requests_done", "errors", "usage_checked", "usage_mismatches")
        },
        "first_error": next((r["first_error"] for r in results if r["first_error"]), ""),
    }
    if prof is not None:
        m["profile"] = prof
    return m


def pool(front: str, streams: int, routers: int, rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One case's figures over its rounds: sums of tokens, seconds and CPU-seconds (a ratio of sums, so a
    short or slow round weighs what it relayed); the router's CPU per token of each round beside them."""
    window = sum(m["window_s"] for m in rounds)
    tokens = sum(m["tokens"] for m in rounds)
    cpu = {k: sum(m["cpu_s"][k] for m in rounds) for k in rounds[0]["cpu_s"]}
    busy = sum(m["machine_busy_s"] for m in rounds)

    def per_token(seconds: float) -> float | None:
        return 1e6 * seconds / tokens if tokens else None

    case: dict[str, Any] = {
        "front": front,
        "streams": streams,
        "routers": routers,
        "rounds": len(rounds),
        "streams_per_router": rounds[0]["streams_per_router"],
        "window_s": window,
        "tokens": tokens,
        "tokens_per_s": tokens / window,
        "tokens_per_s_per_router": [
            sum(m["tokens_per_router"][i] for m in rounds) / window for i in range(routers)
        ],
        "router_cpu_s": cpu["router"],
        "router_cpu_s_per_router": [
            sum(m["router_cpu_s_per_router"][i] for m in rounds) for i in range(routers)
        ],
        "router_cores": cpu["router"] / window,
        "router_cpu_us_per_token": per_token(cpu["router"]),
        "router_cpu_us_per_token_by_round": [
            1e6 * m["cpu_s"]["router"] / m["tokens"] if m["tokens"] else None for m in rounds
        ],
        "load_cpu_s": cpu["load"],
        "worker_cpu_s": cpu["worker"],
        "load_cpu_us_per_token": per_token(cpu["load"]),
        "worker_cpu_us_per_token": per_token(cpu["worker"]),
        "router_share_of_cpu": cpu["router"] / sum(cpu.values()) if sum(cpu.values()) else None,
        # The machine's busy cores over the windows, and those of processes this run did not start.
        "machine_busy_cores": busy / window,
        "other_cores": max(busy - sum(cpu.values()), 0.0) / window,
        **{
            k: sum(m[k] for m in rounds)
            for k in ("requests_done", "errors", "usage_checked", "usage_mismatches")
        },
        "first_error": next((m["first_error"] for m in rounds if m["first_error"]), ""),
    }
    profiles = [m["profile"] for m in rounds if "profile" in m]
    if profiles:
        case["profiled"] = True
        case["profile"] = profiles[0]
    _log(
        f"{front} {streams} streams, {routers} router(s): {case['tokens_per_s']:,.0f} tok/s, router "
        f"{case['router_cpu_us_per_token'] or 0:.1f} us/token ({case['router_cores']:.2f} cores), other "
        f"{case['other_cores']:.2f} cores, errors {case['errors']}"
    )
    return case


def start_profile(
    cfg: argparse.Namespace, procs: Processes, router: Router, front: str, streams: int
) -> Proc:
    """py-spy on the router for the window (this case's figures are then marked ``profiled``)."""
    out = cfg.log_dir / f"py-spy-{front}-{streams}.txt"
    argv = [
        cfg.py_spy, "record", "--format", "raw", "--nonblocking", "--rate", "100",
        "--duration", str(max(int(cfg.duration) - 1, 1)), "--pid", str(router.proc.pid), "--output", str(out),
    ]  # fmt: skip
    log = cfg.log_dir / f"py-spy-{front}-{streams}.log"
    with log.open("wb") as err:
        popen = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=err, stderr=err, start_new_session=True
        )
    p = Proc(f"py-spy-{front}", popen, out)
    procs.procs.append(p)
    return p


def finish_profile(p: Proc, procs: Processes, top: int = 15) -> dict[str, Any]:
    """The profile's top functions: by own samples (the stack's last frame) and by samples under them."""
    try:
        p.popen.wait(30.0)
    except subprocess.TimeoutExpired:
        pass
    procs.stop(p)
    procs.procs.remove(p)
    own: dict[str, int] = {}
    under: dict[str, int] = {}
    total = 0
    if p.log.exists():
        for line in p.log.read_text(errors="replace").splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            frames = stack.split(";")
            total += n
            own[frames[-1]] = own.get(frames[-1], 0) + n
            for f in set(frames):
                under[f] = under.get(f, 0) + n

    def ranked(d: dict[str, int]) -> list[list[Any]]:
        return (
            [[f, round(c / total, 4)] for f, c in sorted(d.items(), key=lambda kv: -kv[1])[:top]]
            if total
            else []
        )

    return {"samples": total, "own": ranked(own), "inclusive": ranked(under), "raw": str(p.log)}


# Decode workers' output rates (tokens/s each) for the table of workers one router core fronts.
WORKER_RATES = (250, 500, 1000, 2000, 4000, 8000)


def capacity(cases: Sequence[dict[str, Any]], cfg: argparse.Namespace) -> dict[str, Any]:
    """Decode workers one router fronts, per front, from the most loaded one-router case."""
    per_worker = cfg.assume_streams_per_worker * cfg.assume_tokens_per_s_per_stream
    fraction = cfg.router_core_fraction
    out: dict[str, Any] = {
        "assumptions": {
            "streams_per_worker": cfg.assume_streams_per_worker,
            "tokens_per_s_per_stream": cfg.assume_tokens_per_s_per_stream,
            "tokens_per_s_per_worker": per_worker,
            "router_core_fraction": fraction,
            "basis": (
                "a router process relays on one core (one event loop); one core relays 1 / (router "
                "CPU-seconds per relayed token) tokens/s, the per-token cost taken from the one-router case "
                "with the most streams (requests of max_tokens tokens: per-request costs are spread over "
                "them); planned at router_core_fraction of that core; a decode worker streams "
                "streams_per_worker x tokens_per_s_per_stream tokens/s"
            ),
        }
    }
    for front in FRONTS:
        one = [c for c in cases if c["front"] == front and c["routers"] == 1 and c["router_cpu_us_per_token"]]
        if not one:
            continue
        c = max(one, key=lambda c: c["streams"])
        core_tok_s = 1e6 / c["router_cpu_us_per_token"]
        planned = fraction * core_tok_s
        out[front] = {
            "from_case_streams": c["streams"],
            "router_cpu_us_per_token": c["router_cpu_us_per_token"],
            "router_core_tokens_per_s": core_tok_s,
            "planned_tokens_per_s": planned,
            "decode_workers_per_router": planned / per_worker,
            "decode_workers_per_router_at": {str(r): planned / r for r in WORKER_RATES},
        }
    return out


def ratios(cases: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """CPU per relayed token with two routers over one, per front and concurrency (1.0: the same)."""
    out = []
    for c2 in (c for c in cases if c["routers"] == 2):
        c1 = next(
            (
                c
                for c in cases
                if c["routers"] == 1 and c["front"] == c2["front"] and c["streams"] == c2["streams"]
            ),
            None,
        )
        if c1 is None or not c1["router_cpu_us_per_token"] or not c2["router_cpu_us_per_token"]:
            continue
        r = c2["router_cpu_us_per_token"] / c1["router_cpu_us_per_token"]
        out.append(
            {
                "front": c2["front"],
                "streams": c2["streams"],
                "one_router_us_per_token": c1["router_cpu_us_per_token"],
                "two_routers_us_per_token": c2["router_cpu_us_per_token"],
                "two_over_one": r,
                "within_15_percent": abs(r - 1.0) <= 0.15,
                "tokens_per_s_two_over_one": c2["tokens_per_s"] / c1["tokens_per_s"],
            }
        )
    return out


def run(cfg: argparse.Namespace) -> dict[str, Any]:
    from pdserve.bench.machine import machine_info
    from pdserve.router.server import load_frontend

    tokenizer, _ = load_frontend(cfg.model)
    token_ids = tokenizer.encode(STREAM_TEXT, add_special_tokens=False)
    prompt_ids = tokenizer.encode(PROMPT_TEXT, add_special_tokens=False)
    cfg.log_dir = Path(tempfile.mkdtemp(prefix="pdserve-relay-capacity-"))
    _log(f"logs in {cfg.log_dir}")
    procs = Processes(cfg.log_dir)
    cases: list[dict[str, Any]] = []
    try:
        routers = start_routers(procs, 2, cfg.model)
        workers = start_workers(procs, cfg.workers, routers, token_ids)
        _log(f"routers {[r.proc.pid for r in routers]}, workers {[w.pid for w in workers]}")
        for front in cfg.fronts:
            for streams in cfg.streams:
                # (one stream cannot be split over two routers)
                counts = (1,) if streams < 2 else (1, 2)
                rounds: dict[int, list[dict[str, Any]]] = {n: [] for n in counts}
                for r in range(cfg.rounds):
                    # Alternating which goes first: drift in the machine's speed hits both alike.
                    for n in counts if r % 2 == 0 else counts[::-1]:
                        profile = bool(cfg.py_spy) and n == 1 and r == 0 and streams == max(cfg.streams)
                        rounds[n].append(
                            measure(
                                procs, cfg, front, streams, routers[:n], routers, workers, prompt_ids, profile
                            )
                        )
                cases.extend(pool(front, streams, n, rounds[n]) for n in counts)
    finally:
        procs.stop_all()
    return {
        "command": "python -m benchmarks.relay_capacity " + " ".join(cfg.argv),
        "machine": machine_info(),
        "model": cfg.model,
        "settings": {
            "fake_decode_workers": cfg.workers,
            "max_tokens": cfg.max_tokens,
            "prompt_tokens": len(prompt_ids),
            "warmup_s": cfg.warmup,
            "window_s": cfg.duration,
            "rounds": cfg.rounds,
            "load_processes_per_case": 2,
            "streamed_token_ids": token_ids,
        },
        "cases": cases,
        "two_routers_over_one": ratios(cases),
        "capacity": capacity(cases, cfg),
    }


def report(result: dict[str, Any]) -> str:
    lines = [
        f"relay capacity, {result['machine']['cpu']} ({result['machine']['cores']} cores), "
        f"{result['settings']['fake_decode_workers']} fake decode workers, "
        f"{result['settings']['max_tokens']} tokens per request",
        "",
        "| front | streams | routers | tokens/s | router CPU us/token | router cores | load us/token | "
        "worker us/token | other cores | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in result["cases"]:
        us = c["router_cpu_us_per_token"]
        lines.append(
            f"| {c['front']} | {c['streams']} | {c['routers']} | {c['tokens_per_s']:,.0f} | "
            f"{'-' if us is None else f'{us:.1f}'} | {c['router_cores']:.2f} | "
            f"{c['load_cpu_us_per_token'] or 0:.1f} | {c['worker_cpu_us_per_token'] or 0:.1f} | "
            f"{c['other_cores']:.2f} | {c['errors']} |"
        )
    lines.append("")
    for r in result["two_routers_over_one"]:
        verdict = "within 15%" if r["within_15_percent"] else "NOT within 15%"
        lines.append(
            f"{r['front']} {r['streams']} streams: router CPU per token, 2 routers / 1 = "
            f"{r['two_over_one']:.3f} ({verdict})"
        )
    cap = result["capacity"]
    a = cap["assumptions"]
    lines.append("")
    for front in FRONTS:
        if front in cap:
            f = cap[front]
            lines.append(
                f"{front}: {f['router_cpu_us_per_token']:.1f} us of router CPU per token -> one router core "
                f"relays {f['router_core_tokens_per_s']:,.0f} tok/s; at {a['router_core_fraction']:g} of it, "
                f"{f['decode_workers_per_router']:.1f} decode workers of {a['streams_per_worker']} streams x "
                f"{a['tokens_per_s_per_stream']:g} tok/s ({a['tokens_per_s_per_worker']:,.0f} tok/s each)"
            )
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> bool:
    """Tokens/s and router CPU per token per case; False (and no file) where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cases = result["cases"]
    labels = [f"{c['front']}\n{c['streams']}x{c['routers']}R" for c in cases]
    colors = ["tab:blue" if c["routers"] == 1 else "tab:orange" for c in cases]
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    axes[0].bar(labels, [c["tokens_per_s"] for c in cases], color=colors)
    axes[0].set_title("relayed tokens/s (all routers)", fontsize=9)
    axes[1].bar(labels, [c["router_cpu_us_per_token"] or 0.0 for c in cases], color=colors)
    axes[1].set_title("router CPU us per relayed token (sum over routers)", fontsize=9)
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(
        f"router relay capacity (streams x routers; blue 1 router, orange 2), {result['machine']['cpu']}, "
        f"{result['machine']['cores']} cores",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.relay_capacity", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", default="smollm2-135m-instruct", help="the routers' --model (its tokenizer)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 1 and 64 streams, short windows")
    p.add_argument("--streams", default=None, help="comma-separated concurrencies (default 1,64,512)")
    p.add_argument("--fronts", default=",".join(FRONTS), help=f"comma-separated, of {', '.join(FRONTS)}")
    p.add_argument("--workers", type=int, default=2, help="fake decode worker processes")
    p.add_argument("--max-tokens", type=int, default=256, help="output tokens per request")
    p.add_argument("--warmup", type=float, default=None, help="seconds of load before the window (default 2)")
    p.add_argument(
        "--duration", type=float, default=None, help="each round's measured window, seconds (default 5)"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="windows per case, one and two routers alternating (default 3)",
    )
    p.add_argument("--assume-streams-per-worker", type=int, default=64)
    p.add_argument("--assume-tokens-per-s-per-stream", type=float, default=30.0)
    p.add_argument(
        "--router-core-fraction", type=float, default=0.7, help="of its core a router is planned to use"
    )
    p.add_argument(
        "--py-spy", default=None, help="py-spy binary: profile router A in the most loaded 1-router case"
    )
    p.add_argument(
        "--out", type=Path, default=None, help="write the JSON here (and the plot beside it, .png)"
    )
    a = p.parse_args(argv)
    a.argv = list(argv) if argv is not None else sys.argv[1:]
    default_streams = "1,64" if a.quick else "1,64,512"
    a.streams = tuple(int(s) for s in (a.streams or default_streams).split(",") if s)
    a.fronts = tuple(dict.fromkeys(f.strip() for f in a.fronts.split(",") if f.strip()))
    a.warmup = a.warmup if a.warmup is not None else (0.5 if a.quick else 2.0)
    a.duration = a.duration if a.duration is not None else (1.5 if a.quick else 5.0)
    a.rounds = a.rounds if a.rounds is not None else (1 if a.quick else 3)
    if not a.streams or min(a.streams) < 1:
        p.error("--streams: concurrencies >= 1")
    if not a.fronts or any(f not in FRONTS for f in a.fronts):
        p.error(f"--fronts: of {', '.join(FRONTS)}")
    if a.workers < 1 or a.max_tokens < 1 or a.rounds < 1 or a.duration <= 0 or a.warmup <= 0:
        p.error("--workers, --max-tokens, --rounds >= 1; --duration, --warmup > 0")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    from pdserve.bench.report import write_json

    cfg = parse_args(argv)
    result = run(cfg)
    text = report(result)
    if cfg.out is not None:
        write_json(cfg.out, result)
        png = cfg.out.with_suffix(".png")
        text += f"\nwritten: {cfg.out}" + (
            f", {png}\n" if plot(result, png) else " (no plot: no matplotlib)\n"
        )
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
