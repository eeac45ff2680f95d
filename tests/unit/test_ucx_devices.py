"""The UCX network devices a worker uses follow its host, or the operator's setting."""

from __future__ import annotations

import pytest

from pdserve.kv_transfer.config import TransferConfig, ucx_net_devices
from pdserve.kv_transfer.netif import interfaces_for_host


def test_ucx_devices_follow_host_or_the_operator(monkeypatch):
    loopback = interfaces_for_host("127.0.0.1")
    assert loopback and interfaces_for_host("localhost") == loopback
    assert interfaces_for_host("0.0.0.0") is None  # every interface: UCX's default
    env: dict[str, str] = {}
    assert ucx_net_devices(TransferConfig(), env) == loopback
    assert ucx_net_devices(TransferConfig(interface="eth7"), env) == "eth7"
    assert ucx_net_devices(TransferConfig(interface="all"), {"UCX_NET_DEVICES": "eth0"}) is None
    assert ucx_net_devices(TransferConfig(), {"UCX_NET_DEVICES": "mlx5_0:1"}) == "mlx5_0:1"
    with pytest.raises(ValueError, match="kv-interface"):
        interfaces_for_host("203.0.113.77")  # TEST-NET-3: no interface here carries it
