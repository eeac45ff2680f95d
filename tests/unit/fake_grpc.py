"""A stand-in for a gRPC servicer context, to call a servicer method directly and see how it ends."""

from __future__ import annotations


class Aborted(Exception):
    """Raised by ``AbortingContext.abort``, as grpc's own abort ends the handler."""


class AbortingContext:
    """Records the (code, details, trailing metadata) of the call's abort, then raises ``Aborted``."""

    def __init__(self) -> None:
        self.aborted: tuple = ()

    def invocation_metadata(self) -> tuple:
        return ()

    async def abort(self, code, details, trailing_metadata=()):  # type: ignore[no-untyped-def]
        self.aborted = (code, details, tuple(trailing_metadata))
        raise Aborted
