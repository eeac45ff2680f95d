"""The commands that call a running router: ``status``, ``generate``, ``drain`` (one worker, a preStop hook)
and ``bench``."""

from __future__ import annotations

import argparse
import json
import sys

import grpc

from pdserve.cli import client
from pdserve.cli.autoscale_cmds import autoscaler_status, autoscaler_table
from pdserve.cli.common import cluster_token, say, tls_config
from pdserve.cli.scale_cmds import forget_worker
from pdserve.deploy.local import cluster
from pdserve.worker.tls import TLSConfig


def _router_address(args: argparse.Namespace) -> str:
    """The router to ask: --router, else a running router of the local cluster (any one: every worker
    registers with every router)."""
    if getattr(args, "router", None):
        return args.router
    return cluster.live_router(_state(args))


def _state(args: argparse.Namespace) -> cluster.ClusterState:
    """The local cluster these client commands talk to (its router must run)."""
    state = cluster.load_state(args.state_dir)
    if state is None:
        raise cluster.ClusterError(
            f"no cluster in {args.state_dir} (run `pdserve up` there first, or pass --router)"
        )
    cluster.live_router(state)  # (ClusterError when every router of it has exited)
    return state


def _router_tls(args: argparse.Namespace) -> TLSConfig:
    """How to call the router: the TLS flags when given (or with --router), else the cluster's own."""
    if args.router or args.tls_cert or args.tls_ca:
        return tls_config(args)
    return cluster.state_tls(_state(args))


def cmd_status(args: argparse.Namespace) -> int:
    address = _router_address(args)
    token = cluster_token(args) if args.router else cluster.state_token(_state(args))
    doc = client.status_dict(cluster.cluster_status(address, token=token, tls=_router_tls(args)))
    state = None if args.router else _state(args)
    if state is not None:
        doc["routers"] = _routers(state, token, _router_tls(args))
        # Workers this cluster started whose process runs but the router does not list (loading, hung,
        # or dropped for missed heartbeats): the router's list alone would hide them.
        # And those whose process is gone (crashed, killed): the router forgot them, the state file still
        # counts them, and `scale` would drop them; without a row the pool would just look smaller.
        listed = {w["id"] for w in doc["workers"]}
        doc["unregistered"], doc["exited"] = [], []
        for w in state.workers:
            if w.id not in listed:
                row = {"id": w.id, "role": w.role.value if w.role else "unknown", "pid": w.pid}
                row["device"] = w.device or "cpu"
                if cluster.alive(w):
                    doc["unregistered"].append(row)
                else:
                    doc["exited"].append({**row, "log": w.log})
    scaler = None if state is None else autoscaler_status(state, args.state_dir)
    if scaler is not None:
        doc["autoscaler"] = scaler
    table = client.status_table(doc) + ("" if scaler is None else "\n" + autoscaler_table(scaler))
    print(json.dumps(doc, indent=2) if args.json else table, flush=True)
    return 0


def _routers(state: cluster.ClusterState, token: str, tls: TLSConfig) -> list[dict[str, object]]:
    """Every router of the local cluster: its address, pid, whether it runs, and (when it answers) its
    HTTP API and the workers it sees (each keeps its own registry)."""
    rows: list[dict[str, object]] = []
    for address, p in state.routers():
        row: dict[str, object] = {"address": address, "pid": p.pid, "alive": cluster.alive(p)}
        row.update(http_url="", metrics_url="", workers=None, requests_running=None)
        if row["alive"]:
            try:
                st = cluster.cluster_status(address, token=token, tls=tls)
            except grpc.RpcError as e:
                row["error"] = e.code().name
            else:
                row.update(
                    http_url=st.http_url,
                    metrics_url=st.metrics_url,
                    workers=len(st.workers),
                    requests_running=st.requests_running,
                )
        rows.append(row)
    return rows


def cmd_drain(args: argparse.Namespace) -> int:
    """The router stops sending the worker requests and tells it to drain; the worker finishes what it
    has in flight, deregisters and exits. Returns once it is gone from the router's list (0: drained, or
    dropped for missed heartbeats, which the router's list does not tell apart), or 1 when ``--timeout``
    passes first."""
    import time

    address = _router_address(args)
    token = cluster_token(args) if args.router else cluster.state_token(_state(args))
    tls = _router_tls(args)
    if not cluster.drain_worker(address, args.worker_id, token, tls):
        say(f"{args.worker_id} is not registered with the router at {address}: nothing to drain")
        return 0
    say(f"draining {args.worker_id}")
    give_up = time.monotonic() + args.timeout
    while any(
        e.info.worker_id == args.worker_id
        for e in cluster.cluster_status(address, token=token, tls=tls).workers
    ):
        if time.monotonic() > give_up:
            say(f"{args.worker_id} still registered after {args.timeout:.0f}s")
            return 1
        time.sleep(0.5)
    # (The router also drops a worker that stops answering heartbeats while draining: a hung one. If that
    # process comes back, it registers straight into its drain: router/registry.py.)
    say(f"{args.worker_id} has left the router (drained, or dropped for missed heartbeats)")
    if not args.router:
        forget_worker(args.state_dir, args.worker_id)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    for what, text in (("the prompt", args.prompt), *(("a --stop string", s) for s in args.stop)):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # argv bytes that are not UTF-8 (Python keeps them as surrogates)
            say(f"pdserve generate: {what} is not valid UTF-8 text")
            return 2
    req = client.build_request(
        args.prompt,
        chat=args.chat,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
    )
    # Round robin over every router of a local cluster (or those --router names).
    target = args.router or _state(args).router_list
    client.print_stream(
        client.stream(target, req, args.timeout or None, _router_tls(args)),
        sys.stdout,
        sys.stderr,
        args.json,
    )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench_mode in ("sweep", "compare"):
        from pdserve.bench.sweep import run_from_args as run_sweep

        return run_sweep(args, compare=args.bench_mode == "compare")
    if args.bench_mode == "soak":
        from pdserve.bench.soak import run_from_args as run_soak

        return run_soak(args)
    from pdserve.bench.serve import run_from_args

    return run_from_args(args)
