"""Scale-up from cold vs from warm, measured in one run: ``python -m benchmarks.scale_up``.

A worker's time to routed, spawned cold against promoted from a loaded standby, on one local 1P+1D cluster
(``deploy.local``), which is always stopped. Details: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench.machine import machine_info
from pdserve.bench.sweep import ClusterSpec, Shape, local_cluster
from pdserve.deploy.local import cluster
from pdserve.proto import worker_pb2
from pdserve.worker.role import Role

_POLL_S = 0.005


def _entry(state: cluster.ClusterState, wid: str) -> worker_pb2.WorkerEntry | None:
    status = cluster.cluster_status(
        state.router_address, token=cluster.state_token(state), tls=cluster.state_tls(state)
    )
    return next((e for e in status.workers if e.info.worker_id == wid), None)


def _wait_state(state: cluster.ClusterState, wid: str, want: int, timeout_s: float) -> float:
    """Poll the router until ``wid`` is in state ``want``; returns the monotonic time it was seen."""
    give_up = time.monotonic() + timeout_s
    proc = next(w for w in state.workers if w.id == wid)
    while True:
        e = _entry(state, wid)
        if e is not None and e.load.state == want:
            return time.monotonic()
        if not cluster.alive(proc) or time.monotonic() > give_up:
            raise RuntimeError(f"{wid} did not reach state {want}; log:\n{cluster.log_tail(proc.log)}")
        time.sleep(_POLL_S)


def _phases(state: cluster.ClusterState, wid: str) -> dict[str, float]:
    e = _entry(state, wid)
    if e is None or not e.info.metrics_url:
        return {}
    with urllib.request.urlopen(e.info.metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    return {
        s.labels["phase"]: round(s.value, 3)
        for fam in text_string_to_metric_families(text)
        if fam.name == "pdserve_worker_startup_seconds"
        for s in fam.samples
    }


def _spawn(state_dir: Path, role: Role, standby: bool) -> tuple[cluster.ClusterState, str, float]:
    state = cluster.load_state(state_dir)
    assert state is not None
    before = {w.id for w in state.workers}
    t0 = time.monotonic()
    state = cluster.spawn_workers(state_dir, state, role, 1, standby=standby)
    cluster.save_state(state_dir, state)
    return state, next(w.id for w in state.workers if w.id not in before), t0


def _remove(state_dir: Path, wid: str) -> None:
    state = cluster.load_state(state_dir)
    assert state is not None
    gone = [w for w in state.workers if w.id == wid]
    cluster.remove_workers(state, gone, 60.0)
    state = msgspec.structs.replace(state, workers=tuple(w for w in state.workers if w.id != wid))
    cluster.save_state(state_dir, state)


def measure(state_dir: Path, role: Role, timeout_s: float) -> dict[str, Any]:
    state, wid, t0 = _spawn(state_dir, role, standby=False)
    cold = _wait_state(state, wid, worker_pb2.WORKER_STATE_READY, timeout_s) - t0
    phases = _phases(state, wid)
    _remove(state_dir, wid)
    state, wid, _ = _spawn(state_dir, role, standby=True)
    _wait_state(state, wid, worker_pb2.WORKER_STATE_STANDBY, timeout_s)
    t0 = time.monotonic()
    resp = cluster.promote_worker(
        state.router_address, wid, cluster.state_token(state), cluster.state_tls(state)
    )
    assert resp.found, wid
    warm = _wait_state(state, wid, worker_pb2.WORKER_STATE_READY, timeout_s) - t0
    _remove(state_dir, wid)
    return {"role": role.value, "cold_s": round(cold, 3), "warm_s": round(warm, 4), "cold_phases_s": phases}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale_up", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--roles", default="prefill,decode")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--state-dir", type=Path, default=Path(".pdserve/bench-scale-up"))
    p.add_argument("--out", type=Path, default=None, help="JSON results (default: <state-dir>/scale_up.json)")
    args = p.parse_args(argv)
    roles = [Role(r) for r in args.roles.split(",")]
    spec = ClusterSpec(
        model=args.model, dtype=args.dtype, threads=args.threads, pin_cpus=False, timeout_s=args.timeout
    )
    rows = []
    with local_cluster(Shape.parse("1P+1D"), spec, args.state_dir) as info:
        for _ in range(args.rounds):
            for role in roles:
                rows.append(measure(args.state_dir, role, args.timeout))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    summary = {
        r.value: {
            "median_cold_s": statistics.median(x["cold_s"] for x in rows if x["role"] == r.value),
            "median_warm_s": statistics.median(x["warm_s"] for x in rows if x["role"] == r.value),
        }
        for r in roles
    }
    command = " ".join(["python -m benchmarks.scale_up", *(argv or sys.argv[1:])])
    machine = {**machine_info(), "threads_per_worker": args.threads}
    doc = {"command": command, "machine": machine, "cluster": info, "rows": rows, "summary": summary}
    out = args.out or args.state_dir / "scale_up.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    print(f"{'role':8} {'cold (s)':>9} {'warm (s)':>9}")
    for role, s in summary.items():
        print(f"{role:8} {s['median_cold_s']:9.2f} {s['median_warm_s']:9.4f}")
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
