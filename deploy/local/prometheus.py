"""Prometheus for a local cluster: the file_sd targets files, the rendered config and rules, and the
server process ``pdserve up --prometheus`` starts."""

from __future__ import annotations

import json
import os
import posixpath
import shutil
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from pdserve.proto import worker_pb2

PROMETHEUS_DIR = "prometheus"
TARGETS_FILE = "targets.json"
# Written by the autoscaler while it runs: it is no router or worker of the cluster status.
AUTOSCALER_TARGETS_FILE = "targets-autoscaler.json"
CONFIG_FILE = "prometheus.yml"
RULES_FILE = "alerts.yml"
EXPECTED_FILE = "workers_expected.yml"
JOB_NAME = "pdserve"
# Where ``make prometheus`` (deploy/prometheus/install.sh) unpacks Debian's package.
VENV_PREFIX = Path("opt") / "prometheus"
# The committed config reads the targets of the default state dir, relative to the config's own folder.
DEFAULT_TARGETS_FROM_DEPLOY = "../../.pdserve/prometheus/targets.json"
_READY_POLL_S = 0.2


def targets_path(state_dir: Path) -> Path:
    """The router's and every worker's metrics address, written by ``up``/``scale``, emptied by ``down``."""
    return Path(state_dir) / PROMETHEUS_DIR / TARGETS_FILE


def autoscaler_targets_path(state_dir: Path) -> Path:
    """The autoscaler's own file_sd file, beside ``targets.json`` (the config's glob reads both)."""
    return Path(state_dir) / PROMETHEUS_DIR / AUTOSCALER_TARGETS_FILE


def _host_port(url: str) -> str:
    return urlsplit(url).netloc


def expected_path(state_dir: Path) -> Path:
    return Path(state_dir) / PROMETHEUS_DIR / EXPECTED_FILE


def _atomic_write(path: Path, text: str) -> Path:
    """Replace ``path`` in one step (Prometheus must never read half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def write_expected(state_dir: Path, counts: dict[str, int]) -> bool:
    """``pdserve:workers_expected{role}`` for the worker-count alert ({}: no expectation).

    Returns whether the file changed: only then is a Prometheus reload worth its cost (a reload
    re-discovers the Alertmanagers, and a notification sent meanwhile waits for the next resend).
    """
    from pdserve.deploy.grafana.alerts import workers_expected_rules

    path, text = expected_path(state_dir), workers_expected_rules(counts)
    if path.is_file() and path.read_text() == text:
        return False
    _atomic_write(path, text)
    return True


def target_group(metrics_url: str, name: str) -> dict[str, object]:
    """One process's file_sd target group, labelled ``worker=name``."""
    return {"targets": [_host_port(metrics_url)], "labels": {"worker": name}}


def targets(status: worker_pb2.ClusterStatus) -> list[dict[str, object]]:
    """file_sd target groups: one per process with a metrics URL, labelled with its id."""
    groups: list[dict[str, object]] = []
    if status.metrics_url:
        groups.append({"targets": [_host_port(status.metrics_url)], "labels": {"worker": "router"}})
    for e in sorted(status.workers, key=lambda e: e.info.worker_id):
        if e.info.metrics_url:
            groups.append(
                {"targets": [_host_port(e.info.metrics_url)], "labels": {"worker": e.info.worker_id}}
            )
    return groups


def write_targets(state_dir: Path, groups: list[dict[str, object]]) -> Path:
    """Atomically replace the targets file (Prometheus watches it and must never read half a file)."""
    return _atomic_write(targets_path(state_dir), json.dumps(groups, indent=2) + "\n")


def write_autoscaler_target(state_dir: Path, metrics_url: str) -> Path:
    """List the autoscaler (``metrics_url``; "" lists nothing) for Prometheus, atomically."""
    groups: list[dict[str, object]] = []
    if metrics_url:
        groups.append({"targets": [_host_port(metrics_url)], "labels": {"worker": "autoscaler"}})
    return _atomic_write(autoscaler_targets_path(state_dir), json.dumps(groups, indent=2) + "\n")


