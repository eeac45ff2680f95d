"""Several routers: the worker's ``--router`` list and its lookup, the prefix-cache events every router
gets, a worker joining two in-process routers (promotion, drain and a router's shutdown reaching it through
either), request ids that cannot collide across routers, the client's round-robin target, and the
launcher asking whichever router still runs."""

from __future__ import annotations

import asyncio
import json

import grpc
import msgspec
import pytest

from pdserve.engine.prefix_hash import RemovedBlock, StoredBlock
from pdserve.proto import worker_pb2
from pdserve.router.registry import Registry, RegistryConfig, State, Worker
from pdserve.worker.args import WorkerArgs
from pdserve.worker.dial import SERVICE_CONFIG, router_target
from pdserve.worker.role import Role
from pdserve.worker.router_set import EventFanout, resolve_routers, split_routers
from tests.e2e.cluster_harness import fake_state
from tests.fake_workers import FakeWorker, ids
from tests.unit.test_router_server import cluster, model_dir, request, run, until  # noqa: F401


def test_the_router_list_is_checked_naming_the_entry():
    assert split_routers(" a:1, b:2 ,") == ["a:1", "b:2"]
    for bad in ("", " , ", "a", "a:", ":1", "a:0", "a:70000", "a:x"):
        with pytest.raises(ValueError, match="router"):
            split_routers(bad)
    with pytest.raises(ValueError, match="'nohost' is not host:port"):
        WorkerArgs(role=Role.DECODE, router="127.0.0.1:1,nohost", worker_id="w")


def test_a_name_is_one_router_per_address_but_localhost_is_one():
    assert resolve_routers("localhost:7") == {"localhost:7": "localhost"}  # (not ::1 and 127.0.0.1)
    assert resolve_routers("127.0.0.1:7,127.0.0.2:8") == {
        "127.0.0.1:7": "127.0.0.1",
        "127.0.0.2:8": "127.0.0.2",
    }
    # A name that does not resolve (yet) stays: its agent retries it.
    assert resolve_routers("no-such-router.invalid:9") == {
        "no-such-router.invalid:9": "no-such-router.invalid"
    }


def test_a_name_with_several_addresses_is_a_router_each(monkeypatch):
    import socket

    def getaddrinfo(host, port, type=0):  # noqa: A002 - (socket's own name)
        assert host == "routers.ns.svc"
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.2", port)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.1", port)),
            (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::1", port, 0, 0)),
        ]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    assert resolve_routers("routers.ns.svc:50051") == {
        "10.0.0.1:50051": "routers.ns.svc",
        "10.0.0.2:50051": "routers.ns.svc",
    }


class _Source:
    def __init__(self) -> None:
        self.events: list = []
        self.overflowed = False

    def drain_events(self):
        out, over = self.events, self.overflowed
        self.events, self.overflowed = [], False
        return out, over

    def has_events(self) -> bool:
        return bool(self.events)

    def cached_hashes(self):
        return [(b"h1", None)]


def test_every_router_gets_every_prefix_cache_event_whichever_reads_first():
    src = _Source()
    fan = EventFanout(src, limit=3)
    a, b = fan.view(), fan.view()
    src.events = [StoredBlock(b"h1", None)]
    assert a.has_events() and b.has_events()
    assert a.drain_events() == ([StoredBlock(b"h1", None)], False)
    assert b.has_events()  # a read them from the block manager; b still has them
    src.events = [RemovedBlock(b"h1")]
    assert b.drain_events() == ([StoredBlock(b"h1", None), RemovedBlock(b"h1")], False)
    assert a.drain_events() == ([RemovedBlock(b"h1")], False)
    # A router that stops reading (gone) costs a bounded buffer: past the limit it gets a snapshot.
    src.events = [StoredBlock(bytes([i]), None) for i in range(3)]
    assert len(a.drain_events()[0]) == 3
    src.events = [StoredBlock(bytes([i]), None) for i in range(3, 5)]
    assert len(a.drain_events()[0]) == 2 and b.drain_events() == ([], True)
    fan.close(b)
    src.events = [RemovedBlock(b"x")]
    assert a.drain_events() == ([RemovedBlock(b"x")], False) and not b._events


