"""``pdserve up``, ``scale``, ``autoscale`` and ``down``: the local cluster's life, on top of
``deploy.local.cluster`` (and ``deploy.local.autoscaler``)."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import msgspec

from pdserve.cli import lifeline
from pdserve.deploy.local import alertmanager, cluster, prometheus
from pdserve.deploy.local import autoscaler as autoscaler_mod
from pdserve.engine.device import DEFAULT_GPU_MEMORY_UTILIZATION
from pdserve.router.autoscale import AutoscaleConfig, PoolBounds
from pdserve.worker.address import host_port
from pdserve.worker.auth import write_new_token
from pdserve.worker.role import Role
from pdserve.worker.tls import TLSConfig


def say(text: str) -> None:
    """Progress goes to stderr; stdout carries only results (the router address)."""
    print(text, file=sys.stderr, flush=True)


# ``up`` options handed on to the router and to every worker (``scale`` reuses the workers' from the state).
_ROUTER_FLAGS = (
    "max_waiting",
    "max_migrations",
    "max_prefill_queue_tokens",
    "queue_timeout",
    "local_prefill_threshold",
    "heartbeat_interval",
    "heartbeat_timeout",
    "request_timeout",
    "metrics_port",
)
_WORKER_FLAGS = (
    "block_size",
    "kv_blocks",
    "kv_cache_mib",
    "max_running",
    "max_batched_tokens",
    "kv_stall_timeout",
    "kv_fault_delay",
    "quantization",
)


def _flags(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    flags = []
    for name in names:
        flags += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return flags


def _check_shared_kv(shared: bool, device: str) -> None:
    if shared and device != "cpu":
        raise cluster.ClusterError(
            f"--kv-shared-memory keeps decode KV caches in host shared memory: workers on {device} cannot"
        )


def resolve_device(device: str) -> str:
    """``cpu`` or ``cuda:N``, checked on this host (where the workers will run): ClusterError otherwise."""
    if device == "cpu":
        return device  # no torch import for the common case
    from pdserve.engine.device import resolve_device as resolve

    try:
        return resolve(device)
    except ValueError as e:
        raise cluster.ClusterError(str(e)) from None


def each_share(device: str, workers: int, given: float | None) -> float:
    """Each worker's --gpu-memory-utilization: ``given``, or the default shared evenly among ``workers``
    on one GPU (so `up --device cuda` fits them all on it); ClusterError when they do not fit."""
    if given is not None:
        cluster.check_gpu_shares(device, 0.0, workers, given)
        return given
    if device == "cpu":
        return DEFAULT_GPU_MEMORY_UTILIZATION  # ignored by CPU workers; `scale --device cuda` starts from it
    return DEFAULT_GPU_MEMORY_UTILIZATION / max(workers, 1)


# A colocated worker always prefills its own prompts (router/policy.py): prefill workers serve decode
# workers only.
IDLE_PREFILL_NOTE = (
    "note: the prefill workers will get only requests of max_tokens 1: colocated workers prefill their own "
    "prompts and only decode workers take prompts prefilled elsewhere (add --decode workers, or drop "
    "--prefill to 0)"
)


def cmd_up(args: argparse.Namespace) -> int:
    with cluster.state_lock(args.state_dir, create=True):
        return _up(args)


def _up(args: argparse.Namespace) -> int:
    state_dir: Path = args.state_dir
    old = cluster.load_state(state_dir)
    if old is not None and cluster.alive(old.router):
        raise cluster.ClusterError(
            f"a cluster is already running from {state_dir} "
            f"(router {old.router_address}); `pdserve down` it first"
        )
    if not 0 < args.port < 65536:
        raise cluster.ClusterError(f"--port must be in [1, 65535] for a local cluster, got {args.port}")
    counts = {Role.PREFILL: args.prefill, Role.DECODE: args.decode, Role.BOTH: args.colocated}
    policy = autoscale_config(args) if args.autoscale else None
    warm = {Role.PREFILL: 0, Role.DECODE: 0}
    if policy is not None:  # the pools start inside their bounds, with their warm workers
        check_decode_floor(policy, counts[Role.BOTH])
        for role, bounds in ((Role.PREFILL, policy.prefill), (Role.DECODE, policy.decode)):
            counts[role] = min(max(counts[role], bounds.min), bounds.max)
            warm[role] = bounds.warm
    if sum(counts.values()) and not (counts[Role.DECODE] or counts[Role.BOTH]):
        raise cluster.ClusterError("a cluster needs at least one decode or colocated worker")
    if counts[Role.PREFILL] and counts[Role.BOTH] and not counts[Role.DECODE]:
        say(IDLE_PREFILL_NOTE)
    n_workers = sum(counts.values()) + sum(warm.values())
    # Autoscaled pools may grow to their maximum: the cores are shared for that many from the start (a
    # running worker's thread count is fixed; later ones get fewer only while the cores run short).
    most = n_workers
    if policy is not None:
        most = counts[Role.BOTH] + sum(b.max + b.warm for b in (policy.prefill, policy.decode))
    threads = args.threads or cluster.default_threads(max(n_workers, most))
    device = resolve_device(args.device)
    _check_shared_kv(args.kv_shared_memory, device)
    util = each_share(device, n_workers, args.gpu_memory_utilization)
    cache = ["--cache-dir", str(args.cache_dir)] if args.cache_dir is not None else []
    module = ["--worker-module", args.worker_module] if args.worker_module else []
    module += ["--mixed-steps"] if args.mixed_steps else []
    module += ["--kv-interface", args.kv_interface] if args.kv_interface else []
    module += [] if args.kv_cross_memory else ["--no-kv-cross-memory"]
    module += ["--kv-shared-memory"] if args.kv_shared_memory else []
    module += ["--kv-puts", args.kv_puts] if args.kv_puts != "auto" else []
    http = [] if args.http_port is None else ["--http-port", str(args.http_port)]
    # TLS files (worker.tls), checked here: every process gets them, and this command calls the router.
    tls_config = TLSConfig.load(args.tls_cert, args.tls_key, args.tls_ca)
    tls_config.check_server()
    tls_flags = tls_config.cli_flags()
    if old is not None:
        # Its router exited (a crash, kill -9): what it left running would be forgotten once this
        # cluster's state file replaces the old one, and its workers would knock on the new router.
        # (After this command's own checks: a mistyped `up` stops nothing.)
        left = cluster.stop_survivors(state_dir)
        if left:
            print(
                f"stopped what the cluster in {state_dir} left running after its router exited: "
                + ", ".join(left),
                file=sys.stderr,
            )
    state_dir.mkdir(parents=True, exist_ok=True)
    # A new secret per cluster: only the processes started here can join its pools (worker.auth).
    token_file = write_new_token(state_dir / "cluster-token")
    token = ["--cluster-token-file", str(token_file.resolve())]
    tls = tls_flags + token
    router = cluster.spawn_router(
        state_dir, args.host, args.port, args.model, _flags(args, _ROUTER_FLAGS) + http + cache + tls
    )
    state = cluster.ClusterState(
        router_address=host_port(args.host, args.port),
        router=router,
        model=args.model,
        dtype=args.dtype,
        threads=threads,
        threads_auto=not args.threads,
        host=args.host,
        worker_flags=tuple(_flags(args, _WORKER_FLAGS) + cache + module + tls),
        pin_cpus=args.pin_cpus,
        token_file=str(token_file.resolve()),
        tls_cert=tls_config.cert_file,
        tls_key=tls_config.key_file,
        tls_ca=tls_config.ca_file,
        device=device,
        gpu_memory_utilization=util,
    )
    # Written before any wait, so `down` finds whatever was started even if `up` dies.
    cluster.save_state(state_dir, state)
    try:
        for role, n in counts.items():
            state = cluster.spawn_workers(state_dir, state, role, n)
            cluster.save_state(state_dir, state)
        for role, n in warm.items():
            state = cluster.spawn_workers(state_dir, state, role, n, standby=True)
            cluster.save_state(state_dir, state)
        pinned = "".join(
            f"; {w.id} on cpu {cluster.format_cpu_list(w.cpus)}" for w in state.workers if w.cpus
        )
        gpu = f" on {device} ({util:.2f} of its memory each)" if device != "cpu" else ""
        say(
            f"started router (pid {router.pid}) and {len(state.workers)} workers{gpu}, {threads} thread(s) "
            f"each{pinned}; logs in {state_dir / 'logs'}"
        )
        cluster.wait_ready(state, {w.id for w in state.workers}, args.timeout, say)
        write_targets(state_dir, state)
        am_listen = ""
        if args.alertmanager:
            am_listen = host_port(args.host, args.alertmanager_port)
            state = start_alertmanager(state_dir, state, am_listen)
            cluster.save_state(state_dir, state)
        if args.prometheus or args.alertmanager:
            listen = host_port(args.host, args.prometheus_port)
            state = start_prometheus(
                state_dir, state, listen, args.scrape_interval, am_listen, args.alert_for
            )
            cluster.save_state(state_dir, state)
        if policy is not None:
            state = start_autoscaler(state_dir, state, args)
            cluster.save_state(state_dir, state)
    except BaseException as exc:  # whatever failed (a worker that could not start, Ctrl-C, a bug)
        # A ClusterError's words (with the log tail) are said once, by main, after this.
        why = "" if isinstance(exc, cluster.ClusterError) else f": {type(exc).__name__}: {exc}"
        say(f"start failed, stopping what was started{why}")
        _stop_all(state, drain_timeout_s=0.0)
        cluster.remove_state(state_dir)
        raise
    if args.http_port is not None:
        status = cluster.cluster_status(
            state.router_address, token=cluster.state_token(state), tls=cluster.state_tls(state)
        )
        say(f"OpenAI-compatible API: {status.http_url}/v1")
    print(state.router_address, flush=True)
    return 0


def write_targets(state_dir: Path, state: cluster.ClusterState) -> None:
    """List the router and every worker (their metrics URLs) in the Prometheus targets file, and the
    workers the cluster should have in the worker-count alert's rule file (re-read on SIGHUP)."""
    status = cluster.cluster_status(
        state.router_address, token=cluster.state_token(state), tls=cluster.state_tls(state)
    )
    groups = prometheus.targets(status)
    say(f"prometheus targets: {prometheus.write_targets(state_dir, groups)}")
    changed = prometheus.write_expected(
        state_dir, {r.value: sum(w.role is r for w in state.workers) for r in Role}
    )
    if changed and state.prometheus is not None:
        cluster.send(state.prometheus, signal.SIGHUP)


