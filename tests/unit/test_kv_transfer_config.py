"""UCX defaults pdserve fills in, and the choice between puts and tagged messages over tcp."""

from __future__ import annotations

import pytest

from pdserve.kv_transfer.config import (
    PUTS_OVER_TCP_MIN_SEGMENT,
    TransferConfig,
    apply_ucx_env,
    puts_over_tcp,
    tcp_segment_bytes,
)


def test_apply_ucx_env_sets_64k_tcp_segments_unless_the_environment_has_its_own():
    env: dict[str, str] = {}
    apply_ucx_env(TransferConfig(interface="lo"), env)
    assert env["UCX_TCP_TX_SEG_SIZE"] == "64K" and env["UCX_NET_DEVICES"] == "lo"
    assert tcp_segment_bytes(env) == PUTS_OVER_TCP_MIN_SEGMENT
    own = {"UCX_TCP_TX_SEG_SIZE": "8k"}
    apply_ucx_env(TransferConfig(interface="lo"), own)
    assert own["UCX_TCP_TX_SEG_SIZE"] == "8k"  # the operator's value stands


def test_a_smaller_receive_segment_keeps_ucx_send_default():
    """UCX refuses a tcp interface whose receive segments are smaller than its send segments ("RX
    segment size must be >= TX segment size"): 64 KB sends would break an operator's 8 KB receives."""
    small_rx = {"UCX_TCP_RX_SEG_SIZE": "8K"}
    apply_ucx_env(TransferConfig(interface="lo"), small_rx)
    assert "UCX_TCP_TX_SEG_SIZE" not in small_rx and not puts_over_tcp(TransferConfig(), small_rx)
    big_rx = {"UCX_TCP_RX_SEG_SIZE": "256K"}
    apply_ucx_env(TransferConfig(interface="lo"), big_rx)
    assert big_rx["UCX_TCP_TX_SEG_SIZE"] == "64K"
    assert tcp_segment_bytes({}, "UCX_TCP_RX_SEG_SIZE") == 64 << 10  # UCX's own receive default


@pytest.mark.parametrize(
    ("value", "nbytes"),
    [("65536", 65536), ("64K", 65536), ("64kb", 65536), (" 1m ", 1 << 20), ("128KB", 128 << 10)],
)
def test_tcp_segment_bytes_reads_ucx_memory_units(value: str, nbytes: int):
    assert tcp_segment_bytes({"UCX_TCP_TX_SEG_SIZE": value}) == nbytes


@pytest.mark.parametrize("value", [None, "", "auto", "64 parsecs", "-1"])
def test_tcp_segment_bytes_falls_back_to_ucx_default(value: str | None):
    env = {} if value is None else {"UCX_TCP_TX_SEG_SIZE": value}
    assert tcp_segment_bytes(env) == 8 << 10


def test_puts_over_tcp_auto_follows_the_segment_size_and_an_explicit_choice_wins():
    auto, on, off = TransferConfig(), TransferConfig(rma_over_tcp=True), TransferConfig(rma_over_tcp=False)
    big, small = {"UCX_TCP_TX_SEG_SIZE": "64K"}, {"UCX_TCP_TX_SEG_SIZE": "8K"}
    assert auto.rma_over_tcp is None
    assert puts_over_tcp(auto, big) and not puts_over_tcp(auto, small) and not puts_over_tcp(auto, {})
    assert puts_over_tcp(on, small) and not puts_over_tcp(off, big)
