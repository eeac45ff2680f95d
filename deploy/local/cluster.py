"""A local cluster of background processes: the state file, spawning, readiness, scaling, stopping.

``pdserve up`` writes ``<state-dir>/cluster.json`` (``ClusterState``) before it
waits for anything, so ``down`` can always find what ``up`` started. Every
process is started in its own session (``start_new_session``) with its log in
``<state-dir>/logs/``; it is stopped by its pid only (after checking the pid
still runs ``cli``, so a reused pid is never signalled).

Removing a worker (``scale`` down, ``down``): the router's DrainWorker (the
worker stops taking requests, finishes in-flight ones, deregisters, exits),
then SIGTERM, then SIGKILL, each step bounded.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import grpc
import msgspec
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.worker.auth import read_token_file, token_metadata
from pdserve.worker.role import Role
from pdserve.worker.tls import NO_TLS, TLSConfig, channel

STATE_FILE = "cluster.json"
GENERATION_SERVICE = "pdserve.v1.Generation"
_POLL_S = 0.2
_RPC_TIMEOUT_S = 2.0


class ProcessEntry(msgspec.Struct, frozen=True):
    id: str
    pid: int
    start: int  # start time (clock ticks since boot): with the pid, identifies the process
    log: str
    role: Role | None = None  # None: the router
    cpus: tuple[int, ...] = ()  # the cores it is pinned to (sched_setaffinity); empty: not pinned
    device: str = ""  # a worker's --device (cpu | cuda:N); "": the router, or a state file from before
    gpu_memory_utilization: float = 0.0  # a GPU worker's --gpu-memory-utilization: its share of the GPU
    standby: bool = False  # started into the warm pool (``--standby``) and not promoted since
    threads: int = 0  # a worker's --threads; 0: the cluster's (``ClusterState.threads``; older state files)


class ClusterState(msgspec.Struct, frozen=True):
    router_address: str
    router: ProcessEntry
    model: str
    dtype: str
    threads: int
    host: str
    # `up` chose ``threads`` (no --threads): a worker added later gets no more than the cores shared
    # evenly among the workers then running (``spawn_workers``), so a grown pool does not oversubscribe.
    threads_auto: bool = False
    worker_flags: tuple[str, ...] = ()  # tuning flags every worker of this cluster is started with
    workers: tuple[ProcessEntry, ...] = ()
    next_index: int = 1  # worker ids are never reused within a cluster's life
    version: int = 1
    prometheus: ProcessEntry | None = None  # `up --prometheus`: the Prometheus server scraping the cluster
    prometheus_url: str = ""
    alertmanager: ProcessEntry | None = None  # `up --alertmanager`: where that Prometheus sends alerts
    alertmanager_url: str = ""
    pin_cpus: bool = False  # `up --pin-cpus`: every worker gets its own cores (see ``choose_cpus``)
    token_file: str = ""  # the cluster token `up` made (``worker.auth``); "": an open control plane
    device: str = "cpu"  # `up --device`, resolved (cpu | cuda:N): where workers run unless `scale` says
    gpu_memory_utilization: float = 0.9  # each GPU worker's share of its GPU unless `scale` says
    # `up --tls-cert/--tls-key/--tls-ca` (``worker.tls``): the files the cluster's processes use; "": none.
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    # `up --autoscale` (``deploy.local.autoscaler``): the process that sizes the pools; it owns `workers`
    # while it runs (`scale` refuses, `down` stops it first).
    autoscaler: ProcessEntry | None = None


class ClusterError(RuntimeError):
    pass


class StateBusy(ClusterError):
    """Another pdserve command holds the state dir (``state_lock``)."""


def state_path(state_dir: Path) -> Path:
    return Path(state_dir) / STATE_FILE


LOCK_FILE = ".lock"


@contextlib.contextmanager
def state_lock(
    state_dir: Path,
    *,
    create: bool = False,
    wait_s: float = 0.0,
    interrupt: bool = False,
    progress: Callable[[str], None] = lambda _: None,
) -> Iterator[None]:
    """Hold the state dir for one command that changes its cluster (``up``, ``scale``, ``down``): a second
    one at the same time is refused (ClusterError) instead of racing it (two ``scale`` calls started
    workers under one id). ``create``: make the dir (``up``); else a missing dir is nothing to hold.
    ``wait_s``: wait that long for the holder; ``interrupt``: first ask it to stop as Ctrl-C would (``down``
    stops a hung ``up``: it stops what it started on the way out)."""
    d = Path(state_dir)
    if not d.is_dir():
        if not create:
            yield
            return
        d.mkdir(parents=True, exist_ok=True)
    fd = os.open(d / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)  # (not inherited by children)
    try:
        start = time.monotonic()
        give_up, asked = start + wait_s, {}
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = _holder(fd)
            if interrupt and holder.isdigit() and _interruptible(int(holder)):
                # As Ctrl-C first (`up` then stops what it started); SIGTERM if that was not enough (a
                # process started with SIGINT ignored, as `&` in a script does).
                pid, now = int(holder), time.monotonic()
                if pid not in asked:
                    progress(f"asking the pdserve command holding {d} (pid {pid}) to stop")
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGINT)
                    asked[pid] = now
                elif asked[pid] and now - asked[pid] > _INTERRUPT_GRACE_S:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGTERM)
                    asked[pid] = 0.0
            if time.monotonic() >= give_up:
                raise StateBusy(
                    f"another pdserve command (pid {holder}) is changing the cluster in {d}: try again once "
                    "it is done"
                )
            time.sleep(_POLL_S)
        # The pid over the old one, then the rest cut: a reader never finds the file empty ("pid ?").
        mine = f"{os.getpid()}\n".encode()
        os.pwrite(fd, mine, 0)
        os.ftruncate(fd, len(mine))
        yield
    finally:
        os.close(fd)  # (releases the lock)


def _holder(fd: int) -> str:
    """The pid the lock's holder wrote ("?" if it has not yet: it writes just after taking the lock)."""
    for _ in range(5):
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if text:
            return text
        time.sleep(0.01)
    return "?"


