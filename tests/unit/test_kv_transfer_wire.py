"""Pure parts of kv_transfer: wire messages, tickets, the segment plan, tags, config."""

from __future__ import annotations

import msgspec
import pytest

from pdserve.kv_transfer import wire
from pdserve.kv_transfer.config import FaultConfig, TransferConfig
from pdserve.kv_transfer.errors import (
    AbortedError,
    DeadlineError,
    FailureReason,
    IncompatibleError,
    TransferError,
    error_for,
)
from pdserve.kv_transfer.plan import build_segments, data_tag, layer_tag, segment_lengths, split_tag, tag_base

COMPAT = wire.KVCompat("smollm2-135m", "bfloat16", 30, 3, 64, 16)


def test_ticket_roundtrip_and_garbage() -> None:
    ticket = wire.TransferTicket(
        address="ucx://10.0.0.7:4000",
        request_id="req-1",
        transfer_id=12345,
        block_ids=(5, 6, 9),
        num_tokens=40,
        protocol_version=wire.PROTOCOL_VERSION,
        compat_hash=COMPAT.hash(),
        deadline_unix=1.7e9,
    )
    data = ticket.encode()
    assert isinstance(data, bytes)
    assert wire.TransferTicket.decode(data) == ticket
    with pytest.raises(IncompatibleError, match="cannot decode"):
        wire.TransferTicket.decode(b"\x93not a ticket")


def test_compat_hash_covers_every_field() -> None:
    seen = {COMPAT.hash()}
    for change in (
        {"model_id": "other"},
        {"dtype": "float32"},
        {"num_layers": 31},
        {"num_kv_heads": 4},
        {"head_dim": 128},
        {"block_size": 32},
        {"protocol_version": wire.PROTOCOL_VERSION + 1},
    ):
        seen.add(msgspec.structs.replace(COMPAT, **change).hash())
    assert len(seen) == 8
    assert COMPAT.hash() == wire.KVCompat("smollm2-135m", "bfloat16", 30, 3, 64, 16).hash()
    with pytest.raises(ValueError):
        wire.KVCompat("m", "bfloat16", 0, 3, 64, 16)


def test_control_messages_roundtrip() -> None:
    msgs: list[wire.Message] = [
        wire.Hello(1, "abc", "p0"),
        wire.HelloReply(False, "hash differs"),
        wire.HelloReply(True, "", 200),
        wire.Open(7, "r", (3, 1, 2)),
        wire.Progress(7, 12),
        wire.Complete(7, 42),
        wire.Complete(7, 42, 30, (), (0, 2**64 - 1, 12345)),  # every layer's digest (xxh3-64)
        wire.CompleteAck(7),
        wire.Abort(7, "aborted", "client went away", (0, 1, 2)),
        wire.Abort(7, "deadline", "late"),
        wire.AbortAck(7, ()),
    ]
    for msg in msgs:
        assert wire.decode_message(wire.encode_message(msg)) == msg
    with pytest.raises(msgspec.DecodeError):
        wire.decode_message(b"\x81\xa1t\xa5bogus")


def test_error_codes_map_to_classes() -> None:
    assert isinstance(error_for("aborted", "x"), AbortedError)
    assert isinstance(error_for(FailureReason.DEADLINE, "x"), DeadlineError)
    unknown = error_for("from-the-future", "x")
    assert type(unknown) is TransferError and unknown.reason is FailureReason.TRANSPORT
    for reason in FailureReason:
        assert error_for(reason.value, "m").reason is reason


def test_segments_contiguous_scattered_mixed() -> None:
    assert segment_lengths(range(10, 20), range(0, 10)) == (10,)
    assert segment_lengths([0, 2, 4], [1, 2, 3]) == (1, 1, 1)
    # Runs must be consecutive on both sides at once.
    src = [4, 5, 6, 7, 10, 11]
    dst = [0, 1, 8, 9, 10, 11]
    assert segment_lengths(src, dst) == (2, 2, 2)
    segs = build_segments((2, 2, 2), src, dst)
    assert [(s.src_start, s.dst_start, s.num_blocks) for s in segs] == [(4, 0, 2), (6, 8, 2), (10, 10, 2)]
    # The receiver knows only its side.
    assert [s.dst_start for s in build_segments((2, 2, 2), None, dst)] == [0, 8, 10]
    assert segment_lengths([], []) == ()
    with pytest.raises(ValueError):
        segment_lengths([1, 2], [1])


def test_build_segments_rejects_bad_plans() -> None:
    with pytest.raises(ValueError, match="do not cover"):
        build_segments((2,), None, [0, 1, 2])
    with pytest.raises(ValueError, match="receiving side"):
        build_segments((2,), None, [0, 2])
    with pytest.raises(ValueError, match="sending side"):
        build_segments((2,), [0, 5], [0, 1])
    with pytest.raises(ValueError):
        build_segments((0, 2), None, [0, 1])


def test_tags_roundtrip_and_ranges() -> None:
    for xid, layer, seg, conn in [(1, 0, 0, 0), ((1 << 31) - 1, 255, (1 << 16) - 1, 255), (77, 29, 3, 5)]:
        tag = data_tag(xid, layer, seg, conn)
        assert tag >> 63 == 1
        assert split_tag(tag) == (xid, layer, seg, conn)
        assert tag_base(xid, conn) | layer_tag(layer, seg) == tag
    # Every field tells messages apart, the sending connection included.
    tags = {data_tag(1, 0, 1, 0), data_tag(1, 1, 0, 0), data_tag(2, 0, 0, 0), data_tag(1, 0, 1, 1)}
    assert len(tags) == 4
    for bad in [(1 << 31, 0, 0, 0), (1, 256, 0, 0), (1, 0, 1 << 16, 0), (-1, 0, 0, 0), (1, 0, 0, 256)]:
        with pytest.raises(ValueError):
            data_tag(*bad)


def test_config_validates() -> None:
    assert TransferConfig(backend="inproc").backend.value == "inproc"
    for bad in ({"interface": "eth0; rm -rf"}, {"deadline_s": 0}, {"settle_timeout_s": -1}, {"host": ""}):
        with pytest.raises(ValueError):
            TransferConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        TransferConfig(backend="carrier-pigeon")  # type: ignore[arg-type]
    faults = FaultConfig(delay_s=0.5, delay_layers=frozenset({3}))
    assert faults.delay_for(3) == 0.5 and faults.delay_for(4) == 0.0
    assert FaultConfig(delay_s=0.1).delay_for(9) == 0.1
    assert not FaultConfig().active
    with pytest.raises(ValueError):
        FaultConfig(delay_s=-1)
