"""The decode side's records: reservations, refused Opens being drained, connections (state only;
receiver.py and drain.py act on them)."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from pdserve.kv_transfer.tp_plan import Piece
from pdserve.kv_transfer.transport import Connection, DataOp


class BlockPool(Protocol):
    """What the receiver needs of the decode worker's KV block allocator (``engine.block_manager.
    BlockManager`` is one). Every call must be atomic and all-or-nothing, because the receiver calls it
    on the event loop thread while the decode engine uses the same pool on its own thread: the rules are
    the contract in ``kv_transfer/__init__.py``."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    def allocate(self, owner: Hashable, num_tokens: int) -> list[int]:
        """Blocks for ``num_tokens`` tokens under ``owner``; raise, holding nothing, when there is no room."""
        ...

    def allocate_prefixed(self, owner: Hashable, num_tokens: int, block_hashes: Sequence[bytes]) -> int:
        """As ``allocate``, holding the longest run of ``block_hashes`` the pool has cached as the table's
        first blocks; returns how many blocks it reused (their KV is already there)."""
        ...

    def block_table(self, owner: Hashable) -> list[int]: ...

    def free(self, owner: Hashable) -> bool:
        """Return ``owner``'s blocks; idempotent (False when it held none)."""
        ...


class RxState(Enum):
    """A reservation's stage on the decode side."""

    RESERVED = "reserved"  # blocks allocated under the request id; ticket handed out; deadline armed
    OPEN = "open"  # the sender's Open taken: receives posted into the blocks, or its puts allowed
    DONE = "done"  # every layer and Complete arrived: wait() returns; the blocks are the engine's
    FAILING = "failing"  # wait() raises; the blocks are held until nothing can write them any more
    FREED = "freed"  # failed, and the blocks returned to the pool


@dataclass(frozen=True)
class TransferResult:
    request_id: str
    first_token_id: int
    block_ids: tuple[int, ...]
    num_tokens: int
    bytes: int
    seconds: float  # Open to completion
    choice_token_ids: tuple[int, ...] = ()  # n > 1: choices 1..'s first tokens (wire.Complete)


@dataclass(eq=False)
class Reservation:
    """One request's reservation on the decode side."""

    request_id: str
    transfer_id: int
    blocks: list[int]  # the request's whole table: the engine adopts all of it
    num_tokens: int
    result: asyncio.Future[TransferResult]
    reused: int = 0  # leading blocks D already held (prefix cache): never written by the transfer
    timer: asyncio.TimerHandle | None = None
    state: RxState = RxState.RESERVED
    conn: Connection | None = None
    peer: PrefillConn | None = None
    ops: dict[int, list[DataOp]] = field(default_factory=dict)  # layer -> receives
    pending: list[int] = field(default_factory=list)  # receives still to land, per layer
    unsettled: int = 0  # posted receives not yet resolved either way
    layers_done: int = 0
    layers_put: int = 0  # RMA: layers the sender says it has put (Progress); not yet known to have landed
    first_token_id: int | None = None
    choice_token_ids: tuple[int, ...] = ()
    opened_at: float = 0.0
    bytes: int = 0
    drained: bool = False
    grace: asyncio.TimerHandle | None = None
    rma: bool = False  # accepted as one-sided puts: unsettled 1 while the sender may write
    seq: int = 0  # the receiver's reservation count when made (TransferTicket.seq)
    deadline_unix: float = 0.0  # the ticket's
    # Ended before any Open: the connections that may hold the ticket and put into the blocks
    # without an Accept, until each answers the revoke (or closes). The blocks wait for them.
    revoking: set[PrefillConn] = field(default_factory=set)
    revoke_forced: bool = False  # the laggards' connections were closed by this side: hold on
    # (Loop time.) A connection that could put into the blocks was closed by this side, whose sender
    # may live on and still be writing: once failed, the blocks are freed no sooner than this.
    hold_until: float = 0.0
    runs: list[tuple[int, int]] = field(default_factory=list)  # the Open's runs here: (first block, count)
    digests: tuple[int, ...] = ()  # the writer's, from Complete (wire.Complete.digests)
    verifying: bool = False  # the digests are being checked

    @property
    def targets(self) -> list[int]:
        """The blocks the transfer writes: the table past the reused prefix."""
        return self.blocks[self.reused :]


@dataclass(eq=False)
class Drain:
    """A refused Open: what its sender pushes lands in scratch memory, never in KV blocks.

    Lives until every posted receive settled: the sender's ``AbortAck`` (or its
    own ``Abort``) says which layers it sent, the rest are cancelled.
    """

    transfer_id: int
    scratch: Any  # the receives' buffer, alive while they may write it
    ops: dict[int, list[DataOp]] = field(default_factory=dict)  # layer -> receives
    unsettled: int = 0
    drained: bool = False
    grace: asyncio.TimerHandle | None = None


@dataclass(eq=False)
class PrefillConn:
    """One prefill connection and the transfers opened on it."""

    conn: Connection
    accepted: bool = False
    proven: bool = False  # its Hello proved the cluster token (or the receiver has none)
    conn_id: int = -1  # the id in this connection's data tags, once the handshake is done
    transfers: set[Reservation] = field(default_factory=set)
    rma: bool = False  # the KV region was offered to it in HelloReply
    drains: dict[int, Drain] = field(default_factory=dict)  # transfer id -> refused Open
    # The receiver's reservation count at its HelloReply: newer reservations (larger seq) are
    # written eagerly by this connection, and revoked on it when they end un-opened. -1: no RMA.
    hello_seq: int = -1
    revoking: set[Reservation] = field(default_factory=set)  # revokes it has not answered yet
    # Closed by the receiver (no answer to a revoke or an abort, a protocol violation): the sender may be
    # alive and still putting, so what it may write is held ``settle_timeout_s`` more, not freed at once.
    forced: bool = False
    greeted: bool = False  # its Hello came (a second one closes the connection)
    # Tensor parallelism on either side: which sender rank's heads land in which of our ranks, packed per
    # run where the two split differently (tp_plan); None: one whole cache into another.
    plan: list[Piece] | None = None


class ConnIds:
    """Ids for live prefill connections, unique among them: they go in every data tag (plan.py)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._used: set[int] = set()
        self._next = 0

    def take(self) -> int | None:
        """A free id, or None when ``limit`` connections hold one."""
        if len(self._used) >= self._limit:
            return None
        while self._next in self._used:
            self._next = (self._next + 1) % self._limit
        self._used.add(self._next)
        return self._next

    def release(self, conn_id: int) -> None:
        self._used.discard(conn_id)
