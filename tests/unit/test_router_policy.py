"""Router registry, routing policy and admission: pure logic, no processes."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router.jobs import Job, Ledger
from pdserve.router.policy import (
    Admission,
    QueueFullError,
    Route,
    RoutingConfig,
    can_ever_serve,
    choose_route,
)
from pdserve.router.registry import Registry, RegistryConfig, State, Worker
from pdserve.worker.role import Role


def mk(
    wid: str,
    role: Role,
    *,
    total: int = 100,
    used: int = 0,
    assigned: int = 0,
    max_running: int = 8,
    queued_tokens: int = 0,
    state: State = State.READY,
) -> Worker:
    w = Worker(
        worker_id=wid,
        role=role,
        address=f"127.0.0.1:{wid}",
        kv_blocks_total=total,
        block_size=16,
        max_running=max_running,
        state=state,
    )
    w.kv_blocks_used, w.assigned, w.queued_prefill_tokens = used, assigned, queued_tokens
    return w


CFG = RoutingConfig(local_prefill_threshold=100)


def test_long_prompt_goes_to_least_loaded_prefill_and_decode():
    ws = [
        mk("d1", Role.DECODE, assigned=3),
        mk("d2", Role.DECODE, assigned=1),
        mk("p1", Role.PREFILL, queued_tokens=500),
        mk("p2", Role.PREFILL, queued_tokens=10),
    ]
    r = choose_route(ws, 1000, CFG)
    assert r is not None and r.prefill is not None
    assert (r.decode.worker_id, r.prefill.worker_id) == ("d2", "p2")


def test_assigned_prefill_tokens_count_before_heartbeats_catch_up():
    p1, p2 = mk("p1", Role.PREFILL), mk("p2", Role.PREFILL)
    p1.assigned_prefill_tokens = 2000
    r = choose_route([mk("d", Role.DECODE), p1, p2], 500, CFG)
    assert r is not None and r.prefill is p2


def test_short_prompt_prefills_locally_on_decode_worker():
    r = choose_route([mk("d", Role.DECODE), mk("p", Role.PREFILL)], 99, CFG)
    assert r is not None and r.prefill is None


def test_colocated_worker_always_local_and_no_prefill_pool_means_local():
    assert choose_route([mk("b", Role.BOTH, total=1000), mk("p", Role.PREFILL)], 5000, CFG).prefill is None
    assert choose_route([mk("d", Role.DECODE, total=1000)], 5000, CFG).prefill is None


def test_no_room_returns_none_and_prefill_only_cluster_cannot_decode():
    assert choose_route([mk("d", Role.DECODE, assigned=8)], 10, CFG) is None
    assert choose_route([mk("d", Role.DECODE, total=10, used=5)], 100, CFG) is None  # 7 blocks needed, 5 free
    assert choose_route([mk("p", Role.PREFILL)], 10, CFG) is None
    assert can_ever_serve([mk("d", Role.DECODE, total=10, used=10)], 100)
    assert not can_ever_serve([mk("d", Role.DECODE, total=4)], 100)


def test_a_one_token_request_goes_to_a_prefill_worker_alone_however_full_the_decode_workers():
    """max_tokens 1: the prefill worker samples the only token. The route names a decode worker (any) that
    gets no call: a full one does not hold it back; a short prompt, or no prefill worker, routes as any."""
    full = mk("d", Role.DECODE, assigned=8)
    p1, p2 = mk("p1", Role.PREFILL, queued_tokens=500), mk("p2", Role.PREFILL)
    r = choose_route([full, p1, p2], 1000, CFG, one_token=True)
    assert r is not None and r.decode_unused and r.prefill is p2 and r.decode is full
    assert choose_route([full, p1], 1000, CFG) is None  # the same request of more tokens waits for room
    assert choose_route([full, p1], 99, CFG, one_token=True) is None  # short: local, on a full worker
    assert choose_route([full], 1000, CFG, one_token=True) is None  # no prefill worker: local
    assert choose_route([p1], 1000, CFG, one_token=True) is None  # no decode worker at all
    # Colocated workers prefill their own prompts, but a one-token request may go to a prefill worker.
    r = choose_route([mk("b", Role.BOTH, total=1000), p1], 5000, CFG, one_token=True)
    assert r is not None and r.decode_unused and r.prefill is p1
    # Nothing of it is counted against the decode worker it names.
    reg = Registry(RegistryConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=2.0))
    d = mk("d2", Role.DECODE)
    reg.register(d, now=0.0)
    ledger, job = Ledger(reg), Job("r", 1000)
    ledger.claim(job, Route(decode=d, prefill=p2, decode_unused=True))
    assert (d.assigned, d.assigned_kv_blocks, p2.assigned_prefill_tokens) == (0, 0, 1000)
    assert not job.uses("d2") and job.uses("p2")
    ledger.release(job)
    assert (d.assigned, d.assigned_kv_blocks, p2.assigned_prefill_tokens) == (0, 0, 0)


def test_registry_heartbeat_expiry_and_drain():
    reg = Registry(RegistryConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=2.0))
    reg.register(mk("a", Role.DECODE, state=State.LOADING), now=0.0)
    reg.register(mk("b", Role.PREFILL, state=State.LOADING), now=0.0)
    assert reg.ready() == []
    kw = dict(running=0, queued=0, queued_prefill_tokens=0, kv_blocks_used=3)
    assert reg.heartbeat("a", 1.0, state=State.READY, **kw).kv_blocks_used == 3
    assert reg.heartbeat("zzz", 1.0, state=State.READY, **kw) is None
    assert [w.worker_id for w in reg.ready()] == ["a"]
    assert [w.worker_id for w in reg.expire(2.5)] == ["b"]  # b never heartbeat after t=0
    assert reg.drain("a") and reg.ready() == []
    # A stale READY heartbeat does not undo a drain the router asked for.
    assert reg.heartbeat("a", 2.6, state=State.READY, **kw).state is State.DRAINING
    reg.heartbeat("a", 2.7, state=State.STOPPED, **kw)
    assert len(reg) == 0
    with pytest.raises(ValueError):
        RegistryConfig(heartbeat_interval_s=1.0, heartbeat_timeout_s=1.0)


def test_a_worker_dropped_while_draining_comes_back_draining():
    """A draining worker that stood still past the timeout (SIGSTOP) is dropped; when the same process
    comes back (same id, address and pid) it registers straight into its drain instead of taking requests
    again. Another process with that id (another pid or address) starts afresh, and the memory of the
    drain goes with it; a postponed deadline keeps a worker whose silence was the router's."""

    def worker(wid: str, pid: int, address: str = "127.0.0.1:1") -> Worker:
        w = mk(wid, Role.DECODE, state=State.READY)
        w.pid, w.address = pid, address
        return w

    reg = Registry(RegistryConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=2.0))
    reg.register(worker("a", 10), now=0.0)
    reg.register(worker("b", 11), now=0.0)
    assert reg.drain("a")
    assert {w.worker_id for w in reg.expire(3.0)} == {"a", "b"}
    reg.register(worker("b", 11), now=4.0)  # never asked to drain
    reg.register(worker("a", 10), now=4.0)
    assert reg.get("a").drain_requested and reg.get("a").state is State.DRAINING
    assert [w.worker_id for w in reg.ready()] == ["b"]
    assert reg.expire(7.0) and len(reg) == 0
    reg.register(worker("a", 12), now=8.0)  # a restarted process: same id and address, another pid
    assert not reg.get("a").drain_requested
    reg.remove("a")
    reg.register(worker("a", 10), now=8.5)  # the drain was forgotten with the restart
    assert not reg.get("a").drain_requested
    reg.postpone(5.0, now=12.0)  # the router stood still 5 s: last heartbeat 8.5 -> 12 (not past now)
    assert reg.get("a").last_heartbeat == 12.0 and reg.expire(13.0) == []


