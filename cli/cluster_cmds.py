"""``pdserve up`` and ``pdserve down``: the local cluster's start and stop, on top of ``deploy.local.cluster``
(and what ``scale`` shares with ``up``: the device check, GPU shares, the idle-prefill note)."""

from __future__ import annotations

import argparse
import dataclasses
import socket
import sys
from pathlib import Path

from pdserve.cli import monitoring
from pdserve.cli.autoscale_cmds import autoscale_config, check_decode_floor, start_autoscaler
from pdserve.cli.common import say
from pdserve.cli.router_flags import ROUTER_FLAGS
from pdserve.deploy.local import cluster, prometheus
from pdserve.engine.device import DEFAULT_GPU_MEMORY_UTILIZATION
from pdserve.worker.address import host_port
from pdserve.worker.auth import write_new_token
from pdserve.worker.flags import UP_FLAGS
from pdserve.worker.flagspec import forward
from pdserve.worker.role import Role
from pdserve.worker.tls import TLSConfig


def check_shared_kv(shared: bool, device: str) -> None:
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
    if old is not None and any(cluster.alive(p) for _, p in old.routers()):
        raise cluster.ClusterError(
            f"a cluster is already running from {state_dir} "
            f"(router {old.router_address}); `pdserve down` it first"
        )
    if not 0 < args.port < 65536:
        raise cluster.ClusterError(f"--port must be in [1, 65535] for a local cluster, got {args.port}")
    router_ports = [_router_ports(args, i) for i in range(args.routers)]
    _check_free(args.host, router_ports)
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
    check_shared_kv(args.kv_shared_memory, device)
    util = each_share(device, n_workers, args.gpu_memory_utilization)
    cache = ["--cache-dir", str(args.cache_dir)] if args.cache_dir is not None else []
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
    routers = [
        cluster.spawn_router(
            state_dir, args.host, ports.grpc, args.model, forward(ports.args, ROUTER_FLAGS) + cache + tls, i
        )
        for i, ports in enumerate(router_ports)
    ]
    router = routers[0]
    state = cluster.ClusterState(
        router_address=host_port(args.host, args.port),
        router=router,
        more_routers=tuple(routers[1:]),
        more_router_addresses=tuple(host_port(args.host, p.grpc) for p in router_ports[1:]),
        model=args.model,
        dtype=args.dtype,
        threads=threads,
        threads_auto=not args.threads,
        host=args.host,
        # ``scale`` and the autoscaler start later workers with the same (from the state file).
        worker_flags=tuple(forward(args, UP_FLAGS) + cache + tls),
        pin_cpus=args.pin_cpus,
        token_file=str(token_file.resolve()),
        tls_cert=tls_config.cert_file,
        tls_key=tls_config.key_file,
        tls_ca=tls_config.ca_file,
        device=device,
        gpu_memory_utilization=util,
        colocated_tp=args.colocated_tp,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
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
        started = (
            f"router (pid {router.pid})"
            if len(routers) == 1
            else f"{len(routers)} routers (pids {', '.join(str(r.pid) for r in routers)})"
        )
        say(
            f"started {started} and {len(state.workers)} workers{gpu}, {threads} thread(s) "
            f"each{pinned}; logs in {state_dir / 'logs'}"
        )
        cluster.wait_ready(state, {w.id for w in state.workers}, args.timeout, say)
        monitoring.write_targets(state_dir, state)
        am_listen = ""
        if args.alertmanager:
            am_listen = host_port(args.host, args.alertmanager_port)
            state = monitoring.start_alertmanager(state_dir, state, am_listen)
            cluster.save_state(state_dir, state)
        if args.prometheus or args.alertmanager:
            listen = host_port(args.host, args.prometheus_port)
            state = monitoring.start_prometheus(
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
        urls = []
        for address, _ in state.routers():
            status = cluster.cluster_status(
                address, token=cluster.state_token(state), tls=cluster.state_tls(state)
            )
            urls.append(f"{status.http_url}/v1")
        say(f"OpenAI-compatible API: {', '.join(urls)}")
    print(state.router_list, flush=True)
    return 0


@dataclasses.dataclass(frozen=True)
class _RouterPorts:
    grpc: int
    args: argparse.Namespace  # `up`'s flags with this router's HTTP and metrics ports


def _router_ports(args: argparse.Namespace, index: int) -> _RouterPorts:
    """Router ``index`` of ``up --routers``: the first router's ports + ``index`` (a port 0, any free one,
    stays 0)."""
    ns = argparse.Namespace(**vars(args))
    for name in ("http_port", "metrics_port"):
        port = getattr(args, name)
        if port:
            setattr(ns, name, port + index)
    return _RouterPorts(args.port + index, ns)


def _check_free(host: str, routers: list[_RouterPorts]) -> None:
    """Every port the routers will serve on can be bound now (before anything starts)."""
    for i, r in enumerate(routers):
        named = [
            ("gRPC", "--port", r.grpc),
            ("the HTTP API", "--http-port", r.args.http_port),
            ("metrics", "--metrics-port", r.args.metrics_port),
        ]
        for what, flag, port in named:
            if not port:
                continue
            which = f"{flag} + {i}, router {i}" if i else flag
            if port > 65535:
                raise cluster.ClusterError(f"cannot serve {what} on port {port} ({which}): lower {flag}")
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as the servers bind)
                try:
                    sock.bind((host, port))
                except OSError as e:
                    raise cluster.ClusterError(
                        f"cannot serve {what} on port {port} ({which}) of {host}: {e.strerror}"
                    ) from None


def _stop_all(state: cluster.ClusterState, drain_timeout_s: float) -> None:
    workers = [w for w in state.workers if cluster.alive(w)]
    if workers and drain_timeout_s > 0 and any(cluster.alive(p) for _, p in state.routers()):
        say(
            f"draining {', '.join(w.id for w in workers)}: their requests in flight finish first (at most "
            f"{drain_timeout_s:.0f}s, --timeout)"
        )
        for wid in cluster.remove_workers(state, workers, drain_timeout_s, say):
            say(f"{wid} did not drain within {drain_timeout_s:.0f}s: stopped, cutting its requests in flight")
    else:
        cluster.stop_processes(workers, term_timeout_s=10.0)
    cluster.stop_processes([p for _, p in state.routers()], term_timeout_s=15.0)
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