_INTERRUPT_GRACE_S = 15.0


def _interruptible(pid: int) -> bool:
    """A pdserve command ``down`` may interrupt to take the state dir: not itself, not another ``down``
    or a ``drain`` (they end by themselves), and not a pid reused by something else since."""
    if pid == os.getpid():
        return False
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    words = [a.decode(errors="replace") for a in argv]
    command = next((w for w in words if w in ("up", "scale", "down", "drain", "autoscale")), "")
    is_pdserve = any("pdserve" in w for w in words[:3])
    return is_pdserve and command in ("up", "scale", "autoscale")


def load_state(state_dir: Path) -> ClusterState | None:
    """The cluster ``up`` started in ``state_dir``; None: none there. ClusterError: the file is there but
    unreadable (``save_state`` writes it whole, so only something else can have broken it)."""
    path = state_path(state_dir)
    if not path.is_file():
        return None
    try:
        return msgspec.json.decode(path.read_bytes(), type=ClusterState)
    except (OSError, msgspec.DecodeError) as e:  # (ValidationError is a DecodeError)
        raise ClusterError(
            f"{path} is not a readable pdserve state file ({e}). The processes it listed may still run: "
            f"their logs are in {path.parent / 'logs'}, each starting with its pid; stop them, then remove "
            "the file"
        ) from None


def save_state(state_dir: Path, state: ClusterState) -> None:
    """Atomic: a reader sees the old file or the new one."""
    path = state_path(state_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(state), indent=2))
    os.replace(tmp, path)


def remove_state(state_dir: Path) -> None:
    state_path(state_dir).unlink(missing_ok=True)


