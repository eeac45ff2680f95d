"""Typed messages of the KV transfer: the ticket a decode worker hands out and the control messages on a
transfer connection (a msgpack tagged union; KV data never goes through here). Pure: msgspec only.
The conversation and its rules are in docs/kv_transfer.md ("Wire protocol").
"""

from __future__ import annotations

import hashlib

import msgspec

from pdserve.kv_transfer.errors import IncompatibleError

# Bump on any change to these messages or to the tag layout (plan.py): it is part of the compatibility
# hash, so peers of different versions refuse each other at the handshake, before any data moves.
PROTOCOL_VERSION = 9


class KVCompat(msgspec.Struct, frozen=True):
    """What must match between sender and receiver for raw KV bytes to mean the same thing."""

    model_id: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def hash(self) -> str:
        """Stable hex digest of every field (msgpack of the struct, fields in declaration order)."""
        return hashlib.sha256(msgspec.msgpack.encode(self)).hexdigest()[:16]

    def describe(self) -> str:
        """Every field, for people: what a worker registers and what a refusal quotes."""
        return (
            f"{self.model_id}, {self.dtype}, {self.num_layers} layers x {self.num_kv_heads} KV heads x "
            f"{self.head_dim}, block {self.block_size}, protocol {self.protocol_version}"
        )


class TransferTicket(msgspec.Struct, frozen=True):
    """A decode worker's reservation, as the prefill worker needs it.

    ``cached_tokens``: leading prompt tokens whose KV D already holds (from its prefix cache; a multiple of
    ``block_size``): P writes none of them.
    ``block_ids``: D's blocks for the rest, in token order (token p -> block_ids[(p - cached_tokens) //
    block_size]).
    ``deadline_unix``: wall-clock time after which D frees the blocks.
    """

    address: str
    request_id: str
    transfer_id: int
    block_ids: tuple[int, ...]
    num_tokens: int
    protocol_version: int
    compat_hash: str
    deadline_unix: float
    # The receiver's count of reservations when it made this one: a connection whose handshake
    # came earlier (HelloReply.seq < seq) may put into the blocks without waiting for Accept.
    seq: int = 0
    cached_tokens: int = 0

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> TransferTicket:
        try:
            return msgspec.msgpack.decode(data, type=cls)
        except msgspec.DecodeError as exc:
            raise IncompatibleError(f"cannot decode transfer ticket: {exc}") from exc


class Hello(msgspec.Struct, frozen=True, tag="hello"):
    protocol_version: int
    compat_hash: str
    sender: str  # for logs on the receiving side
    # The cluster token's proof (auth.py): empty when the sender has no token.
    nonce: str = ""
    proof: str = ""
    rma: bool = False  # the sender can put into a registered KV tensor (RMA)
    # A tensor-parallel sender: each rank's KV heads of the model's, (start, stop). (): one process
    # holding every head.
    kv_heads: tuple[tuple[int, int], ...] = ()


class HelloReply(msgspec.Struct, frozen=True, tag="hello_reply"):
    ok: bool
    reason: str = ""
    conn_id: int = 0  # the receiver's id for this connection, in every data tag (plan.py)
    code: str = ""  # a FailureReason value when refused ("": incompatible)
    proof: str = ""  # the receiver's proof of the cluster token over the Hello's nonce (auth.py)
    rma: RemoteRegion | None = None  # offered when both sides can: where puts go
    # The receiver's reservation count now: tickets with a larger seq may be written before Accept.
    seq: int = 0
    # A tensor-parallel receiver: each rank's KV heads (as Hello's), and where puts into ranks 1.. go
    # (rank 0's is ``rma``). (): one process holding every head.
    kv_heads: tuple[tuple[int, int], ...] = ()
    rank_regions: tuple[RemoteRegion, ...] = ()


class RemoteRegion(msgspec.Struct, frozen=True):
    """The receiver's whole KV tensor (a tensor-parallel receiver: one rank's), registered with UCX for
    remote writes."""

    key: bytes  # UCX's packed remote key
    base: int  # the tensor's address in the receiver
    length: int  # bytes
    layer_bytes: int  # one layer's span of the tensor (its block count x block bytes)
    # The receiver's pid and host: a sender of the same host writes host memory by cross-memory attach
    # (writers/cma.py) and, with ``cuda_ipc`` set, device memory by CUDA IPC (writers/cuda_ipc.py)
    # instead of through UCX. 0 / "": not offered (switched off).
    pid: int = 0
    host: str = ""
    cuda_ipc: bytes = b""  # device memory: the tensor's CUDA IPC export (cuda_ipc.export)
    # Host memory in shared memory: the memfd the tensor is mapped from (offset 0 at ``base``), which a
    # sender of the same host maps and writes with plain copies (writers/shm.py); -1: not offered.
    shm_fd: int = -1


class Open(msgspec.Struct, frozen=True, tag="open"):
    transfer_id: int
    request_id: str
    segments: tuple[int, ...]  # run lengths in blocks, contiguous on both sides (plan.py)
    rma: bool = False  # data comes as puts into the blocks, not tagged messages; Complete follows a flush
    eager: bool = False  # RMA: the sender is putting already (the ticket is newer than the connection)


class Accept(msgspec.Struct, frozen=True, tag="accept"):
    """D took an RMA ``Open`` that was not eager: its blocks are bound to this connection until the
    transfer ends, so P may put into them now (and not before: a refused Open's blocks may be
    someone else's)."""

    transfer_id: int


class Complete(msgspec.Struct, frozen=True, tag="complete"):
    transfer_id: int
    first_token_id: int
    # RMA: how many layers were put (the receiver sees no data arrive, so it checks this;
    # short means lost layers, and it waits as it would for lost tagged data). -1: tagged.
    layers: int = -1
    # A request of n > 1 choices: the first tokens of choices 1.. (choice 0's is first_token_id), which
    # the decode side forks from the one prompt's KV.
    choice_token_ids: tuple[int, ...] = ()
    # Per layer, the writer's xxh3-64 of the bytes it wrote (the layer's blocks in token order,
    # kvbuf.layer_digests), which the receiver checks before the request runs. Empty: not computed.
    digests: tuple[int, ...] = ()


class Progress(msgspec.Struct, frozen=True, tag="progress"):
    """RMA: P has put ``layers`` layers so far. Sent during a transfer at most every
    ``PROGRESS_INTERVAL_S`` (handle.py), when a layer was put since the last one: a liveness signal for
    the decode side's stall watch, not a landing (only Complete, after a flush, says that)."""

    transfer_id: int
    layers: int


class CompleteAck(msgspec.Struct, frozen=True, tag="complete_ack"):
    transfer_id: int


class Abort(msgspec.Struct, frozen=True, tag="abort"):
    """Either side gives up (D also refuses an Open, or revokes an un-opened reservation, this way).

    From P, ``sent_layers`` lists layers whose data was sent. From D, ``deadline_unix`` is the
    ticket's: P refuses to open a revoked ticket until then (after it, P refuses it as expired).
    """

    transfer_id: int
    code: str  # FailureReason value
    reason: str
    sent_layers: tuple[int, ...] | None = None
    deadline_unix: float = 0.0


class AbortAck(msgspec.Struct, frozen=True, tag="abort_ack"):
    transfer_id: int
    sent_layers: tuple[int, ...]


Message = Hello | HelloReply | Open | Accept | Progress | Complete | CompleteAck | Abort | AbortAck

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode_message(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode_message(data: bytes | bytearray | memoryview) -> Message:
    return _decoder.decode(data)
