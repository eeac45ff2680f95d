"""A local cluster of background processes: the names ``cli``, ``bench`` and the tests use, from the
modules that hold them.

``pdserve up`` writes ``<state-dir>/cluster.json`` (``state.ClusterState``) before it waits for anything,
so ``down`` can always find what ``up`` started. Every process is started in its own session
(``start_new_session``) with its log in ``<state-dir>/logs/``; it is stopped by its pid only (after
checking the pid still runs ``cli``, so a reused pid is never signalled).

Removing a worker (``scale`` down, ``down``): the router's DrainWorker (the worker stops taking requests,
finishes in-flight ones, deregisters, exits), then SIGTERM, then SIGKILL, each step bounded.

    state.py       the state file and its lock
    placement.py   threads per worker, core pinning, GPU shares
    processes.py   spawn, liveness, readiness, stop
    rpc.py         calls to the cluster's router
    control.py     start, drain and remove workers; ``LocalControl`` for the autoscaler

A test that replaces a function replaces it where it is defined (``cluster.processes.spawn``): the
modules call each other through their module, not through these names.
"""

from __future__ import annotations

from pdserve.deploy.local.cluster.control import (
    LocalControl,
    adopt_promotions,
    live_workers,
    remove_workers,
    spawn_workers,
    worker_argv,
)
from pdserve.deploy.local.cluster.placement import (
    available_cpus,
    check_gpu_shares,
    choose_cpus,
    cpu_threads,
    default_threads,
    format_cpu_list,
    gpu_share,
    parse_cpu_list,
    running_on_cpu,
)
from pdserve.deploy.local.cluster.processes import (
    CLUSTER_ENV,
    alive,
    child_env,
    cli_argv,
    cut_drains,
    log_tail,
    marked_processes,
    proc_stat,
    send,
    spawn,
    spawn_router,
    stop_processes,
    stop_survivors,
    wait_exit,
    wait_ready,
)
from pdserve.deploy.local.cluster.rpc import (
    GENERATION_SERVICE,
    cluster_status,
    drain_worker,
    promote_worker,
    router_serving,
    state_tls,
    state_token,
)
from pdserve.deploy.local.cluster.state import (
    LOCK_FILE,
    STATE_FILE,
    ClusterError,
    ClusterState,
    ProcessEntry,
    StateBusy,
    load_state,
    monitoring,
    remove_state,
    replace_worker,
    save_state,
    state_lock,
    state_path,
    without_workers,
)

__all__ = [
    "CLUSTER_ENV",
    "GENERATION_SERVICE",
    "LOCK_FILE",
    "STATE_FILE",
    "ClusterError",
    "ClusterState",
    "LocalControl",
    "ProcessEntry",
    "StateBusy",
    "adopt_promotions",
    "alive",
    "available_cpus",
    "check_gpu_shares",
    "child_env",
    "choose_cpus",
    "cli_argv",
    "cluster_status",
    "cpu_threads",
    "cut_drains",
    "default_threads",
    "drain_worker",
    "format_cpu_list",
    "gpu_share",
    "live_workers",
    "load_state",
    "log_tail",
    "marked_processes",
    "monitoring",
    "parse_cpu_list",
    "proc_stat",
    "promote_worker",
    "remove_state",
    "remove_workers",
    "replace_worker",
    "router_serving",
    "running_on_cpu",
    "save_state",
    "send",
    "spawn",
    "spawn_router",
    "spawn_workers",
    "state_lock",
    "state_path",
    "state_tls",
    "state_token",
    "stop_processes",
    "stop_survivors",
    "wait_exit",
    "wait_ready",
    "without_workers",
    "worker_argv",
]