def default_threads(n_workers: int, cpus: int | None = None) -> int:
    """Torch threads per worker: the cores shared evenly, at least one each.

    On the 2-core reference machine two or more workers get 1 thread each, so
    they do not oversubscribe the cores and slow each other down; a single
    worker gets both.
    """
    cpus = cpus or os.cpu_count() or 1
    return max(1, cpus // max(n_workers, 1))


def _running_on_cpu(state: ClusterState) -> list[ProcessEntry]:
    return [w for w in state.workers if alive(w) and w.device in ("", "cpu")]


def cpu_threads(state: ClusterState) -> int:
    """Torch threads of the running CPU workers, together (each its own --threads)."""
    return sum(w.threads or state.threads for w in _running_on_cpu(state))


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """``"0,2-3"`` -> ``(0, 2, 3)``: the Linux cpu-list syntax (taskset -c, /sys cpulist files)."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"not a cpu list: {text!r} (expected e.g. 0,2-3)")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"not a cpu list: {text!r} ({part} runs backwards)")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise ValueError(f"not a cpu list: {text!r}")
    return tuple(sorted(cpus))


def format_cpu_list(cpus: Iterable[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def choose_cpus(taken: Iterable[Iterable[int]], threads: int, available: Sequence[int]) -> tuple[int, ...]:
    """The ``threads`` cores (of ``available``) least used by the workers already pinned (``taken``).

    Ties go to the lowest core id, so a cluster's placement is the same every
    time: on 2 cores with 1 thread each, the first worker gets core 0 and the
    second core 1 whatever their roles, so ``1P+1D`` and ``2x colocated`` run on
    the same cores. More threads than cores: all of them.
    """
    if threads >= len(available):
        return tuple(sorted(available))
    use = dict.fromkeys(sorted(available), 0)
    for cpus in taken:
        for c in cpus:
            if c in use:
                use[c] += 1
    return tuple(sorted(sorted(use, key=lambda c: (use[c], c))[:threads]))


def available_cpus() -> tuple[int, ...]:
    """The cores this process may run on (its affinity mask), else all of them."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return tuple(range(os.cpu_count() or 1))


# ---- processes ----------------------------------------------------------------------------------------


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
    stat = proc_stat(proc.pid)
    return ProcessEntry(
        id=entry_id, pid=proc.pid, start=stat[1] if stat else 0, log=str(log_path), role=role, cpus=cpus
    )


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


# Set in the environment of every process ``spawn`` starts: the absolute state dir of its cluster.
CLUSTER_ENV = "PDSERVE_CLUSTER_STATE_DIR"


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
    procs = [p for p in (state.router, *state.workers, *monitoring(state)) if alive(p)]
    stop_processes(procs, term_timeout_s)
    return [p.id for p in first + procs]


def monitoring(state: ClusterState) -> tuple[ProcessEntry, ...]:
    """The Prometheus and Alertmanager `up` started for this cluster, if any."""
    return tuple(p for p in (state.prometheus, state.alertmanager) if p is not None)


_RUN_MARK = "==== pdserve:"  # the line ``spawn`` writes before each process it starts on a log


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


# ---- talking to the router ----------------------------------------------------------------------------


def state_token(state: ClusterState) -> str:
    """The cluster token of a cluster `up` started ("" for one without)."""
    return read_token_file(state.token_file) if state.token_file else ""


def state_tls(state: ClusterState) -> TLSConfig:
    """How to call the router of a cluster `up` started: its TLS files (NO_TLS for one without)."""
    return TLSConfig.load(state.tls_cert, state.tls_key, state.tls_ca)


def cluster_status(
    address: str, timeout_s: float = _RPC_TIMEOUT_S, token: str = "", tls: TLSConfig = NO_TLS
) -> worker_pb2.ClusterStatus:
    with channel(address, tls) as ch:
        stub = worker_pb2_grpc.RegistryStub(ch)
        return stub.GetClusterStatus(worker_pb2.Empty(), timeout=timeout_s, metadata=token_metadata(token))


def drain_worker(address: str, worker_id: str, token: str = "", tls: TLSConfig = NO_TLS) -> bool:
    with channel(address, tls) as ch:
        stub = worker_pb2_grpc.RegistryStub(ch)
        req = worker_pb2.DrainWorkerRequest(worker_id=worker_id)
        return stub.DrainWorker(req, timeout=_RPC_TIMEOUT_S, metadata=token_metadata(token)).found


def promote_worker(
    address: str, worker_id: str, token: str = "", tls: TLSConfig = NO_TLS
) -> worker_pb2.PromoteWorkerResponse:
    """Take a warm-pool worker into routing (the router's PromoteWorker)."""
    with channel(address, tls) as ch:
        stub = worker_pb2_grpc.RegistryStub(ch)
        req = worker_pb2.PromoteWorkerRequest(worker_id=worker_id)
        return stub.PromoteWorker(req, timeout=_RPC_TIMEOUT_S, metadata=token_metadata(token))


def router_serving(address: str, tls: TLSConfig = NO_TLS) -> bool:
    try:
        with channel(address, tls) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=GENERATION_SERVICE), timeout=_RPC_TIMEOUT_S
            )
    except grpc.RpcError:
        return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def wait_ready(
    state: ClusterState,
    worker_ids: set[str],
    timeout_s: float,
    progress: Callable[[str], None] = lambda _: None,
) -> None:
    """Wait until the router serves and every worker in ``worker_ids`` is READY.

    Raises ClusterError naming the process whose exit (or the timeout) ended the wait, with its log tail.
    """
    give_up = time.monotonic() + timeout_s
    procs = [state.router] + [w for w in state.workers if w.id in worker_ids]
    last = ""
    while True:
        for p in procs:
            if not alive(p):
                raise ClusterError(
                    f"{p.id} (pid {p.pid}) exited while starting; last lines of {p.log}:\n{log_tail(p.log)}"
                )
        waiting = _not_ready(state.router_address, worker_ids, state_token(state), state_tls(state))
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


