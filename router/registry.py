"""Worker registry: who is in the cluster, in what state, under what load.
Pure logic (no grpc, no torch), driven by the router's gRPC handlers and a periodic sweep."""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from pdserve.worker.role import Role


class State(enum.Enum):
    """A worker at the router: registered LOADING (or READY), READY on a heartbeat that says so; a standby
    worker STANDBY once loaded, until promoted to READY; READY -> DRAINING on a drain, removed when it
    deregisters or reports STOPPED; any state -> removed on missed heartbeats or a failed call."""

    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    STANDBY = "standby"


@dataclass
class Worker:
    worker_id: str
    role: Role
    address: str
    kv_blocks_total: int
    block_size: int
    max_running: int
    metrics_url: str = ""
    pid: int = 0
    instance: str = ""  # random per process (WorkerInfo.instance); "": unknown
    state: State = State.LOADING
    running: int = 0
    queued: int = 0
    queued_prefill_tokens: int = 0
    kv_blocks_used: int = 0
    last_heartbeat: float = 0.0
    # Router-side view, updated on dispatch/finish; heartbeats lag behind it.
    assigned: int = 0
    assigned_prefill_tokens: int = 0
    # KV blocks the router's requests on this worker reserve (prompt + 1 token each), counted at dispatch:
    # a burst routed between two heartbeats sees the blocks of the requests routed before it.
    assigned_kv_blocks: int = 0
    full_until: float = 0.0  # monotonic: it refused a reservation for room (``refused_for_room``)
    drain_requested: bool = False
    standby: bool = False  # held out of routing (the warm pool) until promoted
    prefix_cache_salt: str = ""  # its block hashes' salt (WorkerInfo.prefix_cache_salt); "": no prefix cache
    kv_blocks_cached: int = 0  # held by its prefix cache only (free to evict): by the last heartbeat
    prefill_tokens_per_s: float = 0.0  # its measured prefill rate, by the last heartbeat (0: not yet)
    tensor_parallel_size: int = 1  # the processes of its tensor-parallel group (WorkerInfo)
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def kv_blocks_free(self) -> int:
        """Free by the worker's last heartbeat, or by the router's own count of what it sent since, if
        that is more (the heartbeat lags the dispatches; the count leaves out tokens generated since)."""
        if self.full_until and time.monotonic() < self.full_until:
            return 0
        return max(self.kv_blocks_total - max(self.kv_blocks_used, self.assigned_kv_blocks), 0)

    def refused_for_room(self, hold_s: float) -> None:
        """The worker refused a reservation its last heartbeat had room for (its running requests grew
        since): count it full for ``hold_s`` (past the next heartbeat it sends: one already on its way
        still shows the old room)."""
        self.full_until = time.monotonic() + hold_s


@dataclass(frozen=True)
class RegistryConfig:
    heartbeat_interval_s: float = 0.5
    # A worker is dropped after this long without a heartbeat.
    heartbeat_timeout_s: float = 2.5

    def __post_init__(self) -> None:
        if self.heartbeat_interval_s <= 0:
            raise ValueError("heartbeat_interval_s must be > 0")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"the heartbeat timeout (--heartbeat-timeout, {self.heartbeat_timeout_s} s) must exceed the "
                f"heartbeat interval (--heartbeat-interval, {self.heartbeat_interval_s} s)"
            )


_PROMOTED_EARLY = 1024  # promotions of workers not registered yet, remembered
# How long such a promotion waits for its worker to register: a standby still loading registers within its
# start-up (seconds to a few minutes). One that died first leaves its id behind, and a later process under
# the id (a pod name reused) must register as the standby it was started as, not take routing unasked.
PROMOTED_EARLY_TTL_S = 600.0