def test_a_restarted_container_is_not_the_process_asked_to_drain():
    """In a restarted container the address (pod IP) and pid (1) repeat: the registered instance (random per
    process) tells the processes apart. A drain asked of one process is not the next one's, whether the
    old entry was dropped or is still there (a crash and a restart within the heartbeat timeout)."""

    def worker(instance: str) -> Worker:
        w = mk("a", Role.DECODE, state=State.READY)
        w.pid, w.address, w.instance = 1, "10.0.0.7:50052", instance
        return w

    reg = Registry(RegistryConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=2.0))
    reg.register(worker("one"), now=0.0)
    assert reg.drain("a")
    reg.register(worker("one"), now=0.5)  # the same process again (a router restart): still draining
    assert reg.get("a").state is State.DRAINING
    reg.register(worker("two"), now=1.0)  # crashed and restarted before its entry expired
    assert not reg.get("a").drain_requested and reg.get("a").state is State.READY
    assert reg.drain("a") and reg.expire(4.0)
    reg.register(worker("three"), now=5.0)  # dropped while draining, then a restart
    assert not reg.get("a").drain_requested
    assert reg.drain("a") and reg.expire(8.0)
    reg.register(worker("three"), now=9.0)  # dropped while draining, the same process back
    assert reg.get("a").state is State.DRAINING