def _not_ready(address: str, worker_ids: set[str], token: str, tls: TLSConfig) -> set[str]:
    if not router_serving(address, tls):
        return {"router", *worker_ids}
    try:
        status = cluster_status(address, token=token, tls=tls)
    except grpc.RpcError:
        return {"router", *worker_ids}
    # A warm-pool worker is ready once loaded and registered (STANDBY): it waits for its promotion.
    up = (worker_pb2.WORKER_STATE_READY, worker_pb2.WORKER_STATE_STANDBY)
    ready = {e.info.worker_id for e in status.workers if e.load.state in up}
    return worker_ids - ready


# ---- commands -----------------------------------------------------------------------------------------


def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    # OpenMP sizes its pool at start: match torch's thread count so workers do not oversubscribe cores.
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.cli", *args]


def spawn_router(
    state_dir: Path, host: str, port: int, model: str, router_args: Sequence[str]
) -> ProcessEntry:
    log = state_dir / "logs" / "router.log"
    argv = _cli("router", "--host", host, "--port", str(port), "--model", model, *router_args)
    return spawn("router", argv, log, child_env(1))


def gpu_share(state: ClusterState, device: str, leaving: Iterable[ProcessEntry] = ()) -> float:
    """The share of GPU ``device`` that the cluster's live workers on it take (``leaving``: not counted)."""
    gone = {w.id for w in leaving}
    return sum(
        w.gpu_memory_utilization
        for w in state.workers
        if w.device == device and w.id not in gone and alive(w)
    )


def check_gpu_shares(device: str, taken: float, count: int, each: float) -> None:
    """ClusterError unless ``count`` more workers of ``each`` fit on GPU ``device`` beside ``taken``."""
    if device == "cpu" or count == 0 or taken + count * each <= 1.0 + 1e-9:
        return
    room = max(1.0 - taken, 0.0)
    beside = f" beside the {taken:.2f} its workers already take" if taken else ""
    raise ClusterError(
        f"--gpu-memory-utilization {each:g} for each of {count} new worker(s) on {device} adds up to "
        f"{taken + count * each:.2f} of its memory{beside}; give at most {room / count:.3f} "
        "(each worker's share)"
    )


def spawn_workers(
    state_dir: Path,
    state: ClusterState,
    role: Role,
    count: int,
    device: str | None = None,
    gpu_memory_utilization: float | None = None,
    standby: bool = False,
) -> ClusterState:
    """Start ``count`` workers of ``role`` on ``device`` (default: the cluster's), each with
    ``gpu_memory_utilization`` (default: the cluster's), into the warm pool when ``standby``; returns
    the state listing them."""
    device = state.device if device is None else device
    util = state.gpu_memory_utilization if gpu_memory_utilization is None else gpu_memory_utilization
    threads = state.threads
    if state.threads_auto and device == "cpu":  # the cores shared among the CPU workers there will be
        threads = min(threads, default_threads(len(_running_on_cpu(state)) + count))
    new: list[ProcessEntry] = []
    try:
        index = _spawn_each(state_dir, state, role, count, device, util, standby, threads, new)
    except BaseException:  # the state returned never lists these: stop them, not leave them running
        stop_processes(new, term_timeout_s=10.0)
        raise
    return msgspec.structs.replace(state, workers=(*state.workers, *new), next_index=index)


def _spawn_each(
    state_dir: Path,
    state: ClusterState,
    role: Role,
    count: int,
    device: str,
    util: float,
    standby: bool,
    threads: int,
    new: list[ProcessEntry],
) -> int:
    """``spawn_workers``' loop: appends each started worker to ``new``; returns the next index."""
    index = state.next_index
    for _ in range(count):
        wid = f"{role.value}-{index}"
        index += 1
        log = state_dir / "logs" / f"{wid}.log"
        cpus: tuple[int, ...] = ()
        if state.pin_cpus:
            live = [w.cpus for w in (*state.workers, *new) if alive(w)]
            cpus = choose_cpus(live, threads, available_cpus())
        argv = _cli(
            "worker",
            "--role",
            role.value,
            "--router",
            state.router_address,
            "--host",
            state.host,
            "--port",
            "0",
            "--model",
            state.model,
            "--dtype",
            state.dtype,
            "--device",
            device,
            "--gpu-memory-utilization",
            repr(util),
            "--threads",
            str(threads),
            "--worker-id",
            wid,
            *(("--cpus", format_cpu_list(cpus)) if cpus else ()),
            *(("--standby",) if standby else ()),
            *state.worker_flags,
        )
        entry = spawn(wid, argv, log, child_env(threads), role, cpus)
        new.append(
            msgspec.structs.replace(
                entry, device=device, gpu_memory_utilization=util, standby=standby, threads=threads
            )
        )
    return index


