"""Failures in a row: when a worker's engine (or prefill forward) is broken rather than one batch unlucky.
``LIMIT`` in a row and the worker fails what it holds, drains and exits, to be replaced."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

LIMIT = 3
WINDOW_S = 60.0


class FailureStreak:
    """Failures with no success between them and none longer than ``window_s`` after the one before
    (failures far apart on an idle worker are no streak)."""

    def __init__(self, limit: int = LIMIT, window_s: float = WINDOW_S) -> None:
        self.limit, self.window_s = limit, window_s
        self.count = 0
        self.total = 0  # every failure, streak or not
        self._last = 0.0
        # Called on every failure (a metric: ``pdserve_failed_steps_total``); an error in it is logged once.
        self.on_failure: Callable[[], object] | None = None
        self._hook_failed = False

    def failed(self) -> bool:
        """One more failure; True once the streak has reached the limit."""
        now = time.monotonic()
        self.count = self.count + 1 if self.count and now - self._last < self.window_s else 1
        self._last = now
        self.total += 1
        if self.on_failure is not None:
            try:
                self.on_failure()
            except Exception:  # a metric must not stop the loop
                if not self._hook_failed:
                    log.exception("the failure callback failed (logged once)")
                    self._hook_failed = True
        return self.count >= self.limit

    def succeeded(self) -> None:
        self.count = 0
