"""The cluster a soak runs against: attach or start it, kill and replace its workers, check its leaks.

Everything here talks to the cluster through its state file (``deploy.local.cluster``), the router's
control plane and the workers' own ``GetLoad``; ``bench.soak`` drives it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.bench.sweep import ClusterSpec, Shape, local_cluster


@dataclass
class Target:
    """The cluster under test, as its state file and router describe it."""

    state_dir: Path
    attached: bool
    router: str
    http_url: str
    metrics_url: str
    model: str
    shape: dict[str, int]
    token: str
    tls: Any  # worker.tls.TLSConfig


def _target(state_dir: Path, attached: bool) -> Target:
    from pdserve.deploy.local import cluster

    state = cluster.load_state(state_dir)
    if state is None:
        raise RuntimeError(f"no cluster in {state_dir}")
    token, tls = cluster.state_token(state), cluster.state_tls(state)
    status = cluster.cluster_status(cluster.live_router(state), token=token, tls=tls)
    shape = {r: sum(1 for w in state.workers if w.role and w.role.value == r) for r in ("prefill", "decode")}
    return Target(
        state_dir, attached, state.router_list, status.http_url, status.metrics_url, state.model, shape,
        token, tls,
    )  # fmt: skip


@contextlib.contextmanager
def soak_cluster(state_dir: Path | None, new_dir: Path, shape: Shape, spec: ClusterSpec) -> Iterator[Target]:
    """The cluster in ``state_dir`` when one runs there; else a new one of ``shape`` in ``state_dir`` (or
    ``new_dir``), always stopped after."""
    from pdserve.deploy.local import cluster

    if state_dir is not None and cluster.load_state(state_dir) is not None:
        yield _target(state_dir, attached=True)
        return
    state_dir = state_dir or new_dir
    with local_cluster(shape, spec, state_dir):
        yield _target(state_dir, attached=False)


# ---- kills --------------------------------------------------------------------------------------------

KILL_BUSY_WAIT_S = 10.0  # how long a kill waits for a worker of its pool to have a request in flight


class DeathWatch:
    """Workers that died without the soak killing them (crashes): one event each, with its log's tail.

    A worker counts as dead once its process is gone or it left the state file (`pdserve scale` drops
    dead workers); ``killed`` holds the ids the soak killed itself, marked before the signal is sent.
    """

    def __init__(self) -> None:
        self.known: dict[str, Any] = {}  # id -> cluster.ProcessEntry, every worker seen alive
        self.killed: set[str] = set()
        self.deaths: list[dict[str, Any]] = []

    def check(self, state: Any, t: float) -> list[dict[str, Any]]:
        """``state``: the cluster's state now (None: unreadable, nothing judged). Returns the new deaths."""
        from pdserve.deploy.local import cluster

        if state is None:
            return []
        listed = {w.id: w for w in state.workers}
        new = []
        for wid, w in list(self.known.items()):
            if wid in listed and cluster.alive(listed[wid]):
                continue
            del self.known[wid]
            if wid not in self.killed:
                role = w.role.value if w.role else "?"
                new.append({"t_s": round(t, 2), "worker": wid, "pid": w.pid, "role": role,
                            "log_tail": cluster.log_tail(w.log, 8)})  # fmt: skip
        for wid, w in listed.items():
            if wid not in self.killed and cluster.alive(w):
                self.known.setdefault(wid, w)
        self.deaths += new
        return new


def restore_shape(target: Target, clock: Callable[[], float]) -> dict[str, Any]:
    """`pdserve scale` every pool back to the cluster's shape (replacing killed and crashed workers)."""
    from pdserve.deploy.local import cluster

    before = cluster.load_state(target.state_dir)
    argv = [sys.executable, "-m", "pdserve.cli", "scale", "--state-dir", str(target.state_dir)]
    for role, n in target.shape.items():
        argv += [f"--{role}", str(n)]
    out = subprocess.run(
        argv + ["--timeout", "240"], capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL
    )
    after = cluster.load_state(target.state_dir)
    old = {w.id for w in (before.workers if before else ())}
    event: dict[str, Any] = {
        "replaced_s": round(clock(), 2),
        "replacement": [w.id for w in (after.workers if after else ()) if w.id not in old],
    }
    if out.returncode != 0:
        event["error"] = f"`pdserve scale` failed: {out.stderr.strip()[-1500:]}"
    return event