def _start_server(state_dir: Path, name: str, argv: list[str], url: str) -> cluster.ProcessEntry:
    """Spawn one monitoring server and wait (bounded) until it answers ``/-/ready``. Under
    ``PDSERVE_EXIT_WITH_PID`` it runs tied to that process, as pdserve's own processes do."""
    if lifeline.exit_with_pid() is not None:
        argv = [sys.executable, "-m", "pdserve.cli.lifeline", *argv]
    proc = cluster.spawn(name, argv, state_dir / "logs" / f"{name}.log", cluster.child_env(1))
    if not prometheus.wait_ready(url, 60.0, lambda: cluster.alive(proc)):
        cluster.stop_processes([proc], term_timeout_s=10.0)
        raise cluster.ClusterError(
            f"{name} did not become ready at {url}; last lines of {proc.log}:\n" + cluster.log_tail(proc.log)
        )
    say(f"{name} at {url} (pid {proc.pid})")
    return proc


def start_prometheus(
    state_dir: Path,
    state: cluster.ClusterState,
    listen: str,
    scrape_interval_s: float,
    alertmanager_listen: str = "",
    alert_for_s: float | None = None,
) -> cluster.ClusterState:
    binary = prometheus.find_binary()
    if binary is None:
        raise cluster.ClusterError(
            "prometheus is not installed: `make prometheus` unpacks Debian's package into the virtualenv "
            "(or `apt-get install prometheus`)"
        )
    argv = prometheus.server_argv(
        binary, state_dir, listen, scrape_interval_s, alertmanager_listen, alert_for_s
    )
    proc = _start_server(state_dir, "prometheus", argv, f"http://{listen}")
    return msgspec.structs.replace(state, prometheus=proc, prometheus_url=f"http://{listen}")


