"""Stop with another process: ``PDSERVE_EXIT_WITH_PID``.

A router, worker or autoscaler started with ``PDSERVE_EXIT_WITH_PID=N`` in its environment (children
inherit it, so one setting reaches everything ``pdserve up`` starts) watches process N and, once N is gone,
stops itself as SIGTERM would: a worker drains, the router stops serving. If it has not exited
``kill_after_s`` later, it is killed.

For supervisors and test runs: a killed test session (a CI timeout, kill -9 of pytest) otherwise leaves
its clusters running, since ``pdserve up`` starts them in their own sessions to outlive the shell.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Mapping

from pdserve.deploy.local import cluster

EXIT_WITH_PID_ENV = "PDSERVE_EXIT_WITH_PID"

log = logging.getLogger(__name__)


def exit_with_pid(environ: Mapping[str, str] | None = None) -> int | None:
    """The pid ``PDSERVE_EXIT_WITH_PID`` names, None when unset or empty; ValueError when it is no pid."""
    raw = (os.environ if environ is None else environ).get(EXIT_WITH_PID_ENV, "").strip()
    if not raw:
        return None
    try:
        pid = int(raw)
    except ValueError:
        pid = 0
    if pid < 1:
        raise ValueError(f"{EXIT_WITH_PID_ENV} must be a process id (an integer >= 1), got {raw!r}")
    return pid


def process_gone(pid: int) -> bool:
    """True once ``pid`` has exited: no such process, or a zombie waiting to be reaped."""
    stat = cluster.proc_stat(pid)
    return stat is None or stat[0] == "Z"


def start_lifeline(
    pid: int, *, interval_s: float = 0.5, kill_after_s: float = 30.0, what: str = "pdserve"
) -> threading.Thread:
    """A daemon thread that polls ``pid`` every ``interval_s`` and, once it is gone, sends this process
    SIGTERM, then SIGKILL ``kill_after_s`` later if it is still running."""

    def watch() -> None:
        while not process_gone(pid):
            time.sleep(interval_s)
        log.warning("%s: process %d (%s) is gone; stopping", what, pid, EXIT_WITH_PID_ENV)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(kill_after_s)
        log.error("%s: still running %.0fs after SIGTERM; killing it", what, kill_after_s)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="pdserve-lifeline", daemon=True)
    thread.start()
    return thread
