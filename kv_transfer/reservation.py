"""The decode side's record of one reservation (state only; receiver.py acts on it)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import Enum

from kv_transfer.transport import Connection, DataOp


class RxState(Enum):
    RESERVED = "reserved"
    OPEN = "open"
    DONE = "done"
    FAILING = "failing"
    FREED = "freed"


@dataclass(frozen=True)
class TransferResult:
    request_id: str
    first_token_id: int
    block_ids: tuple[int, ...]
    num_tokens: int
    bytes: int
    seconds: float  # Open to completion


@dataclass(eq=False)
class Reservation:
    """One request's reservation on the decode side."""

    request_id: str
    transfer_id: int
    blocks: list[int]
    num_tokens: int
    result: asyncio.Future[TransferResult]
    timer: asyncio.TimerHandle | None = None
    state: RxState = RxState.RESERVED
    conn: Connection | None = None
    peer: PrefillConn | None = None
    ops: dict[int, list[DataOp]] = field(default_factory=dict)  # layer -> receives
    pending: list[int] = field(default_factory=list)  # receives still to land, per layer
    unsettled: int = 0  # posted receives not yet resolved either way
    layers_done: int = 0
    first_token_id: int | None = None
    opened_at: float = 0.0
    bytes: int = 0
    drained: bool = False
    grace: asyncio.TimerHandle | None = None


@dataclass(eq=False)
class PrefillConn:
    """One prefill connection and the transfers opened on it."""

    conn: Connection
    accepted: bool = False
    transfers: set[Reservation] = field(default_factory=set)