def start_alertmanager(state_dir: Path, state: cluster.ClusterState, listen: str) -> cluster.ClusterState:
    binary = alertmanager.find_binary()
    if binary is None:
        raise cluster.ClusterError(
            "alertmanager is not installed: `make alertmanager` unpacks Debian's prometheus-alertmanager "
            "package into the virtualenv (or `apt-get install prometheus-alertmanager`)"
        )
    why = alertmanager.missing_templates(binary)
    if why:
        raise cluster.ClusterError(why)
    argv = alertmanager.server_argv(binary, state_dir, listen)
    proc = _start_server(state_dir, "alertmanager", argv, f"http://{listen}")
    return msgspec.structs.replace(state, alertmanager=proc, alertmanager_url=f"http://{listen}")


def cmd_scale(args: argparse.Namespace) -> int:
    with cluster.state_lock(args.state_dir):
        return _scale(args)


def _scale(args: argparse.Namespace) -> int:
    state = cluster.load_state(args.state_dir)
    if state is None:
        raise cluster.ClusterError(f"no cluster in {args.state_dir}")
    if state.autoscaler is not None and cluster.alive(state.autoscaler):
        raise cluster.ClusterError(
            f"the autoscaler (pid {state.autoscaler.pid}) sizes this cluster's pools (`up --autoscale` or "
            "`pdserve autoscale`): stop it to scale by hand, or restart it with other bounds"
        )
    if not cluster.alive(state.router):
        raise cluster.ClusterError(
            f"the router of the cluster in {args.state_dir} (pid {state.router.pid}) has exited: "
            "`pdserve down`, then `pdserve up` again"
        )
    state, gone = cluster.live_workers(state)
    for w in gone:
        say(f"{w.id} (pid {w.pid}) had exited; dropped from the cluster")
    status = None
    if any(w.standby for w in state.workers):
        status = cluster.cluster_status(
            state.router_address, token=cluster.state_token(state), tls=cluster.state_tls(state)
        )
        state, adopted = cluster.adopt_promotions(state, status)
        for w in adopted:
            say(f"{w.id} serves: the router promoted it from the warm pool when its pool had none left")
    targets = {Role.PREFILL: args.prefill, Role.DECODE: args.decode, Role.BOTH: args.colocated}
    device = state.device if args.device is None else resolve_device(args.device)
    _check_shared_kv("--kv-shared-memory" in state.worker_flags, device)
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
                    write_targets(args.state_dir, state)  # scraped from the start, as after a scale
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
    write_targets(args.state_dir, state)
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
    write_targets(state_dir, state)


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
        cluster.promote_worker(state.router_address, w.id, token, tls)
        state = cluster.replace_worker(state, msgspec.structs.replace(w, standby=False))
        cluster.save_state(state_dir, state)
        promoted.append(w.id)
    return state, promoted


