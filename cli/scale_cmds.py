"""``pdserve scale``: grow or shrink the local cluster's pools (warm-pool workers promoted first), and what a
worker drained by hand leaves in the state file."""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path

import grpc
import msgspec

from pdserve.cli import monitoring
from pdserve.cli.cluster_cmds import IDLE_PREFILL_NOTE, check_shared_kv, resolve_device
from pdserve.cli.common import say
from pdserve.deploy.local import cluster
from pdserve.worker.flags import KV_SHARED_MEMORY
from pdserve.worker.role import Role


def cmd_scale(args: argparse.Namespace) -> int:
    # Before the lock too: a running autoscaler takes the lock on its ticks, and its owner should hear that
    # the autoscaler sizes the pools rather than that the state is busy.
    _refuse_while_autoscaled(cluster.load_state(args.state_dir))
    with cluster.state_lock(args.state_dir):
        return _scale(args)


def _refuse_while_autoscaled(state: cluster.ClusterState | None) -> None:
    if state is not None and state.autoscaler is not None and cluster.alive(state.autoscaler):
        raise cluster.ClusterError(
            f"the autoscaler (pid {state.autoscaler.pid}) sizes this cluster's pools (`up --autoscale` or "
            "`pdserve autoscale`): stop it to scale by hand, or restart it with other bounds"
        )


def _scale(args: argparse.Namespace) -> int:
    state = cluster.load_state(args.state_dir)
    if state is None:
        raise cluster.ClusterError(f"no cluster in {args.state_dir}")
    _refuse_while_autoscaled(state)
    cluster.live_router(state)  # (ClusterError when every router of it has exited)
    state, gone = cluster.live_workers(state)
    for w in gone:
        say(f"{w.id} (pid {w.pid}) had exited; dropped from the cluster")
    status = None
    if any(w.standby for w in state.workers):
        status = cluster.cluster_status(
            cluster.live_router(state), token=cluster.state_token(state), tls=cluster.state_tls(state)
        )
        state, adopted = cluster.adopt_promotions(state, status)
        for w in adopted:
            say(f"{w.id} serves: the router promoted it from the warm pool when its pool had none left")
    targets = {Role.PREFILL: args.prefill, Role.DECODE: args.decode, Role.BOTH: args.colocated}
    device = state.device if args.device is None else resolve_device(args.device)
    check_shared_kv(KV_SHARED_MEMORY.option in state.worker_flags, device)
    util = (
        state.gpu_memory_utilization if args.gpu_memory_utilization is None else args.gpu_memory_utilization
    )
    serving = {
        r: sum(w.role is r and not w.standby for w in state.workers) if targets[r] is None else targets[r]
        for r in targets
    }
    if not serving[Role.DECODE] and not serving[Role.BOTH]:
        raise cluster.ClusterError("a cluster needs at least one decode or colocated worker")
    if serving[Role.PREFILL] and serving[Role.BOTH] and not serving[Role.DECODE]:
        say(IDLE_PREFILL_NOTE)
    removing: list[cluster.ProcessEntry] = []
    wanted: dict[Role, int] = {}  # more serving workers than now: promoted standby ones, else new ones
    for role, target in targets.items():
        if target is None:
            continue
        # Serving workers only: a warm-pool worker the autoscaler left (standby) is promoted first.
        current = [w for w in state.workers if w.role is role and not w.standby]
        if target > len(current):
            wanted[role] = target - len(current)
        else:
            removing += current[target:]  # the newest go first
    # The GPU must hold the workers that stay and the new ones (a standby one holds its share already,
    # registered or still loading: ``_promote_standby`` promotes both): refuse before changing anything.
    standby = {r: sum(w.role is r and w.standby and cluster.alive(w) for w in state.workers) for r in wanted}
    new = sum(max(n - standby[r], 0) for r, n in wanted.items())
    cluster.check_gpu_shares(device, cluster.gpu_share(state, device, removing), new, util)
    if new and args.timeout <= 0:  # (0 is for removals: they stop at once)
        raise cluster.ClusterError("--timeout 0 leaves no time for a new worker to start: give it seconds")
    adding: dict[Role, int] = {}
    promoted: list[str] = []
    for role, n in wanted.items():
        state, promoted_now = _promote_standby(state, args.state_dir, role, n)
        promoted += promoted_now
        if n > len(promoted_now):
            adding[role] = n - len(promoted_now)
    added: list[str] = []
    for role, n in adding.items():
        before = {w.id for w in state.workers}
        state = cluster.spawn_workers(args.state_dir, state, role, n, device, util)
        added += [w.id for w in state.workers if w.id not in before]
    cluster.save_state(args.state_dir, state)
    if added:
        say(f"starting {', '.join(added)}")
        cores, total = os.cpu_count() or 1, cluster.cpu_threads(state)
        if total > cores:  # the workers started before keep their thread counts
            say(
                f"note: the CPU workers now run {total} torch threads on {cores} cores, which slows every "
                "one of them; size the threads for the largest pools at `up` (--threads, or "
                "`up --autoscale`, which shares the cores among each pool's maximum)"
            )
        try:
            cluster.wait_ready(state, set(added), args.timeout, say)
        except (cluster.ClusterError, KeyboardInterrupt):
            # Not stopped (as `up` stops what it started): they stay in the cluster and join once ready.
            starting = [w for w in state.workers if w.id in added and cluster.alive(w)]
            if starting:
                with contextlib.suppress(grpc.RpcError, OSError):
                    monitoring.write_targets(
                        args.state_dir, state
                    )  # scraped from the start, as after a scale
                say(
                    f"{', '.join(w.id for w in starting)} still starting: joins the cluster once ready "
                    "(`pdserve status`); `pdserve scale` again to remove it"
                )
            raise
    if removing:
        say(f"draining {', '.join(w.id for w in removing)}")
        stuck = cluster.remove_workers(state, removing, args.timeout, say)
        for wid in stuck:
            say(f"{wid} did not drain within {args.timeout:.0f}s: stopped, cutting its requests in flight")
        state = msgspec.structs.replace(state, workers=tuple(w for w in state.workers if w not in removing))
        cluster.save_state(args.state_dir, state)
    monitoring.write_targets(args.state_dir, state)
    if promoted:
        say(f"promoted from the warm pool: {', '.join(promoted)}")
    counts = {r.value: sum(w.role is r and not w.standby for w in state.workers) for r in Role}
    standby = sum(w.standby for w in state.workers)
    say(
        "workers: "
        + ", ".join(f"{n} {role}" for role, n in counts.items())
        + (f" (and {standby} standby)" if standby else "")
    )
    return 0


