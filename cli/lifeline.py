"""Stop with another process: with ``PDSERVE_EXIT_WITH_PID=N`` a pdserve process stops once N is gone.

It stops as SIGTERM would (a worker drains), and is killed if still running ``kill_after_s`` later.
Children inherit the variable, so one setting reaches all that ``pdserve up`` starts in its own sessions,
which would otherwise outlive a killed supervisor or test run. Other programs run under ``supervise``.
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


def process_gone(pid: int, start: int | None = None) -> bool:
    """True once ``pid`` has exited: no such process, a zombie waiting to be reaped, or (``start``: its
    start time when the watch began) another process that got the pid since."""
    stat = cluster.proc_stat(pid)
    return stat is None or stat[0] == "Z" or (start is not None and stat[1] != start)


def _watch_until_gone(pid: int, interval_s: float) -> None:
    stat = cluster.proc_stat(pid)
    start = stat[1] if stat is not None else None
    while not process_gone(pid, start):
        time.sleep(interval_s)


def start_lifeline(
    pid: int, *, interval_s: float = 0.5, kill_after_s: float = 30.0, what: str = "pdserve"
) -> threading.Thread:
    """A daemon thread that polls ``pid`` every ``interval_s`` and, once it is gone, sends this process
    SIGTERM, then SIGKILL ``kill_after_s`` later if it is still running."""

    def watch() -> None:
        _watch_until_gone(pid, interval_s)
        log.warning("%s: process %d (%s) is gone; stopping", what, pid, EXIT_WITH_PID_ENV)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(kill_after_s)
        log.error("%s: still running %.0fs after SIGTERM; killing it", what, kill_after_s)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="pdserve-lifeline", daemon=True)
    thread.start()
    return thread


def _die_with(parent: int) -> None:
    """In the child, before exec: SIGTERM when ``parent`` (this wrapper) dies, however it dies (and at
    once if it died already, before the request took effect)."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def supervise(argv: list[str], *, interval_s: float = 0.5, kill_after_s: float = 30.0) -> int:
    """Run ``argv`` tied to ``PDSERVE_EXIT_WITH_PID``; returns its exit status. For programs that are not
    pdserve's (the Prometheus and Alertmanager of ``up --prometheus``), as ``python -m pdserve.cli.lifeline
    PROGRAM ARGS...``: a small parent that forwards signals to the program, stops it the same way once N is
    gone, and whose own death ends it too."""
    import subprocess

    me = os.getpid()
    child = subprocess.Popen(argv, preexec_fn=lambda: _die_with(me))  # noqa: PLW1509 - prctl only
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # (SIGHUP: Prometheus reloads)
        signal.signal(sig, lambda s, _frame: child.send_signal(s))
    parent = exit_with_pid()
    if parent is not None:

        def watch() -> None:
            _watch_until_gone(parent, interval_s)
            log.warning("%s: process %d (%s) is gone; stopping", argv[0], parent, EXIT_WITH_PID_ENV)
            child.terminate()
            try:
                child.wait(kill_after_s)
            except subprocess.TimeoutExpired:
                child.kill()

        threading.Thread(target=watch, name="pdserve-lifeline", daemon=True).start()
    rc = child.wait()
    return 128 - rc if rc < 0 else rc  # killed by signal N: 128 + N, as a shell reports it


if __name__ == "__main__":
    import sys

    if len(sys.argv) < 2:
        sys.exit("usage: python -m pdserve.cli.lifeline PROGRAM [ARGS...]")
    sys.exit(supervise(sys.argv[1:]))
