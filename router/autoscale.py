"""Autoscaling policy: each pool's signals in, at most one scale decision per pool a tick out.
Pure logic: no grpc, no torch."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field


class Pool(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class Direction(enum.Enum):
    UP = "up"
    DOWN = "down"


class Reason(enum.Enum):
    QUEUED_PREFILL_TOKENS = "queued_prefill_tokens"
    TTFT_SLO = "ttft_slo"
    KV_USAGE = "kv_usage"
    RUNNING_BATCH = "running_batch"
    ROUTER_QUEUE = "router_queue"
    ITL_SLO = "itl_slo"
    IDLE = "idle"
    BELOW_MIN = "below_min"
    ABOVE_MAX = "above_max"


class Pressure(enum.Enum):
    HIGH = "high"
    OK = "ok"
    LOW = "low"


@dataclass(frozen=True)
class PoolBounds:
    """Size bounds of one pool; ``warm``: standby workers kept loaded beside it (not counted in size)."""

    min: int = 1
    max: int = 1
    warm: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.min <= self.max:
            raise ValueError(f"pool bounds need 0 <= min <= max, got min {self.min}, max {self.max}")
        if self.warm < 0:
            raise ValueError(f"warm must be >= 0, got {self.warm}")


@dataclass(frozen=True)
class AutoscaleConfig:
    """Every threshold of the policy, in one place."""

    prefill: PoolBounds = PoolBounds()
    decode: PoolBounds = PoolBounds()
    interval_s: float = 2.0  # seconds between ticks (the driver's loop)
    up_after: int = 2  # HIGH ticks in a row before a scale-up
    down_after: int = 5  # LOW ticks in a row before a scale-down
    up_cooldown_s: float = 10.0  # after the pool last changed, before it may grow
    down_cooldown_s: float = 30.0  # after the pool last changed, before it may shrink
    # prefill
    prefill_tokens_high: int = 4096  # queued prefill tokens per serving prefill worker
    prefill_tokens_low: int = 512
    ttft_slo_s: float = 2.0
    # decode
    kv_usage_high: float = 0.85  # used / total KV blocks of the pool
    kv_usage_low: float = 0.4
    running_high: float = 0.8  # (running + queued) / max_running of the pool
    running_low: float = 0.3
    itl_slo_s: float = 0.1
    # A latency at most this share of its SLO counts as low.
    slo_low_ratio: float = 0.5
    latency_quantile: float = 0.9  # the window quantile of TTFT and ITL compared with the SLOs

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        if self.up_after < 1 or self.down_after < 1:
            raise ValueError("up_after and down_after must be >= 1")
        if self.up_cooldown_s < 0 or self.down_cooldown_s < 0:
            raise ValueError("cooldowns must be >= 0")
        if not 0 <= self.prefill_tokens_low < self.prefill_tokens_high:
            raise ValueError("need 0 <= prefill_tokens_low < prefill_tokens_high")
        for low, high, name in (
            (self.kv_usage_low, self.kv_usage_high, "kv_usage"),
            (self.running_low, self.running_high, "running"),
        ):
            if not 0 <= low < high:
                raise ValueError(f"need 0 <= {name}_low < {name}_high")
        if self.ttft_slo_s <= 0 or self.itl_slo_s <= 0:
            raise ValueError("SLOs must be > 0")
        if not 0 < self.slo_low_ratio < 1 or not 0 < self.latency_quantile < 1:
            raise ValueError("slo_low_ratio and latency_quantile must be in (0, 1)")

    def bounds(self, pool: Pool) -> PoolBounds:
        return self.prefill if pool is Pool.PREFILL else self.decode


@dataclass(frozen=True)
class PoolSignals:
    """One pool as the driver saw it this tick."""

    serving: int = 0  # READY workers the router routes to
    starting: int = 0  # started for this pool, not serving yet
    draining: tuple[str, ...] = ()  # ids of workers draining out of it
    standby: int = 0  # warm workers ready to be promoted
    queued_prefill_tokens: int = 0  # prefill: summed over the pool
    kv_usage: float = 0.0  # decode: used / total KV blocks over the pool
    running_ratio: float = 0.0  # decode: (running + queued) / max_running over the pool
    router_waiting: int = 0  # decode: requests waiting at the router for decode room
    latency_s: float | None = None  # TTFT (prefill) or ITL (decode) window quantile; None: no samples

    @property
    def size(self) -> int:
        return self.serving + self.starting


@dataclass(frozen=True)
class Decision:
    pool: Pool
    direction: Direction
    reason: Reason
    target: int  # the pool's size once this decision is carried out
    detail: str = ""  # the figures behind it, for the log


@dataclass
class _PoolState:
    high: int = 0  # HIGH ticks in a row
    low: int = 0  # LOW ticks in a row
    changed_at: float | None = None  # when the pool last changed (None: never)
    last_reason: Reason | None = None


def _share(total: float, workers: int) -> float:
    return total / max(workers, 1)


def pressure(config: AutoscaleConfig, pool: Pool, s: PoolSignals) -> tuple[Pressure, Reason | None, str]:
    """HIGH (and why), LOW, or OK for one pool's signals.

    HIGH needs one signal over its high mark; LOW needs every signal under its low mark as if the pool had
    one worker less, so that a scale-down does not itself push the pool back over a high mark."""
    n = max(s.serving, 1)
    fewer = max(s.serving - 1, 1)  # LOW is judged as if one worker had left
    lat = s.latency_s
    slo = config.ttft_slo_s if pool is Pool.PREFILL else config.itl_slo_s
    lat_low = lat is None or lat <= config.slo_low_ratio * slo
    if pool is Pool.PREFILL:
        per = _share(s.queued_prefill_tokens, n)
        detail = f"queued prefill tokens {s.queued_prefill_tokens} on {s.serving}, ttft {_fmt(lat)}"
        if per >= config.prefill_tokens_high:
            return Pressure.HIGH, Reason.QUEUED_PREFILL_TOKENS, detail
        # TTFT counts only while prefill work queues: a request waiting for decode room has a long TTFT
        # too, but more prefill workers would not help it.
        if lat is not None and lat > slo and per >= config.prefill_tokens_low:
            return Pressure.HIGH, Reason.TTFT_SLO, detail
        if _share(s.queued_prefill_tokens, fewer) <= config.prefill_tokens_low and lat_low:
            return Pressure.LOW, None, detail
        return Pressure.OK, None, detail
    detail = (
        f"kv {s.kv_usage:.2f}, running {s.running_ratio:.2f}, router waiting {s.router_waiting}, "
        f"itl {_fmt(lat)} on {s.serving}"
    )
    if s.kv_usage >= config.kv_usage_high:
        return Pressure.HIGH, Reason.KV_USAGE, detail
    if s.running_ratio >= config.running_high:
        return Pressure.HIGH, Reason.RUNNING_BATCH, detail
    if s.router_waiting > 0:
        return Pressure.HIGH, Reason.ROUTER_QUEUE, detail
    if lat is not None and lat > slo:
        return Pressure.HIGH, Reason.ITL_SLO, detail
    scale = n / fewer
    if (
        s.kv_usage * scale <= config.kv_usage_low
        and s.running_ratio * scale <= config.running_low
        and lat_low
    ):
        return Pressure.LOW, None, detail
    return Pressure.OK, None, detail


# Every (pool, direction, reason) a decision can carry: what ``pressure`` and ``_decide_pool`` return.
# Exporters create these counter series at zero, so a dashboard shows "no decisions" rather than no data.
UP_REASONS: Mapping[Pool, tuple[Reason, ...]] = {
    Pool.PREFILL: (Reason.QUEUED_PREFILL_TOKENS, Reason.TTFT_SLO, Reason.BELOW_MIN),
    Pool.DECODE: (
        Reason.KV_USAGE, Reason.RUNNING_BATCH, Reason.ROUTER_QUEUE, Reason.ITL_SLO, Reason.BELOW_MIN,
    ),
}  # fmt: skip
DOWN_REASONS: tuple[Reason, ...] = (Reason.IDLE, Reason.ABOVE_MAX)


def possible_decisions() -> list[tuple[Pool, Direction, Reason]]:
    return [(p, Direction.UP, r) for p in Pool for r in UP_REASONS[p]] + [
        (p, Direction.DOWN, r) for p in Pool for r in DOWN_REASONS
    ]


def _fmt(lat: float | None) -> str:
    return "-" if lat is None else f"{lat * 1000:.0f}ms"


@dataclass
class Autoscaler:
    """The policy's memory: streaks and the last change, per pool. ``decide`` is its only entry."""

    config: AutoscaleConfig
    _pools: dict[Pool, _PoolState] = field(default_factory=lambda: {p: _PoolState() for p in Pool})

    def decide(self, now: float, signals: Mapping[Pool, PoolSignals]) -> list[Decision]:
        """At most one decision per pool for this tick (``now``: monotonic seconds)."""
        out = []
        for pool, s in signals.items():
            d = self._decide_pool(now, pool, s)
            if d is not None:
                out.append(d)
        return out

    def _decide_pool(self, now: float, pool: Pool, s: PoolSignals) -> Decision | None:
        """Below min or above max: a change at once, with no cooldown. Otherwise UP after ``up_after``
        HIGH ticks in a row and DOWN after ``down_after`` LOW ones, each past its cooldown since the pool
        last changed; an OK tick resets both streaks. DOWN drains one worker, and waits while one
        still drains."""
        c, st, b = self.config, self._pools[pool], self.config.bounds(pool)
        if s.size < b.min:
            return self._changed(now, pool, Direction.UP, Reason.BELOW_MIN, s.size + 1, f"size {s.size}")
        if s.size > b.max and (s.starting == 0 or s.serving > 1):  # (a drain never takes the last server)
            return self._changed(now, pool, Direction.DOWN, Reason.ABOVE_MAX, s.size - 1, f"size {s.size}")
        level, reason, detail = pressure(c, pool, s)
        st.high = st.high + 1 if level is Pressure.HIGH else 0
        st.low = st.low + 1 if level is Pressure.LOW else 0
        since = float("inf") if st.changed_at is None else now - st.changed_at
        if (
            reason is not None
            and st.high >= c.up_after
            and s.size < b.max
            and s.starting == 0  # a scale-up still starting has not helped yet: wait for it
            and since >= c.up_cooldown_s
        ):
            return self._changed(now, pool, Direction.UP, reason, s.size + 1, detail)
        if (
            st.low >= c.down_after
            and s.size > b.min
            and not s.draining
            and s.starting == 0  # the size counts a worker not serving yet: a drain could leave none
            and since >= c.down_cooldown_s
        ):
            return self._changed(now, pool, Direction.DOWN, Reason.IDLE, s.size - 1, detail)
        return None

    def _changed(
        self, now: float, pool: Pool, direction: Direction, reason: Reason, target: int, detail: str
    ) -> Decision:
        st = self._pools[pool]
        st.high = st.low = 0
        st.changed_at = now
        st.last_reason = reason
        return Decision(pool, direction, reason, target, detail)


def window_quantile(before: Mapping[float, float], after: Mapping[float, float], q: float) -> float | None:
    """The ``q`` quantile of the samples a cumulative histogram gained between two scrapes.

    ``before``/``after``: upper bound -> cumulative count (Prometheus ``_bucket``, ``+Inf`` included).
    Linear inside the bucket, as PromQL's ``histogram_quantile``; the ``+Inf`` bucket answers its lower
    bound. None when no sample arrived (or the counters went back: the process restarted).
    """
    bounds = sorted(after)
    delta = [(ub, after[ub] - before.get(ub, 0.0)) for ub in bounds]
    if not delta or delta[-1][1] <= 0 or any(d < 0 for _, d in delta):
        return None
    rank = q * delta[-1][1]
    prev_ub, prev_count = 0.0, 0.0
    for ub, count in delta:
        if count >= rank:
            if ub == float("inf"):
                return prev_ub
            width = count - prev_count
            return prev_ub + (ub - prev_ub) * ((rank - prev_count) / width if width > 0 else 1.0)
        prev_ub, prev_count = ub, count
    return prev_ub