class Registry:
    def __init__(self, config: RegistryConfig) -> None:
        self.config = config
        self._workers: dict[str, Worker] = {}
        # worker_id -> the process identity (``_process``) of a worker dropped for missed heartbeats while
        # draining: the same process coming back (it was stopped, not dead) registers straight into its
        # drain. Any other registration of that id (a restarted process) forgets it.
        self._drains_of_dropped: dict[str, tuple[str, int, str]] = {}
        # Standby workers promoted before they registered (the autoscaler promotes one still loading):
        # they register straight into routing, within PROMOTED_EARLY_TTL_S of the promotion (id -> when).
        self._promoted_early: OrderedDict[str, float] = OrderedDict()

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self._workers.values()))

    def __len__(self) -> int:
        return len(self._workers)

    def get(self, worker_id: str) -> Worker | None:
        return self._workers.get(worker_id)

    def held_by_another(self, worker: Worker, now: float) -> Worker | None:
        """The registered worker of the same id that is another process (address or pid) and still
        heartbeats: two live processes under one id, whose heartbeats the router could not tell apart.
        None: the id is free, the same process's, or its holder has stopped heartbeating."""
        old = self._workers.get(worker.worker_id)
        if old is None or now - old.last_heartbeat > self.config.heartbeat_timeout_s:
            return None
        other_pid = bool(old.pid and worker.pid and old.pid != worker.pid)
        return old if old.address != worker.address or other_pid else None

    @staticmethod
    def _process(w: Worker) -> tuple[str, int, str]:
        return (w.address, w.pid, w.instance)

    @staticmethod
    def _same_process(old: tuple[str, int, str], new: tuple[str, int, str]) -> bool:
        """Whether a registration comes from the process registered before: its instance where both
        have one (address and pid repeat in a restarted container), else its address and pid."""
        if old[2] and new[2]:
            return old[2] == new[2]
        if old[1] and new[1]:
            return old[:2] == new[:2]
        return old[0] == new[0]  # nothing else to tell them by

    def register(self, worker: Worker, now: float) -> None:
        """Add or replace a worker (a re-registration after a router restart keeps the worker usable)."""
        old = self._workers.get(worker.worker_id)
        dropped = self._drains_of_dropped.pop(worker.worker_id, None)
        back = dropped is not None and bool(worker.pid) and self._same_process(dropped, self._process(worker))
        if old is None and back:
            old = replace(worker, drain_requested=True)
        if old is not None:
            worker.assigned = old.assigned
            worker.assigned_prefill_tokens = old.assigned_prefill_tokens
            worker.assigned_kv_blocks = old.assigned_kv_blocks
            # A drain asked of a process is its own: a restarted one under the id starts serving.
            if self._same_process(self._process(old), self._process(worker)):
                worker.drain_requested = old.drain_requested
                worker.standby = worker.standby and old.standby  # a promotion sticks
            if worker.drain_requested:
                worker.state = State.DRAINING
        promoted_at = self._promoted_early.pop(worker.worker_id, None)
        if promoted_at is not None and now - promoted_at <= PROMOTED_EARLY_TTL_S:
            worker.standby = False
        if worker.standby and worker.state is State.READY:
            worker.state = State.STANDBY
        worker.last_heartbeat = now
        self._workers[worker.worker_id] = worker

    def heartbeat(
        self,
        worker_id: str,
        now: float,
        *,
        state: State,
        running: int,
        queued: int,
        queued_prefill_tokens: int,
        kv_blocks_used: int,
        standby: bool | None = None,
    ) -> Worker | None:
        """Record a worker's load. Returns None when the worker is unknown (it must register again).
        ``standby`` False: the worker says it was promoted (through another router): it serves here too;
        a promotion is never taken back (a beat sent before the worker heard of it says True)."""
        w = self._workers.get(worker_id)
        if w is None:
            return None
        if standby is False and w.standby:
            w.standby = False
        w.last_heartbeat = now
        w.running, w.queued = running, queued
        w.queued_prefill_tokens = queued_prefill_tokens
        w.kv_blocks_used = kv_blocks_used
        if state is State.STOPPED:
            del self._workers[worker_id]
            return w
        # A drain the router asked for sticks even if the worker has not seen it yet; a standby worker
        # that is ready waits for its promotion.
        if w.drain_requested:
            w.state = State.DRAINING
        elif w.standby and state is State.READY:
            w.state = State.STANDBY
        else:
            w.state = state
        return w

    def drain(self, worker_id: str) -> bool:
        w = self._workers.get(worker_id)
        if w is None:
            return False
        w.drain_requested = True
        w.state = State.DRAINING
        return True

    def promote(self, worker_id: str, now: float) -> Worker | None:
        """Take a standby worker into routing: READY at once when its last heartbeat said it was
        (else READY on its first heartbeat that does). None when the worker is unknown: then it is
        taken into routing when it registers (a standby still loading), if within
        ``PROMOTED_EARLY_TTL_S``."""
        w = self._workers.get(worker_id)
        if w is None:
            self._promoted_early.pop(worker_id, None)  # (re-inserted last: the newest is dropped last)
            self._promoted_early[worker_id] = now
            while len(self._promoted_early) > _PROMOTED_EARLY:
                self._promoted_early.popitem(last=False)
            return None
        w.standby = False
        if w.state is State.STANDBY:
            w.state = State.READY
        return w

    def remove(self, worker_id: str) -> Worker | None:
        self._drains_of_dropped.pop(worker_id, None)
        return self._workers.pop(worker_id, None)

    mark_dead = remove

    def postpone(self, seconds: float, now: float) -> None:
        """Move every worker's last heartbeat ``seconds`` later (never past ``now``): the router itself
        stood still that long, and heartbeats sent meanwhile may not have been read yet."""
        for w in self._workers.values():
            w.last_heartbeat = min(w.last_heartbeat + seconds, now)

    def expire(self, now: float) -> list[Worker]:
        """Drop workers whose heartbeats stopped; returns them so callers can fail their requests."""
        dead = [w for w in self._workers.values() if now - w.last_heartbeat > self.config.heartbeat_timeout_s]
        for w in dead:
            del self._workers[w.worker_id]
            if w.drain_requested:
                self._drains_of_dropped[w.worker_id] = self._process(w)
        return dead

    def ready(self) -> list[Worker]:
        """The workers routing may use: a STANDBY worker is loaded and heartbeats, but waits for promotion."""
        return [w for w in self._workers.values() if w.state is State.READY]

    def counts(self) -> dict[tuple[Role, State], int]:
        out: dict[tuple[Role, State], int] = {}
        for w in self._workers.values():
            out[(w.role, w.state)] = out.get((w.role, w.state), 0) + 1
        return out
