"""The autoscaling policy (``router.autoscale``): pure logic, no processes.

Hysteresis, cooldown, min/max bounds, a worker dying during scale-down, and the window quantile the
driver computes TTFT/ITL from.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.router.autoscale import (
    AutoscaleConfig,
    Autoscaler,
    Direction,
    Pool,
    PoolBounds,
    PoolSignals,
    Pressure,
    Reason,
    possible_decisions,
    pressure,
    window_quantile,
)

CFG = AutoscaleConfig(
    prefill=PoolBounds(1, 3),
    decode=PoolBounds(1, 2),
    up_after=2,
    down_after=3,
    up_cooldown_s=10.0,
    down_cooldown_s=20.0,
    prefill_tokens_high=1000,
    prefill_tokens_low=100,
    ttft_slo_s=1.0,
    itl_slo_s=0.1,
)

BUSY_P = PoolSignals(serving=1, queued_prefill_tokens=5000)
IDLE_P = PoolSignals(serving=1)
MID_P = PoolSignals(serving=1, queued_prefill_tokens=500)  # between the marks
BUSY_D = PoolSignals(serving=1, running_ratio=1.0)
IDLE_D = PoolSignals(serving=1)


def run(a: Autoscaler, ticks, t0: float = 0.0, dt: float = 1.0):
    """Feed (prefill, decode) signal pairs one tick apart; returns [(time, decision)]."""
    out = []
    for i, (p, d) in enumerate(ticks):
        now = t0 + i * dt
        for dec in a.decide(now, {Pool.PREFILL: p, Pool.DECODE: d}):
            out.append((now, dec))
    return out


def test_sustained_pressure_scales_the_stressed_pool_only():
    got = run(Autoscaler(CFG), [(BUSY_P, IDLE_D)] * 2)
    assert [(d.pool, d.direction, d.reason, d.target) for _, d in got] == [
        (Pool.PREFILL, Direction.UP, Reason.QUEUED_PREFILL_TOKENS, 2)
    ]
    got = run(Autoscaler(CFG), [(IDLE_P, BUSY_D)] * 2)
    assert [(d.pool, d.reason) for _, d in got] == [(Pool.DECODE, Reason.RUNNING_BATCH)]


def test_hysteresis_a_blip_or_the_band_between_the_marks_does_nothing():
    # HIGH, then one tick in the band, then HIGH: the streak restarted, no decision.
    assert run(Autoscaler(CFG), [(BUSY_P, IDLE_D), (MID_P, IDLE_D), (BUSY_P, IDLE_D)]) == []
    # Flapping between HIGH and LOW never scales either way.
    flap = [(BUSY_P, IDLE_D), (PoolSignals(serving=2), IDLE_D)] * 10
    a = Autoscaler(CFG)
    assert [d for _, d in run(a, flap) if d.pool is Pool.PREFILL] == []
    # In the band for ever: neither up nor down, even with 2 workers above min.
    assert run(Autoscaler(CFG), [(PoolSignals(serving=2, queued_prefill_tokens=150), IDLE_D)] * 30) == []


def test_low_is_judged_as_if_one_worker_had_left():
    # 2 workers with 80 tokens queued each: under the low mark now, but 160 on one worker is not.
    s = PoolSignals(serving=2, queued_prefill_tokens=160)
    assert pressure(CFG, Pool.PREFILL, s)[0] is Pressure.OK
    assert pressure(CFG, Pool.PREFILL, PoolSignals(serving=2, queued_prefill_tokens=90))[0] is Pressure.LOW
    # Decode: running 0.2 on 2 workers is 0.4 on one, over the 0.3 low mark.
    assert pressure(CFG, Pool.DECODE, PoolSignals(serving=2, running_ratio=0.2))[0] is Pressure.OK
    assert pressure(CFG, Pool.DECODE, PoolSignals(serving=2, running_ratio=0.1))[0] is Pressure.LOW


def test_slo_signals():
    # TTFT over its SLO counts for prefill only while prefill work is queued.
    assert pressure(CFG, Pool.PREFILL, PoolSignals(serving=1, latency_s=5.0))[0] is Pressure.OK
    level, reason, _ = pressure(
        CFG, Pool.PREFILL, PoolSignals(serving=1, queued_prefill_tokens=200, latency_s=5.0)
    )
    assert (level, reason) == (Pressure.HIGH, Reason.TTFT_SLO)
    assert pressure(CFG, Pool.DECODE, PoolSignals(serving=1, latency_s=0.5))[1] is Reason.ITL_SLO
    assert pressure(CFG, Pool.DECODE, PoolSignals(serving=1, kv_usage=0.9))[1] is Reason.KV_USAGE
    assert pressure(CFG, Pool.DECODE, PoolSignals(serving=1, router_waiting=3))[1] is Reason.ROUTER_QUEUE
    # A latency between half the SLO and the SLO keeps the pool from shrinking.
    assert pressure(CFG, Pool.DECODE, PoolSignals(serving=2, latency_s=0.08))[0] is Pressure.OK


def test_cooldown_between_changes():
    a = Autoscaler(CFG)
    busy2 = PoolSignals(serving=2, queued_prefill_tokens=10000)
    first = run(a, [(BUSY_P, IDLE_D)] * 2)
    assert [t for t, _ in first] == [1.0]
    # Still busy on 2 workers: nothing until up_cooldown_s (10 s) after the first change.
    later = run(a, [(busy2, IDLE_D)] * 15, t0=2.0)
    assert [(t, d.target) for t, d in later] == [(11.0, 3)]
    # Idle right after growing: down waits for down_cooldown_s (20 s) after the last change.
    idle3 = PoolSignals(serving=3)
    downs = run(a, [(idle3, IDLE_D)] * 30, t0=17.0)
    assert [(t, d.direction, d.reason) for t, d in downs if d.pool is Pool.PREFILL][0] == (
        31.0,
        Direction.DOWN,
        Reason.IDLE,
    )


def test_min_and_max_bounds():
    a = Autoscaler(CFG)
    # At max (decode: 2), pressure does not grow the pool.
    assert run(a, [(IDLE_P, PoolSignals(serving=2, kv_usage=0.99))] * 40) == []
    # At min (prefill: 1), idleness does not shrink it.
    assert run(Autoscaler(CFG), [(IDLE_P, IDLE_D)] * 40) == []
    # Below min (a worker died): up at once, no streak, no cooldown.
    b = Autoscaler(CFG)
    run(b, [(BUSY_P, IDLE_D)] * 2)
    got = run(b, [(PoolSignals(serving=0), IDLE_D)], t0=2.0)
    assert [(d.pool, d.direction, d.reason, d.target) for _, d in got] == [
        (Pool.PREFILL, Direction.UP, Reason.BELOW_MIN, 1)
    ]
    # ... but a replacement already starting counts: no second one.
    assert run(b, [(PoolSignals(starting=1), IDLE_D)] * 3, t0=3.0) == []
    # Above max (bounds lowered, or workers added by hand): down.
    got = run(Autoscaler(CFG), [(IDLE_P, PoolSignals(serving=3))])
    assert [(d.pool, d.direction, d.reason, d.target) for _, d in got] == [
        (Pool.DECODE, Direction.DOWN, Reason.ABOVE_MAX, 2)
    ]


def test_a_scale_up_still_starting_is_not_repeated():
    a = Autoscaler(AutoscaleConfig(prefill=PoolBounds(1, 3), up_cooldown_s=0.0, up_after=1))
    first = run(a, [(BUSY_P, IDLE_D)])
    assert len(first) == 1
    starting = PoolSignals(serving=1, starting=1, queued_prefill_tokens=50000)
    assert run(a, [(starting, IDLE_D)] * 5, t0=1.0) == []


def test_no_drain_while_a_worker_of_the_pool_is_still_starting():
    """Exploratory testing: the load went away while a scale-up was still loading; the idle pool's size
    (1 serving + 1 starting) passed its minimum, and the only serving worker was drained: no decode
    worker for 4 s. Now the pool waits until the new worker serves, then drains one."""
    cfg = AutoscaleConfig(decode=PoolBounds(1, 2), down_after=1, down_cooldown_s=0.0)
    a = Autoscaler(cfg)
    assert run(a, [(IDLE_P, PoolSignals(serving=1, starting=1))] * 5) == []
    got = run(a, [(IDLE_P, PoolSignals(serving=2))], t0=5.0)
    assert [(d.pool, d.direction, d.target) for _, d in got] == [(Pool.DECODE, Direction.DOWN, 1)]
    # Above the maximum (bounds lowered) the pool shrinks, but never by its only serving worker.
    assert run(Autoscaler(cfg), [(IDLE_P, PoolSignals(serving=1, starting=2))] * 3) == []
    got = run(Autoscaler(cfg), [(IDLE_P, PoolSignals(serving=2, starting=1))])
    assert [(d.direction, d.reason) for _, d in got] == [(Direction.DOWN, Reason.ABOVE_MAX)]


def test_one_drain_at_a_time():
    cfg = AutoscaleConfig(decode=PoolBounds(1, 3), down_after=1, down_cooldown_s=0.0)
    a = Autoscaler(cfg)
    got = run(a, [(IDLE_P, PoolSignals(serving=3))])
    assert [(d.direction, d.target) for _, d in got] == [(Direction.DOWN, 2)]
    # The drained worker is still leaving: no second drain yet.
    leaving = PoolSignals(serving=2, draining=("decode-3",))
    assert run(a, [(IDLE_P, leaving)] * 3, t0=1.0) == []
    got = run(a, [(IDLE_P, PoolSignals(serving=2))], t0=4.0)
    assert [(d.direction, d.target) for _, d in got] == [(Direction.DOWN, 1)]


def test_worker_dying_during_scale_down():
    cfg = AutoscaleConfig(decode=PoolBounds(1, 2), down_after=1, down_cooldown_s=0.0, up_cooldown_s=30.0)
    # The worker being drained dies: it leaves `draining`; the pool is at min and stays there.
    a = Autoscaler(cfg)
    assert [d.direction for _, d in run(a, [(IDLE_P, PoolSignals(serving=2))])] == [Direction.DOWN]
    assert run(a, [(IDLE_P, PoolSignals(serving=1, draining=("decode-2",)))], t0=1.0) == []
    assert run(a, [(IDLE_P, PoolSignals(serving=1))] * 5, t0=2.0) == []
    # The worker that was to stay dies while the other drains: below min, replaced at once even
    # within the cooldown, and the drain is not undone (the draining one is not counted).
    b = Autoscaler(cfg)
    run(b, [(IDLE_P, PoolSignals(serving=2))])
    got = run(b, [(IDLE_P, PoolSignals(serving=0, draining=("decode-2",)))], t0=1.0)
    assert [(d.pool, d.direction, d.reason, d.target) for _, d in got] == [
        (Pool.DECODE, Direction.UP, Reason.BELOW_MIN, 1)
    ]


def test_config_checks_itself():
    with pytest.raises(ValueError, match="min"):
        PoolBounds(3, 2)
    with pytest.raises(ValueError, match="warm"):
        PoolBounds(1, 2, warm=-1)
    with pytest.raises(ValueError, match="prefill_tokens"):
        AutoscaleConfig(prefill_tokens_low=10, prefill_tokens_high=10)
    with pytest.raises(ValueError, match="kv_usage"):
        AutoscaleConfig(kv_usage_low=0.9, kv_usage_high=0.8)
    with pytest.raises(ValueError, match="up_after"):
        AutoscaleConfig(up_after=0)


def test_window_quantile():
    inf = math.inf
    before = {0.1: 10.0, 0.5: 10.0, 1.0: 10.0, inf: 10.0}
    after = {0.1: 10.0, 0.5: 14.0, 1.0: 20.0, inf: 20.0}  # 4 samples in (0.1, 0.5], 6 in (0.5, 1]
    assert window_quantile(before, after, 0.4) == pytest.approx(0.5)
    assert window_quantile(before, after, 0.9) == pytest.approx(0.5 + 0.5 * (9 - 4) / 6)
    assert window_quantile(before, before, 0.9) is None  # nothing new
    assert window_quantile(after, before, 0.9) is None  # counters went back (a restart)
    # Samples past the last finite bound answer that bound.
    assert window_quantile({}, {1.0: 0.0, inf: 3.0}, 0.5) == 1.0


def test_a_standby_worker_is_registered_but_not_routed_to_until_promoted():
    from pdserve.router.policy import RoutingConfig, choose_route
    from pdserve.router.registry import PROMOTED_EARLY_TTL_S, Registry, RegistryConfig, State, Worker
    from pdserve.worker.role import Role

    reg = Registry(RegistryConfig())

    def worker(wid: str, standby: bool = False) -> Worker:
        return Worker(wid, Role.DECODE, f"{wid}:1", 64, 16, 8, standby=standby)

    reg.register(worker("decode-1"), 0.0)
    reg.register(worker("decode-2", standby=True), 0.0)
    for wid in ("decode-1", "decode-2"):
        reg.heartbeat(
            wid, 1.0, state=State.READY, running=0, queued=0, queued_prefill_tokens=0, kv_blocks_used=0
        )
    assert reg.get("decode-2").state is State.STANDBY
    assert [w.worker_id for w in reg.ready()] == ["decode-1"]
    # Busy decode-1: no route rather than the standby one.
    reg.get("decode-1").assigned = 8
    assert choose_route(reg.ready(), 10, RoutingConfig()) is None
    promoted = reg.promote("decode-2", 1.5)
    assert promoted is not None and promoted.state is State.READY
    assert choose_route(reg.ready(), 10, RoutingConfig()).decode.worker_id == "decode-2"
    # Its next heartbeat and a re-registration (a router restart) keep it promoted.
    reg.heartbeat(
        "decode-2", 2.0, state=State.READY, running=0, queued=0, queued_prefill_tokens=0, kv_blocks_used=0
    )
    reg.register(worker("decode-2", standby=True), 3.0)
    reg.heartbeat(
        "decode-2", 3.0, state=State.READY, running=0, queued=0, queued_prefill_tokens=0, kv_blocks_used=0
    )
    assert reg.get("decode-2").state is State.READY
    # A standby still loading becomes READY on its first READY heartbeat once promoted.
    reg.register(worker("decode-3", standby=True), 4.0)
    assert reg.promote("decode-3", 4.0).state is State.LOADING
    reg.heartbeat(
        "decode-3", 5.0, state=State.READY, running=0, queued=0, queued_prefill_tokens=0, kv_blocks_used=0
    )
    assert reg.get("decode-3").state is State.READY
    assert reg.promote("nobody", 5.0) is None
    # A standby promoted before it registered (the autoscaler promotes one still loading) registers into
    # routing: it was held as standby with nothing serving beside it, and the pool stayed empty.
    assert reg.promote("decode-4", 5.0) is None
    reg.register(worker("decode-4", standby=True), 6.0)
    reg.heartbeat(
        "decode-4", 6.0, state=State.READY, running=0, queued=0, queued_prefill_tokens=0, kv_blocks_used=0
    )
    assert reg.get("decode-4").state is State.READY and not reg.get("decode-4").standby
    # One promoted early that never registered (it died loading) is forgotten after PROMOTED_EARLY_TTL_S:
    # a later process under its id (a pod name reused) registers as the standby it was started as.
    assert reg.promote("decode-5", 7.0) is None
    late = 7.0 + PROMOTED_EARLY_TTL_S + 1.0
    reg.register(worker("decode-5", standby=True), late)
    reg.heartbeat(
        "decode-5", late, state=State.READY, running=0, queued=0, queued_prefill_tokens=0, kv_blocks_used=0
    )
    assert reg.get("decode-5").state is State.STANDBY and reg.get("decode-5").standby


_SIGNALS = st.builds(
    PoolSignals,
    serving=st.integers(0, 4),
    starting=st.integers(0, 1),
    draining=st.sampled_from([(), ("w",)]),
    queued_prefill_tokens=st.integers(0, 5000),
    kv_usage=st.floats(0.0, 1.0),
    running_ratio=st.floats(0.0, 1.5),
    router_waiting=st.integers(0, 3),
    latency_s=st.one_of(st.none(), st.floats(0.0, 3.0)),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_SIGNALS, _SIGNALS), min_size=1, max_size=30))
def test_every_decision_is_one_the_exporter_creates_a_series_for(ticks):
    """The autoscaler's counter starts every (pool, direction, reason) at 0 from ``possible_decisions``;
    a decision outside that list would be a series the dashboard never saw before it happened."""
    known = set(possible_decisions())
    for _, d in run(Autoscaler(CFG), ticks, dt=30.0):
        assert (d.pool, d.direction, d.reason) in known