def test_a_client_dials_every_router_round_robin_and_retries_unavailable():
    assert router_target("127.0.0.1:5")[0] == "127.0.0.1:5"
    assert router_target("routers.ns.svc:5")[0] == "dns:///routers.ns.svc:5"  # gRPC resolves, again
    target, options = router_target("localhost:5,127.0.0.2:6")
    assert target == "ipv4:127.0.0.1:5,127.0.0.2:6"
    config = json.loads(dict(options)["grpc.service_config"])
    assert config == SERVICE_CONFIG and config["loadBalancingConfig"] == [{"round_robin": {}}]
    assert config["methodConfig"][0]["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]
    assert dict(options)["grpc.ssl_target_name_override"] == "localhost"


def test_a_promotion_sticks_and_a_workers_own_word_promotes_it_everywhere():
    reg = Registry(RegistryConfig())
    w = Worker("d", Role.DECODE, "x:1", 8, 16, 4, standby=True, state=State.READY)
    reg.register(w, 0.0)
    beat = dict(running=0, queued=0, queued_prefill_tokens=0, kv_blocks_used=0)
    assert reg.heartbeat("d", 0.1, state=State.READY, standby=True, **beat).state is State.STANDBY
    # Promoted through another router: the worker says so, and this router routes to it.
    assert reg.heartbeat("d", 0.2, state=State.READY, standby=False, **beat).state is State.READY
    # A beat sent before the worker heard of its promotion does not take it back.
    assert reg.heartbeat("d", 0.3, state=State.READY, standby=True, **beat).state is State.READY


def test_a_worker_joins_two_routers_and_either_reaches_it(model_dir):  # noqa: F811
    """Both registries list the worker; a promotion through one and a drain through the other reach it,
    and so the other router; the same client request id through both routers reaches the worker as two
    requests; a router that shuts down is dropped by the worker, which stays known to the other."""

    async def main():
        w = FakeWorker("b1", Role.BOTH, ids("hello world"))
        async with cluster(model_dir, []) as (one, stub_one), cluster(model_dir, []) as (two, stub_two):
            drains: list[int] = []
            await w.start(f"{one.address},{two.address}", retry_interval_s=0.05)
            routers = w.agent
            routers._on_drain = lambda: drains.append(1)
            for agent in routers.agents.values():
                agent._on_drain = routers._on_drain
            reg_one, reg_two = one.router.registry, two.router.registry
            await until(lambda: reg_one.get("b1") and reg_two.get("b1"), what="both registrations")
            await until(lambda: reg_one.get("b1").state is State.READY, what="ready at one")
            await until(lambda: reg_two.get("b1").state is State.READY, what="ready at two")

            # The same request id through both routers: two requests on the worker, both served.
            same = request()
            same.request_id = "same"
            a, b = stub_one.Generate(same), stub_two.Generate(same)
            got = [[m async for m in a], [m async for m in b]]
            assert all("".join(m.text for m in msgs).strip() == "hello world" for msgs in got)
            assert len({r.request_id for r in w.requests}) == 2 and all(
                r.request_id.startswith("same@") for r in w.requests
            )

            # Standby: promoted through router one, router two routes to it too (the worker tells it).
            w.agent.info.standby = True
            for reg in (reg_one, reg_two):
                reg.get("b1").standby = True
                reg.get("b1").state = State.STANDBY
            reg_one.promote("b1", 0.0)
            await until(lambda: reg_two.get("b1").state is State.READY, what="the promotion at two")
            assert not w.agent.info.standby

            # A drain through router two: the worker drains (its state then reaches router one).
            reg_two.drain("b1")
            await until(lambda: drains, what="the worker's drain")

            # Router one shuts down: the worker stops counting on it; router two still knows it.
            one.router.closing = True
            await until(lambda: routers.known_by() == [two.address], what="router one dropped")
            assert routers.agents[one.address].leaving
        await w.stop()

    run(main())


def test_the_launcher_asks_a_router_that_runs(monkeypatch, tmp_path):
    from pdserve.deploy.local import cluster as local
    from pdserve.deploy.local.cluster import control, processes, rpc

    first = local.ProcessEntry(id="router", pid=1, start=1, log="r.log")
    second = local.ProcessEntry(id="router-1", pid=2, start=2, log="r1.log")
    state = msgspec.structs.replace(
        fake_state(first), more_routers=(second,), more_router_addresses=("127.0.0.1:2",)
    )
    assert state.router_list == "127.0.0.1:1,127.0.0.1:2"
    monkeypatch.setattr(processes, "alive", lambda p: p.id != "router")  # the first router died
    asked: list[str] = []
    monkeypatch.setattr(rpc, "cluster_status", lambda address, **_: asked.append(address) or "status")
    monkeypatch.setattr(rpc, "drain_worker", lambda address, *_: asked.append(address) or True)
    monkeypatch.setattr(rpc, "promote_worker", lambda address, *_: asked.append(address) or "promoted")
    ctl = control.LocalControl(tmp_path)  # (the autoscaler's hands)
    assert ctl.status(state) == "status" and ctl.drain(state, "decode-1")
    assert ctl.promote(state, "decode-2") == "promoted"
    assert asked == ["127.0.0.1:2"] * 3
    monkeypatch.setattr(processes, "alive", lambda p: False)
    with pytest.raises(local.ClusterError, match="every router of the cluster"):
        ctl.status(state)


def test_a_decode_worker_refuses_past_its_running_limit_plus_queue():
    from prometheus_client import CollectorRegistry

    from pdserve.decode_pool.metrics import DecodeMetrics
    from pdserve.decode_pool.servicer import DecodeServicer

    class _Context:
        def invocation_metadata(self):
            return ()

        async def abort(self, code, details, trailing_metadata=()):
            raise grpc.aio.AbortError(f"{code.name}: {details}")

    servicer = DecodeServicer(None, None, DecodeMetrics(CollectorRegistry()), admit_limit=2)  # type: ignore[arg-type]
    servicer.loop = object()  # type: ignore[assignment]
    servicer.admitted = 2

    async def call():
        return [
            m async for m in servicer.Generate(worker_pb2.WorkerGenerateRequest(request_id="r"), _Context())
        ]

    with pytest.raises(
        grpc.aio.AbortError, match="RESOURCE_EXHAUSTED: decode worker has no room: 2 requests"
    ):
        asyncio.run(call())
    assert servicer.admitted == 2 and servicer.metrics.refused_full._value.get() == 1
