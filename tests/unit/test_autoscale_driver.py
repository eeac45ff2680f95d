"""The local autoscaler's driver (deploy/local/autoscaler.py) against a scripted cluster: no processes.

The driver changes the cluster only through its ``ClusterControl``; here that is ``FakeControl``, a state
held in memory and a router's answer written by the test.

What the driver reports must follow its own decisions: the target it shows (the status file that
`pdserve status` prints, and pdserve_autoscaler_target_workers) is the new size from the tick that decided
it, not the old one until the pool settles; and one bad tick does not end the autoscaler.
"""

from __future__ import annotations

import http.client
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import msgspec
from prometheus_client import CollectorRegistry

from pdserve.deploy.local import autoscaler as mod
from pdserve.deploy.local import cluster
from pdserve.deploy.local.autoscaler_signals import LatencyWindow
from pdserve.proto import worker_pb2
from pdserve.router.autoscale import AutoscaleConfig, Pool, PoolBounds
from pdserve.worker.role import Role

READY = worker_pb2.WORKER_STATE_READY


def _entry(wid: str, role: Role, standby: bool = False) -> cluster.ProcessEntry:
    return cluster.ProcessEntry(id=wid, pid=1, start=0, log="", role=role, standby=standby)


class FakeControl:
    """The cluster the driver sees (a ``ClusterControl``): its state file, kept here, and the router's
    answer (every registered worker READY, or STANDBY until promoted, and as busy as ``running``). Every
    process runs until the test ends it (``exited``) or the driver cuts its drain."""

    def __init__(self) -> None:
        self.state = cluster.ClusterState(
            router_address="127.0.0.1:1",
            router=_entry("router", Role.BOTH),
            model="m",
            dtype="float32",
            threads=1,
            host="127.0.0.1",
            next_index=3,
            workers=(_entry("prefill-1", Role.PREFILL), _entry("decode-2", Role.DECODE)),
        )
        self.registered = {"prefill-1", "decode-2"}
        self.promoted: set[str] = set()  # standby workers the router promoted (on its own or asked)
        self.running = 8
        self.exited: set[str] = set()
        self.drained: list[str] = []
        self.cut_ids: list[str] = []

    def load(self) -> cluster.ClusterState:
        return self.state

    def save(self, state: cluster.ClusterState) -> None:
        self.state = state

    def alive(self, worker: cluster.ProcessEntry) -> bool:
        return worker.id not in self.exited

    def status(self, state: cluster.ClusterState) -> worker_pb2.ClusterStatus:
        out = worker_pb2.ClusterStatus()
        for w in state.workers:
            if w.id not in self.registered:
                continue  # started, not registered yet
            e = out.workers.add()
            e.info.worker_id, e.info.max_running = w.id, 8
            e.info.standby = w.standby and w.id not in self.promoted
            e.load.state = worker_pb2.WORKER_STATE_STANDBY if e.info.standby else READY
            e.load.kv_blocks_total = 100
            e.load.running = self.running if w.role is Role.DECODE else 0
        return out

    def start(
        self, state: cluster.ClusterState, role: Role, count: int, *, standby: bool = False
    ) -> cluster.ClusterState:
        new = tuple(_entry(f"{role.value}-{state.next_index + i}", role, standby) for i in range(count))
        return msgspec.structs.replace(
            state, workers=state.workers + new, next_index=state.next_index + count
        )

    def promote(self, state: cluster.ClusterState, worker_id: str) -> worker_pb2.PromoteWorkerResponse:
        found = worker_id in self.registered
        if found:
            self.promoted.add(worker_id)
        return worker_pb2.PromoteWorkerResponse(found=found, serving=found)

    def drain(self, state: cluster.ClusterState, worker_id: str) -> bool:
        self.drained.append(worker_id)
        return worker_id in self.registered

    def cut(self, workers: Sequence[cluster.ProcessEntry]) -> None:
        self.cut_ids += [w.id for w in workers]
        self.exited.update(w.id for w in workers)


