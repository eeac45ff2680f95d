"""Alertmanager for a local cluster (``pdserve up --alertmanager``): its config, which notifies no one,
and the server process."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

ALERTMANAGER_DIR = "alertmanager"
CONFIG_FILE = "alertmanager.yml"
BINARY = "prometheus-alertmanager"  # Debian's name for it; upstream's is `alertmanager`
# Where ``make alertmanager`` (deploy/prometheus/install.sh) unpacks Debian's package.
VENV_PREFIX = Path("opt") / "alertmanager"
RECEIVER = "pdserve-local"
# Debian's build reads its default notification templates from here and will not start without them.
TEMPLATES = Path("/usr/share/prometheus/alertmanager")


def missing_templates(binary: str) -> str:
    """Why Debian's ``binary`` would not start ("" when it would, or when it is not Debian's)."""
    if Path(binary).name != BINARY or (TEMPLATES / "default.tmpl").is_file():
        return ""
    return (
        f"Debian's alertmanager reads {TEMPLATES / 'default.tmpl'}, which is missing: "
        "`make alertmanager` as root copies it there from the package"
    )


def find_binary() -> str | None:
    """Alertmanager on PATH (Debian's name, then upstream's), else the one ``make alertmanager`` unpacked."""
    for name in (BINARY, "alertmanager"):
        found = shutil.which(name)
        if found:
            return found
    local = Path(sys.prefix) / VENV_PREFIX / "usr" / "bin" / BINARY
    return str(local) if os.access(local, os.X_OK) else None


def render_config(group_wait_s: float = 1.0) -> str:
    """One route to one receiver without integrations (locally there is no one to page: the point is to
    see the alerts); short waits, since nothing is sent anywhere."""
    if not group_wait_s > 0:
        raise ValueError(f"group_wait must be > 0, got {group_wait_s}")
    wait = f"{round(group_wait_s * 1000)}ms"
    return (
        "# Alertmanager of a local pdserve cluster (deploy/local/alertmanager.py): collects the alerts\n"
        "# Prometheus sends and notifies no one. Add receivers here to be paged.\n"
        "route:\n"
        f"  receiver: {RECEIVER}\n"
        "  group_by: [alertname, role]\n"
        f"  group_wait: {wait}\n"
        f"  group_interval: {wait}\n"
        "  repeat_interval: 1h\n"
        "receivers:\n"
        f"  - name: {RECEIVER}\n"
    )


def server_argv(binary: str, state_dir: Path, listen: str) -> list[str]:
    """Write ``<state-dir>/alertmanager/alertmanager.yml`` and return the command that serves it."""
    adir = (Path(state_dir) / ALERTMANAGER_DIR).resolve()
    adir.mkdir(parents=True, exist_ok=True)
    config = adir / CONFIG_FILE
    config.write_text(render_config())
    return [
        binary,
        f"--config.file={config}",
        f"--storage.path={adir / 'data'}",
        f"--web.listen-address={listen}",
        "--cluster.listen-address=",  # no HA gossip: it would bind 0.0.0.0
    ]
