"""The cluster's state file (``<state-dir>/cluster.json``: what ``up`` started) and the lock that keeps
two commands from changing it at once."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import msgspec

from pdserve.worker.role import Role

STATE_FILE = "cluster.json"
LOCK_FILE = ".lock"
_POLL_S = 0.2
_INTERRUPT_GRACE_S = 15.0


class ProcessEntry(msgspec.Struct, frozen=True):
    id: str
    pid: int
    start: int  # start time (clock ticks since boot): with the pid, identifies the process
    log: str
    role: Role | None = None  # None: the router
    cpus: tuple[int, ...] = ()  # the cores it is pinned to (sched_setaffinity); empty: not pinned
    device: str = ""  # a worker's --device (cpu | cuda:N); "": the router, or a state file without it
    gpu_memory_utilization: float = 0.0  # a GPU worker's --gpu-memory-utilization: its share of the GPU
    standby: bool = False  # started into the warm pool (``--standby``) and not promoted since
    threads: int = 0  # a worker's --threads; 0 (not recorded): the cluster's (``ClusterState.threads``)


class ClusterState(msgspec.Struct, frozen=True):
    """What ``up`` started, saved before it waits for anything, so ``down`` can always find it."""

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
    # `up --routers N`: the routers after the first (router i serves on the first one's ports + i), with
    # their addresses. Every worker registers with every router; any one of them can be asked anything.
    more_routers: tuple[ProcessEntry, ...] = ()
    more_router_addresses: tuple[str, ...] = ()
    # `up --colocated-tp N` (`--prefill-tp`, `--decode-tp`): every worker of that pool is a tensor-parallel
    # group of N processes.
    colocated_tp: int = 1
    prefill_tp: int = 1
    decode_tp: int = 1

    def tensor_parallel_size(self, role: Role) -> int:
        """The size of every group of ``role``'s pool."""
        sizes = {Role.BOTH: self.colocated_tp, Role.PREFILL: self.prefill_tp, Role.DECODE: self.decode_tp}
        return sizes[role]

    def routers(self) -> list[tuple[str, ProcessEntry]]:
        """Every router of the cluster: (address, process), the first router first."""
        more = zip(self.more_router_addresses, self.more_routers, strict=True)
        return [(self.router_address, self.router), *more]

    @property
    def router_list(self) -> str:
        """Every router's address, comma-separated: a worker's ``--router``, a client's target."""
        return ",".join(address for address, _ in self.routers())


class ClusterError(RuntimeError):
    pass


class StateBusy(ClusterError):
    """Another pdserve command holds the state dir (``state_lock``)."""


def state_path(state_dir: Path) -> Path:
    return Path(state_dir) / STATE_FILE


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
    one at the same time is refused (ClusterError) instead of racing it (two ``scale`` calls at once would
    start workers under one id). ``create``: make the dir (``up``); else a missing dir is nothing to hold.
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


def replace_worker(state: ClusterState, entry: ProcessEntry) -> ClusterState:
    """The state with the worker of ``entry``'s id replaced by ``entry``."""
    return msgspec.structs.replace(
        state, workers=tuple(entry if w.id == entry.id else w for w in state.workers)
    )


def without_workers(state: ClusterState, gone: Iterable[ProcessEntry]) -> ClusterState:
    """The state no longer listing the workers ``gone``."""
    ids = {w.id for w in gone}
    return msgspec.structs.replace(state, workers=tuple(w for w in state.workers if w.id not in ids))


def monitoring(state: ClusterState) -> tuple[ProcessEntry, ...]:
    """The Prometheus and Alertmanager `up` started for this cluster, if any."""
    return tuple(p for p in (state.prometheus, state.alertmanager) if p is not None)
