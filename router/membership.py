"""The router's cluster membership: which workers it knows (their registrations), and what happens when
one dies, misses heartbeats or refuses for room."""

from __future__ import annotations

import asyncio
import logging
import time

from pdserve.proto import worker_pb2
from pdserve.router.channels import WorkerChannels
from pdserve.router.jobs import Failure, Ledger
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policy import Admission
from pdserve.router.registry import Registry, State, Worker
from pdserve.worker.role import Role

log = logging.getLogger(__name__)


class Membership:
    """The worker set (``registry``, ``infos``) and its upkeep: a dead worker's requests move at once, a
    silent one expires at the sweep, a warm standby covers a role left with none serving."""

    def __init__(
        self,
        registry: Registry,
        ledger: Ledger,
        admission: Admission,
        channels: WorkerChannels,
        metrics: RouterMetrics,
        heartbeat_interval_s: float,
    ) -> None:
        self.registry = registry
        self.infos: dict[str, worker_pb2.WorkerInfo] = {}  # the registration of every known worker
        self._ledger = ledger
        self._admission = admission
        self._channels = channels
        self._metrics = metrics
        self._heartbeat_interval_s = heartbeat_interval_s
        self._wakeups: set[asyncio.Task[None]] = set()  # admission wake-ups sent from sync code

    def worker_full(self, w: Worker) -> None:
        """``w`` refused a reservation its last heartbeat had room for: route nothing more to it until a
        heartbeat it sends after the refusal can have arrived (two intervals)."""
        current = self.registry.get(w.worker_id)
        if current is not None and current.address == w.address:
            current.refused_for_room(2 * self._heartbeat_interval_s)

    def worker_failed(self, w: Worker, dead: bool, reason: str) -> None:
        """A call to ``w`` failed with UNAVAILABLE: it died (stop routing to it, and move every other
        request that still needs it now, not at its heartbeat timeout) or is draining."""
        current = self.registry.get(w.worker_id)
        if current is None or current.address != w.address:
            return  # already removed, or re-registered elsewhere
        if dead:
            log.warning("worker %s marked dead: %s", w.worker_id, reason)
            self.registry.mark_dead(w.worker_id)
            self.infos.pop(w.worker_id, None)
            if self.cover_with_standby(w.role) is not None:  # before its requests move: they may move there
                # Requests waiting for room may route to it now, not at the next heartbeat.
                task = asyncio.get_running_loop().create_task(self._admission.notify())
                self._wakeups.add(task)
                task.add_done_callback(self._wakeups.discard)
            lost = "decode_failed" if w.role.decodes else "prefill_failed"
            self.fail_jobs_on(w.worker_id, f"worker {w.worker_id} died: {reason}", lost)
        else:
            current.state = State.DRAINING

    def cover_with_standby(self, role: Role) -> Worker | None:
        """A worker of ``role`` died: if none of that role is left serving, promote one of its warm
        standby workers now (the one whose heartbeat said it is loaded), rather than refuse requests until
        the autoscaler's next tick. Returns the promoted worker; the autoscaler sees the promotion in
        ``ClusterStatus`` and starts a replacement standby."""
        if any(w.role is role for w in self.registry.ready()):
            return None
        standby = [w for w in self.registry if w.role is role and w.state is State.STANDBY]
        if not standby:
            return None
        w = self.registry.promote(standby[0].worker_id, time.monotonic())
        if w is None:
            return None
        if w.worker_id in self.infos:
            self.infos[w.worker_id].standby = False
        log.warning("no %s worker left serving: standby worker %s promoted", role.value, w.worker_id)
        return w

    def fail_jobs_on(self, worker_id: str, reason: str, migrate: str = "") -> None:
        """Fail every request that still needs ``worker_id`` (``migrate``: why, for the relay's move)."""
        for job in self._ledger:
            if job.uses(worker_id):
                job.fail(Failure("UNAVAILABLE", reason, worker_id, migrate))

    async def sweep(self, now: float) -> list[Worker]:
        """Drop workers that missed heartbeats, fail their requests, close unused channels."""
        dead = self.registry.expire(now)
        for w in dead:
            log.warning("worker %s (%s) missed heartbeats; removed", w.worker_id, w.address)
            self.infos.pop(w.worker_id, None)
        if [role for role in {w.role for w in dead} if self.cover_with_standby(role)]:
            await self._admission.notify()
        for w in dead:
            self.fail_jobs_on(w.worker_id, f"worker {w.worker_id} missed heartbeats")
        keep = {w.address for w in self.registry}
        for job in self._ledger:
            if job.route is not None:
                keep.add(job.route.decode.address)
                if job.route.prefill is not None:
                    keep.add(job.route.prefill.address)
        await self._channels.close_except(keep)
        return dead

    async def sweep_forever(self) -> None:
        interval = self._heartbeat_interval_s
        woke = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            stood_still, woke = now - woke - interval, now
            try:
                await self._sweep_tick(now, stood_still, interval)
            except Exception:  # noqa: BLE001 - the sweep must outlive a bad tick (it expires dead workers)
                log.exception("the heartbeat sweep failed; it runs again in %.3g s", interval)
            woke = time.monotonic()  # (the sweep's own time is not a stall)

    async def _sweep_tick(self, now: float, stood_still: float, interval: float) -> None:
        """One sweep (``sweep_forever``): first, a stall of this loop moves the workers' deadlines."""
        if stood_still > interval:
            # This loop could not run (a call holding the GIL, the host swapping, SIGSTOP): the
            # heartbeats sent meanwhile may still wait unread, so the silence is the router's own,
            # not the workers'. Their deadlines move by as much; a dead worker still expires, one
            # timeout after the router runs again.
            log.warning(
                "the router's event loop stood still for %.1f s: heartbeat deadlines moved by as much",
                stood_still,
            )
            self._metrics.loop_stalls.inc()
            self.registry.postpone(stood_still, now)
        await self.sweep(now)

    def counts_by_role(self) -> dict[Role, int]:
        out: dict[Role, int] = {}
        for w in self.registry:
            out[w.role] = out.get(w.role, 0) + 1
        return out