def _stop_all(state: cluster.ClusterState, drain_timeout_s: float) -> None:
    workers = [w for w in state.workers if cluster.alive(w)]
    if workers and drain_timeout_s > 0 and cluster.alive(state.router):
        say(
            f"draining {', '.join(w.id for w in workers)}: their requests in flight finish first (at most "
            f"{drain_timeout_s:.0f}s, --timeout)"
        )
        for wid in cluster.remove_workers(state, workers, drain_timeout_s, say):
            say(f"{wid} did not drain within {drain_timeout_s:.0f}s: stopped, cutting its requests in flight")
    else:
        cluster.stop_processes(workers, term_timeout_s=10.0)
    cluster.stop_processes([state.router], term_timeout_s=15.0)
    cluster.stop_processes(cluster.monitoring(state), term_timeout_s=15.0)


def cmd_down(args: argparse.Namespace) -> int:
    # A command still changing the cluster (a hung `up`, a long `scale`) is interrupted first: `down` is
    # how an operator stops it all.
    with cluster.state_lock(args.state_dir, wait_s=60.0, interrupt=True, progress=say):
        return _down(args)


def _down(args: argparse.Namespace) -> int:
    try:
        state = cluster.load_state(args.state_dir)
    except cluster.ClusterError as e:
        return _down_without_state(args, e)
    if state is None:
        say(f"no cluster in {args.state_dir}")
        return 0
    if state.autoscaler is not None:
        # First, so that it starts no worker while the others stop; then the workers it left.
        cluster.stop_processes([state.autoscaler], term_timeout_s=15.0)
        state = cluster.load_state(args.state_dir) or state
    _stop_all(state, args.timeout)
    # What the state file does not list (an interrupted `up` or `scale` had started it, or a lost write):
    # found by the mark every process this state dir started carries.
    leftovers = cluster.marked_processes(args.state_dir)
    if leftovers:
        say(f"stopping what the state file did not list: {', '.join(p.id for p in leftovers)}")
        cluster.stop_processes(leftovers, term_timeout_s=15.0)
    prometheus.write_targets(args.state_dir, [])  # an outside Prometheus stops scraping the dead cluster
    if prometheus.autoscaler_targets_path(args.state_dir).exists():
        prometheus.write_autoscaler_target(args.state_dir, "")  # (an autoscaler that was killed)
    prometheus.write_expected(args.state_dir, {})  # ... and expects no workers of it
    cluster.remove_state(args.state_dir)
    say(f"stopped the cluster of {args.state_dir}")
    return 0


