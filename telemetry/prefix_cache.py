"""A worker's prefix-cache metrics, for every role: prompt tokens looked up and reused, blocks held by the
cache alone, evictions. Advanced to the engine's running totals at each load report (each heartbeat).

With ``PDSERVE_CHECK_BLOCKS=1`` (tests) each report also checks the block pool's invariants (no block freed
twice, refcounts equal owners, free + cached + owned == total) and counts failures.
"""

from __future__ import annotations

import logging
import os
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

log = logging.getLogger(__name__)

PREFIX_QUERIES = "pdserve_prefix_cache_queries_tokens_total"
PREFIX_HITS = "pdserve_prefix_cache_hits_tokens_total"
KV_BLOCKS_CACHED = "pdserve_kv_blocks_cached"
PREFIX_EVICTIONS = "pdserve_prefix_cache_evictions_total"
BLOCK_INVARIANT_FAILURES = "pdserve_kv_block_invariant_failures_total"
CHECK_BLOCKS_VAR = "PDSERVE_CHECK_BLOCKS"


class CheckedPool(Protocol):
    def check_invariants(self) -> None: ...


class PrefixCacheMetrics:
    def __init__(self, registry: CollectorRegistry, role: str) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["role"], registry=registry).labels(role)

        self.queries = counter(
            PREFIX_QUERIES, "Prompt tokens of requests looked up in this worker's prefix cache."
        )
        self.hits = counter(
            PREFIX_HITS,
            "Prompt tokens whose KV this worker reused from its prefix cache instead of computing them "
            "(hits / queries is the hit rate).",
        )
        self.evictions = counter(PREFIX_EVICTIONS, "Cached KV blocks evicted to make room for new ones.")
        self.cached = Gauge(
            KV_BLOCKS_CACHED,
            "KV blocks held by the prefix cache alone: no request references them, they count as free and "
            "are evicted least recently used first.",
            ["role"],
            registry=registry,
        ).labels(role)
        self._seen = [0, 0, 0]
        self._check = os.environ.get(CHECK_BLOCKS_VAR) == "1"
        self.invariant_failures = counter(
            BLOCK_INVARIANT_FAILURES,
            f"KV block pool invariant checks that failed (only with {CHECK_BLOCKS_VAR}=1).",
        )

    def check(self, pool: CheckedPool) -> None:
        """Check the pool's invariants when asked to (``PDSERVE_CHECK_BLOCKS=1``)."""
        if not self._check:
            return
        try:
            pool.check_invariants()
        except AssertionError:
            log.exception("KV block pool invariant broken")
            self.invariant_failures.inc()

    def update(self, query_tokens: int, hit_tokens: int, evictions: int, cached_blocks: int) -> None:
        """Running totals since start (they only grow) and the cached blocks now."""
        for i, (metric, total) in enumerate(
            ((self.queries, query_tokens), (self.hits, hit_tokens), (self.evictions, evictions))
        ):
            if total > self._seen[i]:
                metric.inc(total - self._seen[i])
                self._seen[i] = total
        self.cached.set(cached_blocks)
