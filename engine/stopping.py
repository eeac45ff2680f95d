"""Stop-string matching over streamed text, for the engine and the router alike. Pure Python.

A stop string never reaches the output: the matcher holds back the longest tail that could still grow
into one, and on a match returns the text before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopMatch:
    text: str  # text safe to emit now
    stopped: bool  # a stop string matched; ``text`` ends right before it


class StopStringMatcher:
    def __init__(self, stop: Sequence[str]) -> None:
        if any(s == "" for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stop = tuple(stop)
        self._max_hold = max((len(s) for s in self._stop), default=1) - 1
        self._buf = ""
        # Matches must end after this index of the buffer; text fed while
        # stopping is disallowed (before min_tokens) cannot stop on its own.
        self._guard = 0
        self.stopped = False
        self.matched: str | None = None

    def feed(self, text: str, can_stop: bool = True) -> StopMatch:
        """Append ``text``; return what is safe to emit and whether a stop string matched.

        After a match every further feed returns ``StopMatch("", True)``.
        """
        if self.stopped:
            return StopMatch("", True)
        if not self._stop:
            return StopMatch(text, False)
        self._buf += text
        if not can_stop:
            self._guard = len(self._buf)
        else:
            hit = self._find()
            if hit is not None:
                start, s = hit
                out = self._buf[:start]
                self._buf = ""
                self.stopped, self.matched = True, s
                return StopMatch(out, True)
        keep = self._held_tail()
        cut = len(self._buf) - keep
        out, self._buf = self._buf[:cut], self._buf[cut:]
        self._guard = max(0, self._guard - cut)
        return StopMatch(out, False)

    def flush(self) -> str:
        """The held-back text at the end of the stream (never part of a stop string)."""
        if self.stopped:
            return ""
        out, self._buf, self._guard = self._buf, "", 0
        return out

    def _find(self) -> tuple[int, str] | None:
        """The match that completes first (earliest end, then earliest start).

        That is the one a token-by-token stream would hit first, so the result
        does not depend on how the text was chunked.
        """
        best: tuple[int, int, str] | None = None
        for s in self._stop:
            i = self._buf.find(s, max(0, self._guard - len(s) + 1))
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        return None if best is None else (best[1], best[2])

    def _held_tail(self) -> int:
        """Length of the longest suffix of the buffer that is a proper prefix of a stop string.

        Invariant: every match starts inside the held-back buffer, since text is released only when no
        suffix starting at or before it is a proper prefix of a stop string."""
        buf = self._buf
        for n in range(min(self._max_hold, len(buf)), 0, -1):
            tail = buf[-n:]
            if any(len(s) > n and s.startswith(tail) for s in self._stop):
                return n
        return 0