def in_flight(target: Target, ids: set[str]) -> dict[str, int]:
    """Requests running or queued on each of the workers ``ids``, asked of each worker itself (GetLoad:
    no heartbeat lag). A worker the router does not list, or one that cannot answer, is left out."""
    from pdserve.deploy.local import cluster
    from pdserve.proto import worker_pb2, worker_pb2_grpc
    from pdserve.worker.auth import token_metadata
    from pdserve.worker.tls import channel

    try:
        status = cluster.cluster_status(target.router, token=target.token, tls=target.tls)
    except Exception:  # noqa: BLE001 - the router's list only says where the workers listen
        return {}
    out: dict[str, int] = {}
    for e in status.workers:
        if e.info.worker_id not in ids:
            continue
        try:
            with channel(e.info.address, target.tls) as ch:
                load = worker_pb2_grpc.WorkerStub(ch).GetLoad(
                    worker_pb2.Empty(), timeout=2, metadata=token_metadata(target.token)
                )
        except Exception:  # noqa: BLE001 - a worker that cannot answer is not picked for its load
            continue
        out[e.info.worker_id] = load.running + load.queued
    return out


def kill_and_replace(
    target: Target,
    role: str,
    watch: DeathWatch,
    clock: Callable[[], float],
    busy_wait_s: float = KILL_BUSY_WAIT_S,
) -> dict[str, Any]:
    """SIGKILL the busiest live worker of ``role``, then bring every pool back to its shape. A pool down to
    one live worker (a crash not yet replaced) is only restored: a healthy worker of each role stays.

    The kill waits (up to ``busy_wait_s``) for a worker with a request in flight, so that it tests the
    migration of work under load rather than the loss of an idle worker; ``in_flight_at_kill`` in the
    event is what that worker itself reported just before the signal (0: none was busy in time)."""
    from pdserve.deploy.local import cluster

    state = cluster.load_state(target.state_dir)
    live = [
        w for w in (state.workers if state else ()) if w.role and w.role.value == role and cluster.alive(w)
    ]
    if len(live) < 2:
        return {"t_s": round(clock(), 2), "role": role, "skipped": f"{len(live)} live {role} worker(s)",
                **restore_shape(target, clock)}  # fmt: skip
    t0 = time.monotonic()
    while True:
        busy = in_flight(target, {w.id for w in live})
        victim = max(live, key=lambda w: busy.get(w.id, 0))
        if busy.get(victim.id, 0) > 0 or time.monotonic() - t0 >= busy_wait_s:
            break
        time.sleep(0.05)
    watch.killed.add(victim.id)  # before the signal: its death is not a crash
    os.kill(victim.pid, signal.SIGKILL)
    event: dict[str, Any] = {"t_s": round(clock(), 2), "role": role, "worker": victim.id, "pid": victim.pid}
    event["in_flight_at_kill"] = busy.get(victim.id, 0)
    event["waited_for_load_s"] = round(time.monotonic() - t0, 2)
    cluster.wait_exit([victim], 10.0)  # `scale` counts live workers: the victim must be gone first
    return {**event, **restore_shape(target, clock)}


# ---- the end: leaks and the router's counters ---------------------------------------------------------


def leak_check(target: Target, timeout_s: float) -> dict[str, Any]:
    """Ask every registered worker itself for its KV blocks until all hold none, or ``timeout_s``."""
    from pdserve.deploy.local import cluster
    from pdserve.proto import worker_pb2, worker_pb2_grpc
    from pdserve.worker.auth import token_metadata
    from pdserve.worker.tls import channel

    t0 = time.monotonic()
    while True:
        status = cluster.cluster_status(target.router, token=target.token, tls=target.tls)
        workers: dict[str, dict[str, Any]] = {}
        for e in status.workers:
            try:
                with channel(e.info.address, target.tls) as ch:
                    load = worker_pb2_grpc.WorkerStub(ch).GetLoad(
                        worker_pb2.Empty(), timeout=5, metadata=token_metadata(target.token)
                    )
                workers[e.info.worker_id] = {
                    "kv_blocks_used": load.kv_blocks_used, "kv_blocks_total": load.kv_blocks_total,
                    "running": load.running, "queued": load.queued,
                }  # fmt: skip
            except Exception as err:  # noqa: BLE001 - reported: a worker that cannot answer is not clean
                workers[e.info.worker_id] = {"error": str(err)[:300], "kv_blocks_used": None}
        leaked = sum(w["kv_blocks_used"] or 0 for w in workers.values())
        busy = sum(w.get("running", 0) + w.get("queued", 0) for w in workers.values())
        clean = leaked == 0 and busy == 0 and all(w["kv_blocks_used"] is not None for w in workers.values())
        waited = time.monotonic() - t0
        if clean or waited > timeout_s:
            return {
                "kv_blocks_leaked": leaked, "clean": clean, "waited_s": round(waited, 2), "workers": workers,
                "router_running": status.requests_running, "router_waiting": status.requests_waiting,
            }  # fmt: skip
        time.sleep(0.25)


def scrape(url: str, name: str) -> dict[str, float]:
    """One metric family from a /metrics page: {label values joined by ',': value}."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels = line[len(name) + 1 : line.rindex("}")]
            key = ",".join(
                p.split("=", 1)[1].strip('"') for p in labels.split(",") if not p.startswith("role=")
            )
            out[key] = float(line.rsplit(" ", 1)[1])
    return out