def _down_without_state(args: argparse.Namespace, unreadable: cluster.ClusterError) -> int:
    """The state file is there but unreadable: stop the processes ``up`` started for this state dir,
    found by the mark in their environment (``cluster.marked_processes``), then remove the file."""
    say(f"{unreadable}")
    procs = cluster.marked_processes(args.state_dir)
    if procs:
        say(f"stopping what this state dir started: {', '.join(p.id for p in procs)}")
        killed = cluster.stop_processes(procs, term_timeout_s=args.timeout)
        if killed:
            say(f"killed (did not stop within {args.timeout:.0f}s): {', '.join(killed)}")
    else:
        say("no process started for this state dir runs")
    cluster.remove_state(args.state_dir)
    say(f"removed {cluster.state_path(args.state_dir)}")
    return 0


# ---- autoscaling ----------------------------------------------------------------------------------------

# (flag, AutoscaleConfig field, type, help) of every policy threshold `up --autoscale` and `autoscale` take.
_POLICY_FLAGS: tuple[tuple[str, str, type, str], ...] = (
    ("--autoscale-interval", "interval_s", float, "seconds between decisions"),
    ("--scale-up-after", "up_after", int, "ticks of high load in a row before a scale-up"),
    ("--scale-down-after", "down_after", int, "ticks of low load in a row before a scale-down"),
    ("--scale-up-cooldown", "up_cooldown_s", float, "seconds after a pool changed before it may grow"),
    ("--scale-down-cooldown", "down_cooldown_s", float, "seconds after a pool changed before it may shrink"),
    ("--prefill-tokens-high", "prefill_tokens_high", int, "queued prefill tokens per prefill worker: grow"),
    (
        "--prefill-tokens-low",
        "prefill_tokens_low",
        int,
        "... at most this many (with one worker less): shrink",
    ),
    (
        "--ttft-slo",
        "ttft_slo_s",
        float,
        "TTFT objective in seconds (prefill grows over it while work queues)",
    ),
    ("--kv-usage-high", "kv_usage_high", float, "decode KV-cache usage (0-1): grow"),
    ("--kv-usage-low", "kv_usage_low", float, "... at most this (with one worker less): shrink"),
    ("--running-high", "running_high", float, "decode (running + queued) / max running (0-1): grow"),
    ("--running-low", "running_low", float, "... at most this (with one worker less): shrink"),
    ("--itl-slo", "itl_slo_s", float, "ITL objective in seconds (decode grows over it)"),
)


