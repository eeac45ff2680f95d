"""The router operations the request path calls back: one Protocol, implemented by ``service.Router``.

The relay runs a request on its workers; what it learns on the way (a worker died, refused for room,
finished) changes the router's cluster state and ledger through these, and nothing else.
"""

from __future__ import annotations

from typing import Protocol

from pdserve.router.jobs import Job, NoRoute
from pdserve.router.policy import Route
from pdserve.router.registry import Worker


class RouterOps(Protocol):
    def release_prefill(self, job: Job) -> None:
        """The job's prefill call ended (either way): its tokens no longer queue on that worker."""
        ...

    def grow(self, job: Job, seq_len: int) -> None:
        """The job's sequence on its decode worker grew to ``seq_len`` tokens: its KV blocks count."""
        ...

    async def release(self, job: Job) -> None:
        """The job's decode stream ended: its claims go to waiting requests, though its client may still
        be reading what was received (a slow client slows only itself)."""
        ...

    def worker_failed(self, w: Worker, dead: bool, reason: str) -> None:
        """A call to ``w`` failed with UNAVAILABLE: it died (``dead``) or is draining."""
        ...

    def worker_full(self, w: Worker) -> None:
        """``w`` refused a decode reservation for room: it is counted full a while."""
        ...

    def move_target(self, job: Job, avoid: Worker, seq_len: int) -> Route | None:
        """Where the job's stream of ``seq_len`` tokens could move live now: a READY decoding worker other
        than ``avoid`` with room (nothing is claimed yet); None when none has."""
        ...

    def moved(self, job: Job, route: Route, seq_len: int) -> None:
        """The job's stream moved live to ``route``'s decode worker, where it holds ``seq_len`` tokens."""
        ...

    async def reroute(
        self, job: Job, prompt_len: int, wait_s: float, avoid: str = "", remote: bool = False
    ) -> Route | NoRoute:
        """A new route claimed for the failed ``job`` (not on ``avoid``; ``remote``: a prefill worker may
        prefill it), waiting up to ``wait_s`` for room; or why there is none."""
        ...