def _driver(tmp_path: Path, world: FakeControl) -> tuple[mod.Driver, CollectorRegistry]:
    policy = AutoscaleConfig(
        decode=PoolBounds(1, 2), up_after=1, up_cooldown_s=0.0, down_after=100, running_high=0.8
    )
    reg = CollectorRegistry()
    return mod.Driver(mod.DriverConfig(tmp_path, policy), mod.Metrics(reg), world), reg


def test_the_target_reported_is_the_decided_one_from_the_deciding_tick(tmp_path) -> None:
    world = FakeControl()
    driver, reg = _driver(tmp_path, world)
    decisions = driver.tick(0.0)
    assert [(d.pool, d.target) for d in decisions] == [(Pool.DECODE, 2)]
    target = reg.get_sample_value("pdserve_autoscaler_target_workers", {"pool": "decode"})
    assert target == 2  # was 1 (the old size) until the new worker served
    shown = mod.load_status(tmp_path)
    assert shown is not None and (shown.pools["decode"].target, shown.pools["decode"].starting) == (2, 1)
    world.running = 0  # the new worker registers; the load is gone
    world.registered.add("decode-3")
    driver.tick(1.0)
    assert reg.get_sample_value("pdserve_autoscaler_target_workers", {"pool": "decode"}) == 2


def test_a_router_metrics_body_cut_short_is_no_sample_not_a_crash(monkeypatch) -> None:
    def cut(*_a, **_k):  # type: ignore[no-untyped-def]
        raise http.client.IncompleteRead(b"# HELP pdserve_time", 100)

    monkeypatch.setattr(urllib.request, "urlopen", cut)
    assert LatencyWindow(0.9).read("http://127.0.0.1:1/metrics") == {}


def test_a_standby_the_router_promoted_is_adopted_and_replaced(tmp_path) -> None:
    """The router promotes a standby worker itself when its pool's last serving worker dies
    (``Membership.cover_with_standby``): the driver records it as serving and starts a new standby."""
    world = FakeControl()
    world.running = 0
    warm = _entry("decode-3", Role.DECODE, standby=True)
    world.state = msgspec.structs.replace(world.state, workers=(*world.state.workers, warm), next_index=4)
    world.registered.add("decode-3")
    policy = AutoscaleConfig(decode=PoolBounds(1, 2, warm=1), down_after=100)
    driver = mod.Driver(mod.DriverConfig(tmp_path, policy), mod.Metrics(CollectorRegistry()), world)
    driver.tick(0.0)
    assert [w.id for w in world.state.workers if w.standby] == ["decode-3"]  # warm pool full
    world.state = msgspec.structs.replace(
        world.state, workers=tuple(w for w in world.state.workers if w.id != "decode-2")
    )  # the serving decode worker died; the router promoted decode-3
    world.registered.discard("decode-2")
    world.promoted.add("decode-3")
    driver.tick(1.0)
    by_id = {w.id: w for w in world.state.workers}
    assert not by_id["decode-3"].standby
    assert [w.id for w in world.state.workers if w.standby and w.role is Role.DECODE] == ["decode-4"]


def test_a_scale_down_drains_through_the_router_and_a_drain_past_its_time_is_cut(tmp_path) -> None:
    """DOWN drains the least loaded, newest serving worker through the router (it is not signalled); one
    still there after ``drain_timeout_s`` is cut and forgotten."""
    world = FakeControl()
    world.running = 0
    world.state = msgspec.structs.replace(
        world.state, workers=(*world.state.workers, _entry("decode-3", Role.DECODE)), next_index=4
    )
    world.registered.add("decode-3")
    policy = AutoscaleConfig(decode=PoolBounds(1, 2), down_after=1, down_cooldown_s=0.0)
    config = mod.DriverConfig(tmp_path, policy, drain_timeout_s=5.0)
    driver = mod.Driver(config, mod.Metrics(CollectorRegistry()), world)
    decisions = driver.tick(0.0)
    assert [(d.pool, d.target) for d in decisions] == [(Pool.DECODE, 1)]
    assert world.drained == ["decode-3"] and world.cut_ids == []
    shown = mod.load_status(tmp_path)
    assert shown is not None and shown.pools["decode"].draining == ("decode-3",)
    driver.tick(10.0)
    assert world.cut_ids == ["decode-3"]
    assert [w.id for w in world.state.workers] == ["prefill-1", "decode-2"]
