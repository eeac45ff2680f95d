"""Changing a running cluster: starting workers (``up``, ``scale``), draining and removing them
(``scale``, ``down``), and ``LocalControl``, the autoscaler's hands on the cluster."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import msgspec

from pdserve.deploy.local.cluster import placement, processes, rpc
from pdserve.deploy.local.cluster.state import (
    ClusterError,
    ClusterState,
    ProcessEntry,
    load_state,
    replace_worker,
    save_state,
    without_workers,
)
from pdserve.proto import worker_pb2
from pdserve.worker.role import Role

_DRAIN_NOTE_S = 10.0  # a drain that lasts says what it still waits for this often


# ---- starting workers ---------------------------------------------------------------------------------


def worker_argv(
    state: ClusterState,
    role: Role,
    worker_id: str,
    *,
    device: str,
    gpu_memory_utilization: float,
    threads: int,
    cpus: tuple[int, ...],
    standby: bool,
) -> list[str]:
    """The command line of one worker of this cluster: where it registers, its model and placement, then
    the tuning flags `up` was given for every worker (``ClusterState.worker_flags``)."""
    return processes.cli_argv(
        "worker",
        "--role",
        role.value,
        "--router",
        state.router_list,
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
        repr(gpu_memory_utilization),
        "--threads",
        str(threads),
        "--worker-id",
        worker_id,
        *(("--cpus", placement.format_cpu_list(cpus)) if cpus else ()),
        *(("--standby",) if standby else ()),
        *(
            ("--tensor-parallel-size", str(state.tensor_parallel_size(role)))
            if state.tensor_parallel_size(role) > 1
            else ()
        ),
        *state.worker_flags,
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
        threads = min(threads, placement.default_threads(len(placement.running_on_cpu(state)) + count))
    new: list[ProcessEntry] = []
    try:
        index = _spawn_each(state_dir, state, role, count, device, util, standby, threads, new)
    except BaseException:  # the state returned never lists these: stop them, not leave them running
        processes.stop_processes(new, term_timeout_s=10.0)
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
            live = [w.cpus for w in (*state.workers, *new) if processes.alive(w)]
            cpus = placement.choose_cpus(live, threads, placement.available_cpus())
        argv = worker_argv(
            state,
            role,
            wid,
            device=device,
            gpu_memory_utilization=util,
            threads=threads,
            cpus=cpus,
            standby=standby,
        )
        entry = processes.spawn(wid, argv, log, processes.child_env(threads), role, cpus)
        new.append(
            msgspec.structs.replace(
                entry, device=device, gpu_memory_utilization=util, standby=standby, threads=threads
            )
        )
    return index


# ---- removing workers ---------------------------------------------------------------------------------


def remove_workers(
    state: ClusterState,
    entries: Sequence[ProcessEntry],
    drain_timeout_s: float,
    progress: Callable[[str], None] = lambda _: None,
) -> list[str]:
    """Drain each worker through a router (any: the worker tells the others), wait for it to exit;
    SIGTERM/SIGKILL stragglers.

    Returns the ids that did not drain in time (they were then stopped by signal).
    """
    for e in entries:
        # One the router does not know (still loading, or the router is unreachable) gets SIGTERM now: a
        # loading worker then never joins, a serving one drains as on the router's word. Left alone, it
        # would register and take requests while the rest drain, and the wait would run to its timeout.
        try:
            if not rpc.drain_worker(_any_router(state), e.id, rpc.state_token(state), rpc.state_tls(state)):
                progress(f"{e.id} is not registered with the router; stopping it by signal")
                processes.send(e, signal.SIGTERM)
        except grpc.RpcError as err:
            progress(f"could not ask the router to drain {e.id} ({err.code().name}); stopping it by signal")
            processes.send(e, signal.SIGTERM)
    stuck = _wait_drained(state, entries, drain_timeout_s, progress)
    processes.cut_drains(stuck)
    return [p.id for p in stuck]


def _any_router(state: ClusterState) -> str:
    """A router that runs, else the first (a call to it fails, and its caller says so)."""
    try:
        return processes.live_router(state)
    except ClusterError:
        return state.router_address


def _wait_drained(
    state: ClusterState, entries: Sequence[ProcessEntry], timeout_s: float, progress: Callable[[str], None]
) -> list[ProcessEntry]:
    """``wait_exit``, saying every ``_DRAIN_NOTE_S`` which workers still drain and what they still run
    (a drain of long streams may last, and silence looks like a hang)."""
    start = time.monotonic()
    give_up = start + timeout_s
    pending = processes.wait_exit(entries, min(_DRAIN_NOTE_S, timeout_s))
    while pending and (now := time.monotonic()) < give_up:
        running = _running(state)
        still = ", ".join(f"{p.id} ({running[p.id]} running)" if p.id in running else p.id for p in pending)
        progress(f"still draining after {now - start:.0f}s: {still}; {give_up - now:.0f}s left")
        pending = processes.wait_exit(pending, min(_DRAIN_NOTE_S, give_up - now))
    return pending


def _running(state: ClusterState) -> dict[str, int]:
    """Requests each worker runs, as the router last heard ({} when it cannot say)."""
    try:
        status = rpc.cluster_status(
            processes.live_router(state), token=rpc.state_token(state), tls=rpc.state_tls(state)
        )
    except (grpc.RpcError, ClusterError):
        return {}
    return {e.info.worker_id: e.load.running for e in status.workers}


# ---- reconciling the state file with what runs ------------------------------------------------------------


def adopt_promotions(
    state: ClusterState, status: worker_pb2.ClusterStatus
) -> tuple[ClusterState, list[ProcessEntry]]:
    """Standby workers the router promoted on its own (their pool's last serving worker died:
    ``Membership.cover_with_standby``) recorded as serving; returns (state, the promoted ones). The
    caller saves the state."""
    promoted = {e.info.worker_id for e in status.workers if not e.info.standby}
    adopted = [w for w in state.workers if w.standby and w.id in promoted]
    for w in adopted:
        state = replace_worker(state, msgspec.structs.replace(w, standby=False))
    return state, adopted


def live_workers(state: ClusterState) -> tuple[ClusterState, list[ProcessEntry]]:
    """Drop workers whose process is gone from the state; returns (state, the dropped ones)."""
    gone = [w for w in state.workers if not processes.alive(w)]
    if not gone:
        return state, []
    return without_workers(state, gone), gone


# ---- the autoscaler's hands -------------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalControl:
    """The cluster of ``state_dir`` as the autoscaler changes it (``autoscaler.ClusterControl``): its state
    file, its processes, and its router."""

    state_dir: Path

    def load(self) -> ClusterState:
        state = load_state(self.state_dir)
        if state is None:
            raise ClusterError(f"no cluster in {self.state_dir}")
        return state

    def save(self, state: ClusterState) -> None:
        save_state(self.state_dir, state)

    def alive(self, worker: ProcessEntry) -> bool:
        return processes.alive(worker)

    def status(self, state: ClusterState) -> worker_pb2.ClusterStatus:
        return rpc.cluster_status(
            processes.live_router(state), token=rpc.state_token(state), tls=rpc.state_tls(state)
        )

    def start(self, state: ClusterState, role: Role, count: int, *, standby: bool = False) -> ClusterState:
        return spawn_workers(self.state_dir, state, role, count, standby=standby)

    def promote(self, state: ClusterState, worker_id: str) -> worker_pb2.PromoteWorkerResponse:
        return rpc.promote_worker(
            processes.live_router(state), worker_id, rpc.state_token(state), rpc.state_tls(state)
        )

    def drain(self, state: ClusterState, worker_id: str) -> bool:
        router = processes.live_router(state)
        return rpc.drain_worker(router, worker_id, rpc.state_token(state), rpc.state_tls(state))

    def cut(self, workers: Sequence[ProcessEntry]) -> None:
        processes.cut_drains(workers)