def _glob(path: str) -> str:
    """``x/name.yml`` -> ``x/name*.yml``: matches the file, and nothing when it is absent."""
    stem, ext = posixpath.splitext(path)
    return f"{stem}*{ext}"


def render_config(targets_file: str, scrape_interval_s: float = 5.0, alertmanager: str = "") -> str:
    """A Prometheus config scraping the cluster listed in ``targets_file`` (relative: to the config; its
    glob also reads the autoscaler's ``targets-autoscaler.json`` beside it),
    loading the alert rules beside it, and sending alerts to ``alertmanager`` (host:port) when given."""
    if not scrape_interval_s > 0:
        raise ValueError(f"scrape interval must be > 0, got {scrape_interval_s}")
    ms = round(scrape_interval_s * 1000)
    interval = f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"
    # Two rule files: the alerts beside the config, and the expected worker counts beside the targets
    # (written by `up`/`scale`, emptied by `down`), which Prometheus rereads on SIGHUP.
    # Globs: a rule file not written yet (the expected counts exist only while a cluster runs) is no
    # error to Prometheus, and with a wildcard none to `promtool check config` either.
    rules = _glob(RULES_FILE)
    expected = _glob(posixpath.join(posixpath.dirname(targets_file), EXPECTED_FILE))
    alerting = (
        (
            "alerting:\n  alertmanagers:\n    - static_configs:\n"
            f"        - targets: [{json.dumps(alertmanager)}]\n"
        )
        if alertmanager
        else ""
    )
    return (
        "# Scrapes a pdserve cluster: the router and every worker, as `pdserve up`/`scale` list them.\n"
        "# Generated by deploy/local/prometheus.py (render_config); "
        "tests/unit/test_observability.py checks it.\n"
        "global:\n"
        f"  scrape_interval: {interval}\n"
        f"  evaluation_interval: {interval}\n"
        "rule_files:\n"
        f"  - {json.dumps(rules)}\n"
        f"  - {json.dumps(expected)}\n"
        f"{alerting}"
        "scrape_configs:\n"
        f"  - job_name: {JOB_NAME}\n"
        "    file_sd_configs:\n"
        f"      - files: [{json.dumps(_glob(targets_file))}]\n"
        f"        refresh_interval: {interval}\n"
    )


def find_binary() -> str | None:
    """``prometheus`` on PATH, else the one ``make prometheus`` unpacked into this virtualenv."""
    found = shutil.which("prometheus")
    if found:
        return found
    local = Path(sys.prefix) / VENV_PREFIX / "usr" / "bin" / "prometheus"
    return str(local) if os.access(local, os.X_OK) else None


def server_argv(
    binary: str,
    state_dir: Path,
    listen: str,
    scrape_interval_s: float,
    alertmanager: str = "",
    alert_for_s: float | None = None,
) -> list[str]:
    """Write ``<state-dir>/prometheus/prometheus.yml`` and its ``alerts.yml`` and return the command that
    serves them. ``alert_for_s`` replaces every rule's ``for`` (a demo or a test that must fire fast)."""
    from pdserve.deploy.grafana import alerts

    pdir = (Path(state_dir) / PROMETHEUS_DIR).resolve()
    pdir.mkdir(parents=True, exist_ok=True)
    (pdir / RULES_FILE).write_text(alerts.render(alerts.alerts(), alert_for_s))
    config = pdir / CONFIG_FILE
    config.write_text(render_config(TARGETS_FILE, scrape_interval_s, alertmanager))
    return [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={pdir / 'data'}",
        f"--web.listen-address={listen}",
        "--storage.tsdb.retention.time=2d",
    ]


def wait_ready(url: str, timeout_s: float, alive=lambda: True) -> bool:
    """Poll ``url``/-/ready until Prometheus answers 200, it dies (``alive``), or ``timeout_s`` passes."""
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up and alive():
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=2.0) as resp:
                if resp.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(_READY_POLL_S)
    return False