def test_a_burst_between_heartbeats_counts_the_blocks_it_already_sent():
    """Exploratory testing: three 591-token prompts at once on a decode worker with 80 blocks; the
    router saw 80 free (the last heartbeat) for each and sent all three, and the worker refused the third
    (RESOURCE_EXHAUSTED). The router now counts the blocks of what it dispatched: the third waits."""
    from pdserve.router.jobs import Job, Ledger

    reg = Registry(RegistryConfig())
    d = mk("d", Role.DECODE, total=80)
    reg.register(d, now=0.0)
    ledger = Ledger(reg)
    jobs = [Job(f"r{i}", 591) for i in range(3)]
    for job in jobs[:2]:
        route = choose_route(reg.ready(), 591, CFG)
        assert route is not None and route.decode is reg.get("d")
        ledger.claim(job, route)
    assert reg.get("d").assigned_kv_blocks == 2 * 37 and reg.get("d").kv_blocks_free == 6
    assert choose_route(reg.ready(), 591, CFG) is None  # waits for room: no refusal from the worker
    reg.heartbeat(
        "d", 1.0, state=State.READY, running=2, queued=0, queued_prefill_tokens=0, kv_blocks_used=76
    )
    assert reg.get("d").kv_blocks_free == 4  # the heartbeat, once it says more is used (tokens generated)
    ledger.release(jobs[0])
    reg.heartbeat(
        "d", 2.0, state=State.READY, running=1, queued=0, queued_prefill_tokens=0, kv_blocks_used=38
    )
    route = choose_route(reg.ready(), 591, CFG)
    assert route is not None
    ledger.claim(jobs[2], route)
    for job in jobs[1:]:
        ledger.release(job)
    assert reg.get("d").assigned_kv_blocks == 0


def test_running_streams_growth_counts_between_heartbeats():
    """The router's free-block estimate counted each request's prompt only: streams that grew since the
    last heartbeat looked like room, and the worker refused the reservation (``decode_full``, the prompt's
    prefill redone elsewhere). Streamed tokens now grow the count; release returns all of it."""
    from pdserve.router.jobs import Job, Ledger

    reg = Registry(RegistryConfig())
    reg.register(mk("d", Role.DECODE, total=20), now=0.0)
    ledger = Ledger(reg)
    job = Job("r", 31)
    ledger.claim(job, choose_route(reg.ready(), 31, CFG))
    assert reg.get("d").assigned_kv_blocks == 2  # 31 + 1 tokens
    ledger.grow(job, 32)  # prompt + the first output, and the next token's slot: 33 -> 3 blocks
    assert reg.get("d").assigned_kv_blocks == 3
    ledger.grow(job, 31 + 100)
    assert reg.get("d").assigned_kv_blocks == 9 and reg.get("d").kv_blocks_free == 11
    ledger.grow(job, 40)  # never shrinks (a late, smaller count)
    assert reg.get("d").assigned_kv_blocks == 9
    assert choose_route(reg.ready(), 31 * 6, CFG) is None  # 12 blocks: no room by the grown count
    ledger.release(job)
    ledger.grow(job, 500)  # a released job counts nothing
    assert reg.get("d").assigned_kv_blocks == 0


@pytest.mark.timeout(120)  # the bug this guards against hung the loop: fail, not hang
def test_waiters_cancelled_as_their_wait_times_out_leave_the_queue_usable():
    """Exploratory testing: a client's deadline equal to the queue wait cancels a waiting request as its
    wait times out. With ``asyncio.wait_for`` the inner task took the condition's lock back after the
    waiter had left it ("Lock is not acquired"), and every later notify (each finish, each heartbeat)
    blocked forever: the router hung. Cancels at and around the timeout, with and without yields."""
    import random

    async def one_round(seed: int) -> None:
        rng = random.Random(seed)
        adm = Admission(max_waiting=100)
        waiters = [asyncio.create_task(adm.wait_for_route(lambda: None, 0.02)) for _ in range(6)]

        async def notifier() -> None:
            for _ in range(5):
                await asyncio.sleep(rng.uniform(0, 0.01))
                await adm.notify()

        notifying = asyncio.create_task(notifier())
        await asyncio.sleep(0.02 + rng.uniform(-0.003, 0.003))
        for t in waiters:
            t.cancel()
            if rng.random() < 0.5:
                await asyncio.sleep(0)
            if rng.random() < 0.3:
                t.cancel()
        done, pending = await asyncio.wait(waiters, timeout=2)
        assert not pending and not adm._changed.locked(), seed
        for t in done:
            assert t.cancelled() or t.result() is None, (seed, t)
        await asyncio.wait_for(adm.notify(), 1)  # the queue still works
        await notifying
        assert adm.waiting == 0

    async def main() -> None:
        for seed in range(1, 9):
            await one_round(seed)

    asyncio.run(main())


def test_admission_queue_bound_and_wakeup():
    async def main():
        adm = Admission(max_waiting=1)
        room = {"free": False}
        w = mk("d", Role.DECODE)

        def try_route():
            return choose_route([w], 10, CFG) if room["free"] else None

        waiter = asyncio.create_task(adm.wait_for_route(try_route, timeout_s=5))
        await asyncio.sleep(0.01)
        assert adm.waiting == 1
        with pytest.raises(QueueFullError):
            await adm.wait_for_route(try_route, timeout_s=5)
        room["free"] = True
        await adm.notify()
        r = await asyncio.wait_for(waiter, 2)
        assert r is not None and r.decode is w and adm.waiting == 0
        room["free"] = False
        assert await adm.wait_for_route(try_route, timeout_s=0.05) is None
        assert adm.waiting == 0

    asyncio.run(main())