def autoscale_arguments(p: argparse.ArgumentParser, on_up: bool) -> None:
    """The autoscaler's bounds and thresholds (defaults: ``AutoscaleConfig``)."""
    if on_up:
        p.add_argument(
            "--autoscale",
            action="store_true",
            help="size the prefill and decode pools from their load and SLOs (a background autoscaler; "
            "`pdserve status` shows its decisions); --prefill/--decode are the starting sizes",
        )
    g = p.add_argument_group("autoscaling")
    for pool in ("prefill", "decode"):
        extra = "; 0 only beside colocated workers" if pool == "decode" else ""
        g.add_argument(f"--{pool}-min", type=int, default=1, help=f"fewest {pool} workers (default 1{extra})")
        g.add_argument(
            f"--{pool}-max", type=int, default=None, help=f"most {pool} workers (default: min + 1)"
        )
        g.add_argument(
            f"--warm-{pool}",
            type=int,
            default=None,
            help=f"standby {pool} workers kept loaded, not routed to; a scale-up promotes one at once "
            "(default: --warm)",
        )
    g.add_argument("--warm", type=int, default=0, help="standby workers per pool (default 0)")
    d = AutoscaleConfig()
    for flag, name, kind, text in _POLICY_FLAGS:
        g.add_argument(
            flag, dest=name, type=kind, default=getattr(d, name), help=f"{text} (default %(default)s)"
        )
    g.add_argument(
        "--autoscale-drain-timeout",
        type=float,
        default=300.0,
        help="seconds a worker scaled down may take to drain before it is stopped by signal",
    )


def autoscale_config(args: argparse.Namespace) -> AutoscaleConfig:
    """The policy of the flags, checked (ClusterError naming the problem)."""

    def bounds(pool: str) -> PoolBounds:
        lo = getattr(args, f"{pool}_min")
        hi = getattr(args, f"{pool}_max")
        warm = getattr(args, f"warm_{pool}")
        try:
            return PoolBounds(lo, lo + 1 if hi is None else hi, args.warm if warm is None else warm)
        except ValueError as e:
            raise ValueError(f"--{pool}-min, --{pool}-max, --warm-{pool}: {e}") from None

    try:
        return AutoscaleConfig(
            prefill=bounds("prefill"),
            decode=bounds("decode"),
            **{name: getattr(args, name) for _, name, _, _ in _POLICY_FLAGS},
        )
    except ValueError as e:
        said = str(e)  # the policy's field names, as the flags that set them
        for flag, name, _, _ in _POLICY_FLAGS:
            said = re.sub(rf"\b{name}\b", flag, said)
        raise cluster.ClusterError(f"autoscaling: {said}") from None


def check_decode_floor(policy: AutoscaleConfig, colocated: int) -> None:
    """``--decode-min 0`` only beside colocated workers: with none, the autoscaler could take the decode
    pool to zero, and then nothing it watches (requests are refused at once, none wait) grows it back."""
    if policy.decode.min == 0 and colocated == 0:
        raise cluster.ClusterError(
            "autoscaling: --decode-min 0 needs colocated workers (--colocated N): a cluster needs at "
            "least one decode or colocated worker"
        )


def _autoscale_flags(args: argparse.Namespace) -> list[str]:
    """`up`'s autoscaling flags, handed on to the `pdserve autoscale` process it starts."""
    flags = []
    for pool in ("prefill", "decode"):
        for name in (f"{pool}_min", f"{pool}_max", f"warm_{pool}"):
            if getattr(args, name) is not None:
                flags += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    flags += ["--warm", str(args.warm), "--autoscale-drain-timeout", str(args.autoscale_drain_timeout)]
    for flag, name, _, _ in _POLICY_FLAGS:
        flags += [flag, str(getattr(args, name))]
    return flags


