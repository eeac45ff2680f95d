"""Failures in a row: when a worker's engine (or prefill forward) is broken rather than one batch unlucky.

A failed step or forward fails its requests, which move to another worker; ``FailureStreak`` counts the
failures with no success between them and none longer than ``window_s`` after the one before (failures
hours apart on an idle worker are not a streak). ``LIMIT`` in a row: the worker fails what it holds, drains
and exits, to be replaced (``decode_pool.engine_loop``, ``prefill_pool.loop``).
"""

from __future__ import annotations

import time

LIMIT = 3
WINDOW_S = 60.0


class FailureStreak:
    def __init__(self, limit: int = LIMIT, window_s: float = WINDOW_S) -> None:
        self.limit, self.window_s = limit, window_s
        self.count = 0
        self._last = 0.0

    def failed(self) -> bool:
        """One more failure; True once the streak has reached the limit."""
        now = time.monotonic()
        self.count = self.count + 1 if self.count and now - self._last < self.window_s else 1
        self._last = now
        return self.count >= self.limit

    def succeeded(self) -> None:
        self.count = 0