def forget_worker(state_dir: Path, worker_id: str, exit_wait_s: float = 10.0) -> None:
    """A worker of the local cluster drained by hand (``pdserve drain``): once its process has exited, it
    leaves the state file, the Prometheus targets and the workers the alerts expect, as after ``scale``
    (else the worker-count alert fired for a worker removed on purpose)."""
    try:
        with cluster.state_lock(state_dir, wait_s=30.0):
            _forget(state_dir, worker_id, exit_wait_s)
    except cluster.ClusterError as e:  # the drain itself succeeded: say what was left undone
        say(f"{worker_id} left the router, but stays in the state file: {e}")


def _forget(state_dir: Path, worker_id: str, exit_wait_s: float) -> None:
    state = cluster.load_state(state_dir)
    entry = next((w for w in state.workers if w.id == worker_id), None) if state else None
    if state is None or entry is None:
        return
    if cluster.wait_exit([entry], exit_wait_s):
        say(f"{worker_id} (pid {entry.pid}) still runs: left in the cluster's state file")
        return
    state = msgspec.structs.replace(state, workers=tuple(w for w in state.workers if w.id != worker_id))
    cluster.save_state(state_dir, state)
    monitoring.write_targets(state_dir, state)


def _promote_standby(
    state: cluster.ClusterState, state_dir: Path, role: Role, n: int
) -> tuple[cluster.ClusterState, list[str]]:
    """Promote up to ``n`` live warm-pool workers of ``role`` into routing (the autoscaler's standby
    workers, once it is gone): loaded already, they serve at once."""
    token, tls = cluster.state_token(state), cluster.state_tls(state)
    promoted = []
    for w in [w for w in state.workers if w.role is role and w.standby and cluster.alive(w)][:n]:
        # One not registered yet (still loading) is promoted too: the router remembers it, and it registers
        # into routing (counted serving here, it is not doubled by a cold start beside it).
        cluster.promote_worker(cluster.live_router(state), w.id, token, tls)
        state = cluster.replace_worker(state, msgspec.structs.replace(w, standby=False))
        cluster.save_state(state_dir, state)
        promoted.append(w.id)
    return state, promoted
