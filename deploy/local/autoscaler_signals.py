"""What the local autoscaler reads of its cluster: each pool's signals (its live workers and the router's
status) and the latency quantiles of the router's /metrics since the last tick."""

from __future__ import annotations

import http.client
import logging
import urllib.request
from collections.abc import Container, Mapping, Sequence

from prometheus_client.parser import text_string_to_metric_families

from pdserve.deploy.local import cluster
from pdserve.proto import worker_pb2
from pdserve.router.autoscale import Pool, PoolSignals, window_quantile
from pdserve.worker.role import Role

log = logging.getLogger(__name__)

ROLES = {Pool.PREFILL: Role.PREFILL, Pool.DECODE: Role.DECODE}
TTFT = "pdserve_time_to_first_token_seconds"
ITL = "pdserve_inter_token_latency_seconds"
_STANDBY_OR_LOADING = (worker_pb2.WORKER_STATE_STANDBY, worker_pb2.WORKER_STATE_LOADING)


def pool_signals(
    live: Sequence[cluster.ProcessEntry],
    status: worker_pb2.ClusterStatus,
    latency: Mapping[Pool, float | None],
    draining: Container[str],
) -> dict[Pool, PoolSignals]:
    """Each pool's signals from its workers whose process runs (``live``), the router's ``status`` and the
    workers the autoscaler asked to drain (``draining``)."""
    entries = {e.info.worker_id: e for e in status.workers}
    out = {}
    for pool, role in ROLES.items():
        procs = [w for w in live if w.role is role]
        serving = [
            entries[w.id]
            for w in procs
            if w.id in entries
            and entries[w.id].load.state == worker_pb2.WORKER_STATE_READY
            and w.id not in draining
        ]
        # Standby workers loaded (registered as standby) or still loading: a replacement standby
        # counts from its spawn, as a starting worker does.
        standby = [
            w
            for w in procs
            if w.standby and (w.id not in entries or entries[w.id].load.state in _STANDBY_OR_LOADING)
        ]
        # Loading, not registered yet, or promoted out of the warm pool but not READY yet.
        coming = (worker_pb2.WORKER_STATE_LOADING, worker_pb2.WORKER_STATE_STANDBY)
        starting = [
            w
            for w in procs
            if not w.standby
            and w.id not in draining
            and (w.id not in entries or entries[w.id].load.state in coming)
        ]
        loads = [e.load for e in serving]
        kv_total = sum(ld.kv_blocks_total for ld in loads)
        max_running = sum(e.info.max_running for e in serving)
        out[pool] = PoolSignals(
            serving=len(serving),
            starting=len(starting),
            draining=tuple(w.id for w in procs if w.id in draining),
            standby=len(standby),
            queued_prefill_tokens=sum(ld.queued_prefill_tokens for ld in loads),
            kv_usage=sum(ld.kv_blocks_used for ld in loads) / kv_total if kv_total else 0.0,
            running_ratio=sum(ld.running + ld.queued for ld in loads) / max_running if max_running else 0.0,
            router_waiting=status.requests_waiting if pool is Pool.DECODE else 0,
            latency_s=latency.get(pool),
        )
    return out


class LatencyWindow:
    """The TTFT (prefill) and ITL (decode) quantile over what the router observed since the last read."""

    def __init__(self, quantile: float) -> None:
        self.quantile = quantile
        self._hist: dict[str, dict[float, float]] = {}

    def read(self, url: str) -> dict[Pool, float | None]:
        if not url:
            return {}
        try:
            with urllib.request.urlopen(url, timeout=2.0) as resp:
                text = resp.read().decode()
            now = _buckets(text, (TTFT, ITL))
        except (OSError, http.client.HTTPException, ValueError) as e:  # (a body cut short: no sample)
            log.warning("router metrics at %s: %r", url, e)
            return {}
        before, q = self._hist, self.quantile
        out = {
            Pool.PREFILL: window_quantile(before.get(TTFT, {}), now.get(TTFT, {}), q) if before else None,
            Pool.DECODE: window_quantile(before.get(ITL, {}), now.get(ITL, {}), q) if before else None,
        }
        self._hist = now
        return out


def _buckets(text: str, names: tuple[str, ...]) -> dict[str, dict[float, float]]:
    """Cumulative bucket counts (upper bound -> count) of the named histograms, summed over labels."""
    out: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in names:
            continue
        buckets = out.setdefault(family.name, {})
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                ub = float(sample.labels["le"])
                buckets[ub] = buckets.get(ub, 0.0) + sample.value
    return out
