"""The cluster's background processes: spawning one (own session, own log), telling whether it still
runs, waiting for readiness, and stopping by pid only."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import grpc

from pdserve.deploy.local.cluster import rpc
from pdserve.deploy.local.cluster.state import (
    ClusterError,
    ClusterState,
    ProcessEntry,
    load_state,
    monitoring,
)
from pdserve.proto import worker_pb2
from pdserve.worker.role import Role
from pdserve.worker.tls import TLSConfig

_POLL_S = 0.2
_RUN_MARK = "==== pdserve:"  # the line ``spawn`` writes before each process it starts on a log
# Set in the environment of every process ``spawn`` starts: the absolute state dir of its cluster.
CLUSTER_ENV = "PDSERVE_CLUSTER_STATE_DIR"


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of a process, or None when there is none."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    except OSError:
        return None
    return fields[0], int(fields[19])


def spawn(
    entry_id: str,
    argv: Sequence[str],
    log_path: Path,
    env: dict[str, str],
    role: Role | None = None,
    cpus: tuple[int, ...] = (),
) -> ProcessEntry:
    """Start a background process in its own session, output to ``log_path`` (``<state-dir>/logs/``).
    Its environment names the state dir (``CLUSTER_ENV``): ``marked_processes`` finds it by that should
    the state file be lost."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**env, CLUSTER_ENV: str(log_path.parent.parent.resolve())}
    with open(log_path, "ab") as log:
        # Logs are appended (earlier runs stay for reading); ``log_tail`` shows this run's lines only.
        log.write(f"{_RUN_MARK} {entry_id} started {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    _await_mark(proc.pid, f"{CLUSTER_ENV}={env[CLUSTER_ENV]}".encode())
    stat = proc_stat(proc.pid)
    return ProcessEntry(
        id=entry_id, pid=proc.pid, start=stat[1] if stat else 0, log=str(log_path), role=role, cpus=cpus
    )


def _await_mark(pid: int, mark: bytes, timeout_s: float = 2.0) -> None:
    """Until the new process's environment shows ``mark`` (bounded). Popen returns once the exec began,
    and the kernel sets up the new environment a moment later: a ``down`` in that moment (the spawning
    command interrupted) would not find the process by its mark."""
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        try:
            if mark in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return
        except OSError:  # gone, or no /proc here
            return
        time.sleep(0.001)


def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    # OpenMP sizes its pool at start: match torch's thread count so workers do not oversubscribe cores.
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def cli_argv(*args: str) -> list[str]:
    """The command line of a ``pdserve`` subcommand run by this interpreter."""
    return [sys.executable, "-m", "pdserve.cli", *args]


def spawn_router(
    state_dir: Path, host: str, port: int, model: str, router_args: Sequence[str], index: int = 0
) -> ProcessEntry:
    """Router ``index`` of the cluster (``up --routers``): ``router``, then ``router-1``, ``router-2``..."""
    name = f"router-{index}" if index else "router"
    log = state_dir / "logs" / f"{name}.log"
    argv = cli_argv("router", "--host", host, "--port", str(port), "--model", model, *router_args)
    return spawn(name, argv, log, child_env(1))


def live_router(state: ClusterState) -> str:
    """The address of a router of the cluster that runs (the first one that does): any router can be
    asked anything, since every worker registers with every router. ClusterError when none runs."""
    for address, p in state.routers():
        if alive(p):
            return address
    routers = state.routers()
    which = (
        f"the router of the cluster (pid {state.router.pid})"
        if len(routers) == 1
        else f"every router of the cluster (pids {', '.join(str(p.pid) for _, p in routers)})"
    )
    raise ClusterError(f"{which} has exited: `pdserve down`, then `pdserve up` again")


def alive(p: ProcessEntry) -> bool:
    """True while the process ``p`` describes runs: same pid and start time, so a reused pid is not it."""
    try:
        os.waitpid(p.pid, os.WNOHANG)  # reaps it when it is our own exited child
    except ChildProcessError:
        pass
    stat = proc_stat(p.pid)
    return stat is not None and stat[0] != "Z" and stat[1] == p.start


def send(p: ProcessEntry, sig: int) -> None:
    if alive(p):
        try:
            os.kill(p.pid, sig)
        except ProcessLookupError:
            pass


def wait_exit(procs: Iterable[ProcessEntry], timeout_s: float) -> list[ProcessEntry]:
    """Wait (bounded) for the processes to exit; returns those still alive."""
    pending = list(procs)
    give_up = time.monotonic() + timeout_s
    while pending:
        pending = [p for p in pending if alive(p)]
        if not pending or time.monotonic() > give_up:
            break
        time.sleep(_POLL_S)
    return pending


def marked_processes(state_dir: Path) -> list[ProcessEntry]:
    """The live processes ``spawn`` started for the cluster of ``state_dir`` (this user's), found by
    ``CLUSTER_ENV`` in their environment: how ``down`` stops a cluster whose state file is unreadable."""
    mark = f"{CLUSTER_ENV}={state_dir.resolve()}".encode()
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if mark not in (d / "environ").read_bytes().split(b"\0"):
                continue
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone, or another user's
            continue
        stat = proc_stat(int(d.name))
        if stat is None or stat[0] == "Z":
            continue
        # ``python -m pdserve.cli router`` (or worker, autoscale); else the program (prometheus, ...)
        words = [a.decode(errors="replace") for a in argv]
        name = words[3] if len(words) > 3 and words[2] == "pdserve.cli" else Path(words[0]).name
        found.append(ProcessEntry(id=f"{name} (pid {d.name})", pid=int(d.name), start=stat[1], log=""))
    return found


def cut_drains(procs: Sequence[ProcessEntry], term_timeout_s: float = 10.0) -> list[str]:
    """Workers still draining past their time: stop them now, cutting their requests in flight. A draining
    worker takes its first SIGTERM for a drain (it may be the one a preStop hook's drain is followed by);
    the second one cuts (``worker.shell``). SIGKILL after ``term_timeout_s``. Returns the ids killed."""
    for p in procs:
        send(p, signal.SIGTERM)
    time.sleep(0.5)  # (signals sent at once may be taken as one)
    return stop_processes(procs, term_timeout_s)


def stop_processes(
    procs: Sequence[ProcessEntry], term_timeout_s: float, kill_timeout_s: float = 5.0
) -> list[str]:
    """SIGTERM, wait, SIGKILL what is left. Returns the ids of those that had to be killed."""
    for p in procs:
        send(p, signal.SIGTERM)
    stuck = wait_exit(procs, term_timeout_s)
    for p in stuck:
        send(p, signal.SIGKILL)
    wait_exit(stuck, kill_timeout_s)
    return [p.id for p in stuck]


def stop_survivors(state_dir: Path, term_timeout_s: float = 5.0) -> list[str]:
    """Stop every process the state file still lists as alive (the autoscaler first, router, workers,
    Prometheus, Alertmanager): the backstop after ``pdserve down`` for tests and benchmarks. Returns the
    ids that had to be stopped."""
    state = load_state(state_dir)
    if state is None:
        return []
    first = [state.autoscaler] if state.autoscaler is not None and alive(state.autoscaler) else []
    if first:  # it starts workers: stop it, then read what it left in the state file
        stop_processes(first, term_timeout_s)
        state = load_state(state_dir) or state
    routers = [p for _, p in state.routers()]
    procs = [p for p in (*routers, *state.workers, *monitoring(state)) if alive(p)]
    stop_processes(procs, term_timeout_s)
    return [p.id for p in first + procs]


def log_tail(path: str | Path, lines: int = 30) -> str:
    """The last ``lines`` lines the latest process started on this log wrote (not an earlier run's)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return f"(no log at {path})"
    run = text.splitlines()
    marks = [i for i, line in enumerate(run) if line.startswith(_RUN_MARK)]
    if marks:
        run = run[marks[-1] + 1 :]
    return "\n".join(run[-lines:])


# ---- readiness ----------------------------------------------------------------------------------------


def wait_ready(
    state: ClusterState,
    worker_ids: set[str],
    timeout_s: float,
    progress: Callable[[str], None] = lambda _: None,
) -> None:
    """Wait until every router serves and lists every worker in ``worker_ids`` READY.

    Raises ClusterError naming the process whose exit (or the timeout) ended the wait, with its log tail.
    """
    give_up = time.monotonic() + timeout_s
    # Routers that had exited before the wait (one of several killed) are not waited for: the others
    # serve. One that exits during the wait ends it, as a worker does.
    routers = [(i, a, p) for i, (a, p) in enumerate(state.routers()) if alive(p)] or [
        (0, state.router_address, state.router)
    ]
    procs = [p for _, _, p in routers] + [w for w in state.workers if w.id in worker_ids]
    last = ""
    while True:
        for p in procs:
            if not alive(p):
                raise ClusterError(
                    f"{p.id} (pid {p.pid}) exited while starting; last lines of {p.log}:\n{log_tail(p.log)}"
                )
        token, tls = rpc.state_token(state), rpc.state_tls(state)
        waiting = set()
        for i, address, _ in routers:
            waiting |= _not_ready(address, f"router-{i}" if i else "router", worker_ids, token, tls)
        if not waiting:
            return
        note = f"waiting for: {', '.join(sorted(waiting))}"
        if note != last:
            progress(note)
            last = note
        if time.monotonic() > give_up:
            tails = "\n".join(
                f"--- {p.id} ({p.log}):\n{log_tail(p.log, 15)}" for p in procs if p.id in waiting
            )
            raise ClusterError(f"not ready after {timeout_s:.0f}s: {', '.join(sorted(waiting))}\n{tails}")
        time.sleep(_POLL_S)


def _not_ready(address: str, name: str, worker_ids: set[str], token: str, tls: TLSConfig) -> set[str]:
    if not rpc.router_serving(address, tls):
        return {name, *worker_ids}
    try:
        status = rpc.cluster_status(address, token=token, tls=tls)
    except grpc.RpcError:
        return {name, *worker_ids}
    # A warm-pool worker is ready once loaded and registered (STANDBY): it waits for its promotion.
    up = (worker_pb2.WORKER_STATE_READY, worker_pb2.WORKER_STATE_STANDBY)
    ready = {e.info.worker_id for e in status.workers if e.load.state in up}
    return worker_ids - ready
