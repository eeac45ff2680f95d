"""The router's move watch (``router.moves.MoveWatch``): which of this router's streams it asks to move
live, for a drain and to even the decode batches (hysteresis and rate limit). Pure logic."""

from __future__ import annotations

import pytest

from pdserve.router.jobs import Job, Ledger
from pdserve.router.moves import MoveCause, MoveWatch, RebalanceConfig
from pdserve.router.policy import Route
from pdserve.router.registry import Registry, RegistryConfig, State
from pdserve.worker.role import Role
from tests.unit.test_router_policy import mk


def _cluster(*workers: str) -> tuple[Registry, Ledger]:
    reg = Registry(RegistryConfig())
    for wid in workers:
        reg.register(mk(wid, Role.DECODE, total=10_000, max_running=64), now=0.0)
    return reg, Ledger(reg)


def _streams(reg: Registry, ledger: Ledger, wid: str, n: int, prompt: int = 100) -> list[Job]:
    jobs = []
    for i in range(n):
        job = Job(f"{wid}-{i}-{prompt}", prompt + 50 * i)  # (contexts of distinct sizes)
        ledger.claim(job, Route(decode=reg.get(wid), prefill=None))
        jobs.append(job)
    return jobs


def _asked(ledger: Ledger) -> dict[str, str]:
    return {j.request_id: j.move for j in ledger if j.move}


def test_every_stream_on_a_draining_worker_is_asked_once():
    reg, ledger = _cluster("a", "b")
    on_a, on_b = _streams(reg, ledger, "a", 3), _streams(reg, ledger, "b", 2)
    watch = MoveWatch(reg, ledger, RebalanceConfig(enabled=False))
    watch.tick(now=1.0)
    assert _asked(ledger) == {}
    reg.drain("a")
    watch.tick(now=2.0)
    assert _asked(ledger) == {j.request_id: MoveCause.DRAIN for j in on_a}
    woken = []
    on_a[0].move, on_a[0].wake = "", lambda: woken.append(1)
    on_a[0].move_after = 5.0e18  # (a move that could not start now is not asked again before this)
    watch.tick(now=3.0)
    assert not on_a[0].move and not woken and all(not j.move for j in on_b)


def test_rebalance_starts_far_from_the_mean_and_stops_within_the_lower_ratio():
    """12 streams on one worker, none on the other: the smallest context moves first, one per tick the
    rate allows, until the busiest is within 1.2x the mean (a stream asked is no longer counted as
    staying: the relay moves it); then nothing more, though 1.5x would not start it again."""
    reg, ledger = _cluster("a", "b")
    jobs = _streams(reg, ledger, "a", 12)
    watch = MoveWatch(reg, ledger, RebalanceConfig(moves_per_s=4.0, settle_s=0.0))
    watch.tick(now=10.0)
    (first,) = [j for j in jobs if j.move]
    assert first is min(jobs, key=lambda j: j.kv_blocks) and first.move == MoveCause.REBALANCE
    watch.tick(now=10.1)  # within the rate limit: nothing more
    assert len(_asked(ledger)) == 1
    t, moved = 10.0, [first]
    while True:
        # The relay moves what was asked: it runs on b from now.
        for j in moved:
            ledger.move(j, Route(decode=reg.get("b"), prefill=None), j.prompt_len)
            j.move = ""
        t += 0.25
        watch.tick(now=t)
        moved = [j for j in jobs if j.move]
        if not moved:
            break
    on = {w: sum(1 for j in jobs if j.route.decode.worker_id == w) for w in ("a", "b")}
    assert on["a"] <= 1.2 * 6 and on["a"] - on["b"] <= 2, on  # 7 and 5: within the stop ratio
    assert t - 10.0 == pytest.approx(0.25 * 5)  # 5 moves, one per tick of the rate limit


def test_a_small_imbalance_or_a_lone_worker_moves_nothing():
    reg, ledger = _cluster("a", "b")
    _streams(reg, ledger, "a", 5)
    _streams(reg, ledger, "b", 2)  # 5 vs a mean of 3.5: under 1.5x
    watch = MoveWatch(reg, ledger)
    watch.tick(now=1.0)
    assert _asked(ledger) == {}
    reg2, ledger2 = _cluster("solo")
    _streams(reg2, ledger2, "solo", 20)
    MoveWatch(reg2, ledger2).tick(now=1.0)
    assert _asked(ledger2) == {}
    reg.get("b").state = State.STANDBY
    watch.tick(now=2.0)  # b takes no streams now: a alone is no imbalance
    assert _asked(ledger) == {}


def test_rebalance_config_checks_its_ratios():
    with pytest.raises(ValueError):
        RebalanceConfig(start_ratio=1.2, stop_ratio=1.5)
    with pytest.raises(ValueError):
        RebalanceConfig(moves_per_s=0)


def test_streams_being_moved_count_as_gone_and_a_moved_stream_settles():
    """Asked streams still on the busy worker (their moves take a while) count as on the least busy one,
    so the watch does not overshoot; a stream moved lately is not moved again to even the batches."""
    reg, ledger = _cluster("a", "b")
    jobs = _streams(reg, ledger, "a", 12)
    watch = MoveWatch(reg, ledger, RebalanceConfig(moves_per_s=4.0, settle_s=10.0))
    t = 100.0
    for _ in range(20):  # nothing moves meanwhile: the asks stop once a is even with what is under way
        watch.tick(now=t)
        t += 0.25
    assert len(_asked(ledger)) == 5, _asked(ledger)  # 7 stay, 5 under way: within 1.2x the mean of 6
    for j in jobs:
        j.move, j.moved_at = "", t  # every one just moved (back, say)
    watch.tick(now=t + 0.5)
    assert _asked(ledger) == {}  # none is moved again before it settles
    watch.tick(now=t + 10.0)
    assert len(_asked(ledger)) == 1
