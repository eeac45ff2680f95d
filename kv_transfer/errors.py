"""Why a transfer failed, as exception types. Pure: no torch, no ucxx. A :class:`TransferError`'s
``reason`` also labels ``pdserve_kv_transfer_failures_total`` and travels in ``Abort``, so both sides report
the same cause.
"""

from __future__ import annotations

from enum import StrEnum


class FailureReason(StrEnum):
    ABORTED = "aborted"  # a side gave up on purpose (client cancel, prefill error)
    DEADLINE = "deadline"  # the per-transfer deadline passed
    PEER_DIED = "peer_died"  # the connection broke (process killed, network gone)
    INCOMPATIBLE = "incompatible"  # protocol version or KV layout differ
    REJECTED = "rejected"  # the receiver does not know the transfer (expired, unknown id)
    UNAUTHENTICATED = "unauthenticated"  # a side did not prove the cluster token (auth.py)
    TRANSPORT = "transport"  # any other transport error
    CHECKSUM = "checksum"  # the landed KV does not match the writer's digest (wire.Complete.digests)


class TransferError(RuntimeError):
    reason: FailureReason = FailureReason.TRANSPORT


class AbortedError(TransferError):
    reason = FailureReason.ABORTED


class DeadlineError(TransferError):
    reason = FailureReason.DEADLINE


class PeerDiedError(TransferError):
    reason = FailureReason.PEER_DIED


class IncompatibleError(TransferError):
    reason = FailureReason.INCOMPATIBLE


class RejectedError(TransferError):
    reason = FailureReason.REJECTED


class UnauthenticatedError(TransferError):
    reason = FailureReason.UNAUTHENTICATED


class ChecksumError(TransferError):
    reason = FailureReason.CHECKSUM


_BY_REASON: dict[FailureReason, type[TransferError]] = {
    FailureReason.ABORTED: AbortedError,
    FailureReason.DEADLINE: DeadlineError,
    FailureReason.PEER_DIED: PeerDiedError,
    FailureReason.INCOMPATIBLE: IncompatibleError,
    FailureReason.REJECTED: RejectedError,
    FailureReason.UNAUTHENTICATED: UnauthenticatedError,
    FailureReason.TRANSPORT: TransferError,
    FailureReason.CHECKSUM: ChecksumError,
}


def error_for(reason: FailureReason | str, message: str) -> TransferError:
    """The exception a peer's reason code stands for (unknown codes become plain TransferError)."""
    try:
        cls = _BY_REASON[FailureReason(reason)]
    except ValueError:
        cls = TransferError
    return cls(message)
