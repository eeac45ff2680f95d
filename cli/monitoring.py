"""The local cluster's monitoring: Prometheus targets and alert rule inputs, and the Prometheus and
Alertmanager servers ``up --prometheus/--alertmanager`` starts."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import msgspec

from pdserve.cli import lifeline
from pdserve.cli.common import say
from pdserve.deploy.local import alertmanager, cluster, prometheus
from pdserve.worker.role import Role


def write_targets(state_dir: Path, state: cluster.ClusterState) -> None:
    """List the router and every worker (their metrics URLs) in the Prometheus targets file, and the
    workers the cluster should have in the worker-count alert's rule file (re-read on SIGHUP)."""
    token, tls = cluster.state_token(state), cluster.state_tls(state)
    status = cluster.cluster_status(cluster.live_router(state), token=token, tls=tls)
    groups = [g for g in prometheus.targets(status) if g["labels"] != {"worker": "router"}]
    for i, (address, p) in enumerate(state.routers()):  # every router (each has its own /metrics)
        if cluster.alive(p):
            url = cluster.cluster_status(address, token=token, tls=tls).metrics_url
            groups.insert(i, prometheus.target_group(url, f"router-{i}" if i else "router"))
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