def remove_workers(
    state: ClusterState,
    entries: Sequence[ProcessEntry],
    drain_timeout_s: float,
    progress: Callable[[str], None] = lambda _: None,
) -> list[str]:
    """Drain each worker through the router, wait for it to exit; SIGTERM/SIGKILL stragglers.

    Returns the ids that did not drain in time (they were then stopped by signal).
    """
    for e in entries:
        # One the router does not know (still loading, or the router is unreachable) gets SIGTERM now: a
        # loading worker then never joins, a serving one drains as on the router's word. Left alone, it
        # registered and took requests while the rest were going, and the wait ran to its timeout.
        try:
            if not drain_worker(state.router_address, e.id, state_token(state), state_tls(state)):
                progress(f"{e.id} is not registered with the router; stopping it by signal")
                send(e, signal.SIGTERM)
        except grpc.RpcError as err:
            progress(f"could not ask the router to drain {e.id} ({err.code().name}); stopping it by signal")
            send(e, signal.SIGTERM)
    stuck = _wait_drained(state, entries, drain_timeout_s, progress)
    cut_drains(stuck)
    return [p.id for p in stuck]


_DRAIN_NOTE_S = 10.0  # a drain that lasts says what it still waits for this often


def _wait_drained(
    state: ClusterState, entries: Sequence[ProcessEntry], timeout_s: float, progress: Callable[[str], None]
) -> list[ProcessEntry]:
    """``wait_exit``, saying every ``_DRAIN_NOTE_S`` which workers still drain and what they still run
    (a drain of long streams took 37 s with no word)."""
    start = time.monotonic()
    give_up = start + timeout_s
    pending = wait_exit(entries, min(_DRAIN_NOTE_S, timeout_s))
    while pending and (now := time.monotonic()) < give_up:
        running = _running(state)
        still = ", ".join(f"{p.id} ({running[p.id]} running)" if p.id in running else p.id for p in pending)
        progress(f"still draining after {now - start:.0f}s: {still}; {give_up - now:.0f}s left")
        pending = wait_exit(pending, min(_DRAIN_NOTE_S, give_up - now))
    return pending


def _running(state: ClusterState) -> dict[str, int]:
    """Requests each worker runs, as the router last heard ({} when it cannot say)."""
    try:
        status = cluster_status(state.router_address, token=state_token(state), tls=state_tls(state))
    except grpc.RpcError:
        return {}
    return {e.info.worker_id: e.load.running for e in status.workers}


def replace_worker(state: ClusterState, entry: ProcessEntry) -> ClusterState:
    """The state with the worker of ``entry``'s id replaced by ``entry``."""
    return msgspec.structs.replace(
        state, workers=tuple(entry if w.id == entry.id else w for w in state.workers)
    )


def adopt_promotions(
    state: ClusterState, status: worker_pb2.ClusterStatus
) -> tuple[ClusterState, list[ProcessEntry]]:
    """Standby workers the router promoted on its own (their pool's last serving worker died:
    ``RouterService.cover_with_standby``) recorded as serving; returns (state, the promoted ones). The
    caller saves the state."""
    promoted = {e.info.worker_id for e in status.workers if not e.info.standby}
    adopted = [w for w in state.workers if w.standby and w.id in promoted]
    for w in adopted:
        state = replace_worker(state, msgspec.structs.replace(w, standby=False))
    return state, adopted


def live_workers(state: ClusterState) -> tuple[ClusterState, list[ProcessEntry]]:
    """Drop workers whose process is gone from the state; returns (state, the dropped ones)."""
    gone = [w for w in state.workers if not alive(w)]
    if not gone:
        return state, []
    return msgspec.structs.replace(state, workers=tuple(w for w in state.workers if w not in gone)), gone