def start_autoscaler(
    state_dir: Path, state: cluster.ClusterState, args: argparse.Namespace
) -> cluster.ClusterState:
    argv = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "autoscale",
        "--state-dir",
        str(state_dir),
        *_autoscale_flags(args),
    ]
    proc = cluster.spawn("autoscaler", argv, state_dir / "logs" / "autoscaler.log", cluster.child_env(1))
    say(f"autoscaler (pid {proc.pid}): logs in {proc.log}")
    return msgspec.structs.replace(state, autoscaler=proc)


def cmd_autoscale(args: argparse.Namespace) -> int:
    """Run the autoscaler in the foreground until SIGTERM/SIGINT (``up --autoscale`` starts it in the
    background)."""
    import logging

    state = cluster.load_state(args.state_dir)
    if state is None:
        raise cluster.ClusterError(f"no cluster in {args.state_dir}")
    other = state.autoscaler
    if other is not None and other.pid != os.getpid() and cluster.alive(other):
        raise cluster.ClusterError(f"an autoscaler already runs for this cluster (pid {other.pid})")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    policy = autoscale_config(args)
    check_decode_floor(policy, sum(w.role is Role.BOTH and cluster.alive(w) for w in state.workers))
    config = autoscaler_mod.DriverConfig(args.state_dir, policy, args.autoscale_drain_timeout)
    me = None
    if other is None or other.pid != os.getpid():
        # Run by hand (`up --autoscale` lists its own): into the state file like the background one, so
        # `scale` refuses while it owns the pools, `status` shows it and `down` stops it first.
        stat = cluster.proc_stat(os.getpid())
        assert stat is not None
        me = cluster.ProcessEntry(id="autoscaler", pid=os.getpid(), start=stat[1], log="")
        with cluster.state_lock(args.state_dir, wait_s=30.0):
            state = cluster.load_state(args.state_dir) or state
            other = state.autoscaler  # again, held: two started at once would both run
            if other is not None and other.pid != os.getpid() and cluster.alive(other):
                raise cluster.ClusterError(f"an autoscaler already runs for this cluster (pid {other.pid})")
            cluster.save_state(args.state_dir, msgspec.structs.replace(state, autoscaler=me))
    try:
        return autoscaler_mod.run(config, state.host, args.metrics_port)
    finally:
        # Not waiting: a `down` holding the state dir stops this process and removes the file itself.
        with contextlib.suppress(cluster.StateBusy), cluster.state_lock(args.state_dir):
            now = cluster.load_state(args.state_dir) if me is not None else None
            if now is not None and now.autoscaler == me:  # (gone after `down`)
                cluster.save_state(args.state_dir, msgspec.structs.replace(now, autoscaler=None))


def autoscaler_status(state: cluster.ClusterState, state_dir: Path) -> dict[str, Any] | None:
    """The autoscaler's part of `pdserve status --json` (None when it does not run)."""
    if state.autoscaler is None or not cluster.alive(state.autoscaler):
        return None
    doc = autoscaler_mod.load_status(state_dir)
    if doc is None:
        return {"pid": state.autoscaler.pid, "pools": {}, "decisions": []}
    return msgspec.to_builtins(doc)


def autoscaler_table(doc: dict[str, Any]) -> str:
    lines = [
        f"autoscaler (pid {doc['pid']})"
        + (f"; metrics {doc['metrics_url']}" if doc.get("metrics_url") else "")
    ]
    for pool, p in doc["pools"].items():
        draining = ", ".join(p["draining"]) or "-"
        lines.append(
            f"  {pool}: {p['serving']} serving, target {p['target']}, {p['starting']} starting, "
            f"{p['standby']} standby, draining {draining}"
        )
    for d in doc["decisions"][-5:]:
        when = time.strftime("%H:%M:%S", time.localtime(d["time_unix"]))
        lines.append(
            f"  {when} {d['pool']} {d['direction']} to {d['target']} ({d['reason']}: {d['detail']}) "
            f"{d['worker_id'] or ''}".rstrip()
        )
    return "\n".join(lines)
