"""A default `pdserve up` listens on loopback only.

The router, both workers' gRPC and /metrics, the OpenAI front and the KV transfer: UCX gets no listener
(peers connect to a worker address from the ticket), and its TCP transport listens only on the
interface of the worker's ``--host`` (``UCX_NET_DEVICES=lo``). The sockets are listed after a request
crossed the KV transfer, so both workers' UCX is up. The cluster serves the tiny served model.
"""

from __future__ import annotations

import ipaddress
import urllib.request

import psutil
import pytest

from pdserve.deploy.local import cluster
from pdserve.proto import generation_pb2
from tests.e2e.cluster_harness import free_port, generate, running_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket listening, and every unconnected UDP socket bound, in the
    process ``pid`` and its children."""
    out: set[tuple[str, int]] = set()
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        for conn in proc.net_connections(kind="inet"):
            tcp_listen = conn.status == psutil.CONN_LISTEN
            udp_bound = conn.type == psutil.socket.SOCK_DGRAM and not conn.raddr
            if tcp_listen or udp_bound:
                out.add((conn.laddr.ip, conn.laddr.port))
    return out


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    mapped = getattr(ip, "ipv4_mapped", None)  # gRPC binds 127.0.0.1 as ::ffff:127.0.0.1 on a v6 socket
    return (mapped or ip).is_loopback


def metric(url: str, name: str) -> float:
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in body.splitlines() if line.startswith(name + "{"))


def test_a_default_cluster_listens_on_loopback_only(tmp_path, tiny_served_model):
    # Threshold 1: the prompt crosses the KV transfer (the prefill side starts UCX on its first one).
    # A generous heartbeat timeout: on a starved machine a prefill worker dropped for missed heartbeats
    # sends the prompt to the decode worker, and nothing crosses the KV transfer.
    extra = ("--local-prefill-threshold", "1", "--http-port", str(free_port()), "--heartbeat-timeout", "15")
    cluster_up = running_cluster(tmp_path, prefill=1, decode=1, model=tiny_served_model, extra=extra)
    with cluster_up as c, c.channel() as ch:
        req = generation_pb2.GenerateRequest(
            prompt="Why is the sky blue? " * 20, sampling=generation_pb2.SamplingParams(max_tokens=4)
        )
        ids, _, reason, _ = generate(c.stub(ch), req, timeout=120)
        assert ids and reason == "length"
        workers = {w["role"]: w for w in c.workers()}
        moved = metric(workers["decode"]["metrics_url"], "pdserve_kv_transfer_bytes_total")
        assert moved > 0, "the request did not cross the KV transfer"

        state = cluster.load_state(c.state_dir)
        assert state is not None
        procs = {"router": state.router.pid} | {w.id: w.pid for w in state.workers}
        sockets = {name: listening(pid) for name, pid in procs.items()}
        for name, addrs in sockets.items():
            assert addrs, f"{name} listens on nothing: the listing is broken"
            beyond = [a for a in addrs if not is_loopback(a[0])]
            assert not beyond, f"{name} (pid {procs[name]}) listens beyond loopback: {beyond}"
        # Each worker listens on its gRPC port, its /metrics port and UCX's TCP transport (on lo).
        for w in state.workers:
            assert len(sockets[w.id]) >= 3, (w.id, sockets[w.id])
        c.assert_no_leaks()
