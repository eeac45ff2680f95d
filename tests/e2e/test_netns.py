"""Several hosts on one machine: the router, a prefill worker and two decode workers, each in its own
network namespace, joined by veth pairs on a bridge (10.77.N.0/24), with their loopback interfaces left
down, so nothing can lean on 127.0.0.1.

What it shows: workers register with the router across the "network" at their own addresses; a
prompt prefilled on one host moves its KV cache to a decode worker on another over UCX's TCP transport
(UCX_TLS=tcp: no shared memory between the namespaces; one decode worker finds its device from --host,
the other is given --kv-interface); and a decode worker whose link goes down mid-stream is treated like
a dead one: its streams move to the other decode worker and finish with exactly the undisturbed tokens.
Once the link is back, the cut-off worker holds no KV blocks either.

The workers serve the tiny served model: what crosses the "network" is checked, not the model.

It skips, saying why, where namespaces cannot be made (not root, no `ip`, no netns support). The
fixture removes every namespace, veth and the bridge, and kills whatever still runs in the namespaces,
whatever happens in the test.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdserve.deploy.local import cluster
from pdserve.proto import generation_pb2, generation_pb2_grpc
from pdserve.worker.role import Role
from tests.e2e.cluster_harness import Cluster, ThreadedStreams, generate, metric_sum, worker_load

pytestmark = pytest.mark.slow

HOSTS = ("router", "prefill", "decode_a", "decode_b")
ROUTER_PORT = 50051
MAX_TOKENS = 48
# The run whose link is cut streams longer, so that the cut lands mid-stream on a fast machine too (the
# victim is picked by asking the workers at once; a tiny-model token takes milliseconds); greedy, so all
# its tokens are the undisturbed run's (which streams as many).
CUT_RUN_TOKENS = 1500


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


def _why_no_netns() -> str | None:
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"pdprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass(frozen=True)
class Host:
    ns: str
    address: str
    iface: str  # the veth end inside the namespace


@dataclass(frozen=True)
class Net:
    hosts: dict[str, Host]

    def link(self, name: str, up: bool) -> None:
        h = self.hosts[name]
        _ip("-n", h.ns, "link", "set", h.iface, "up" if up else "down")


def _kill_namespace_processes(ns: str) -> None:
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), 9)
        except (ProcessLookupError, ValueError):
            pass


@pytest.fixture
def netns() -> Iterator[Net]:
    reason = _why_no_netns()
    if reason:
        pytest.skip(reason)
    tag = str(os.getpid() % 100000)
    subnet = f"10.77.{os.getpid() % 200 + 20}"
    bridge = f"pdbr{tag}"
    hosts = {
        name: Host(ns=f"pd{tag}-{name}", address=f"{subnet}.{i + 1}", iface=f"pdv{tag}n{i}")
        for i, name in enumerate(HOSTS)
    }
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{subnet}.254/24", "dev", bridge)  # the test's own view of the "network"
        _ip("link", "set", bridge, "up")
        for i, h in enumerate(hosts.values()):
            outside = f"pdv{tag}h{i}"
            _ip("netns", "add", h.ns)
            _ip("link", "add", outside, "type", "veth", "peer", "name", h.iface)
            _ip("link", "set", h.iface, "netns", h.ns)
            _ip("link", "set", outside, "master", bridge)
            _ip("link", "set", outside, "up")
            _ip("-n", h.ns, "addr", "add", f"{h.address}/24", "dev", h.iface)
            _ip("-n", h.ns, "link", "set", h.iface, "up")  # lo stays down: no loopback to lean on
        yield Net(hosts)
    finally:
        for i, h in enumerate(hosts.values()):
            _kill_namespace_processes(h.ns)
            _ip("link", "del", f"pdv{tag}h{i}", check=False)  # takes its peer in the namespace with it
            _ip("netns", "del", h.ns, check=False)
        _ip("link", "del", bridge, check=False)


def _spawn(net: Net, state_dir: Path, name: str, args: list[str], role: Role | None) -> cluster.ProcessEntry:
    env = cluster.child_env(1)
    env["UCX_TLS"] = "tcp"  # hosts apart share no memory: the KV cache crosses the veth pairs
    argv = ["ip", "netns", "exec", net.hosts[name].ns, sys.executable, "-m", "pdserve.cli", *args]
    # `ip netns exec` execs the command: the pid is the pdserve process itself.
    return cluster.spawn(name, argv, state_dir / "logs" / f"{name}.log", env, role)


def _start(net: Net, state_dir: Path, model: Path) -> cluster.ClusterState:
    r = net.hosts["router"].address
    router_addr = f"{r}:{ROUTER_PORT}"
    router = _spawn(
        net, state_dir, "router",
        ["router", "--host", r, "--port", str(ROUTER_PORT), "--local-prefill-threshold", "1",
         "--max-migrations", "3", "--heartbeat-timeout", "10", "--no-rebalance"],
        None,
    )  # fmt: skip
    common = [
        "--router",
        router_addr,
        "--port",
        "0",
        "--dtype",
        "float32",
        "--threads",
        "1",
        "--kv-cache-mib",
        "64",
        "--model",
        str(model),
    ]
    workers = []
    for name, role in (("prefill", Role.PREFILL), ("decode_a", Role.DECODE), ("decode_b", Role.DECODE)):
        h = net.hosts[name]
        # Namespaces share one kernel: without --no-kv-cross-memory the KV would skip the network.
        args = [
            "worker",
            "--role",
            role.value,
            "--host",
            h.address,
            "--worker-id",
            name,
            "--no-kv-cross-memory",
            *common,
        ]
        if name == "decode_b":
            args += ["--kv-interface", h.iface]  # the other one derives it from --host
        if role is Role.DECODE:
            # Steps of 4 ms at least: at the cut the victim has seconds of its streams left, which a fast
            # tiny-model step and a client slowed by a loaded host had let it finish around the cut.
            args += ["--fault-step-delay", "0.004"]
        workers.append(_spawn(net, state_dir, name, args, role))
    state = cluster.ClusterState(
        router_address=router_addr, router=router, model=str(model), dtype="float32",
        threads=1, host=r, workers=tuple(workers),
    )  # fmt: skip
    cluster.save_state(state_dir, state)  # the harness's Cluster (status, leak check) reads it
    return state


def _request(i: int, n: int, max_tokens: int = MAX_TOKENS) -> generation_pb2.GenerateRequest:
    r = generation_pb2.GenerateRequest(
        request_id=f"ns-{i}-{time.monotonic_ns()}",
        prompt_token_ids=generation_pb2.TokenIds(
            ids=[100 + (i * 7919 + k * 104729) % 39000 for k in range(n)]
        ),
    )
    r.sampling.max_tokens = max_tokens
    r.sampling.temperature = 0.0
    r.sampling.ignore_eos = True
    return r


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    prefix = name if "{" in name else name + "{"  # a name, or a name and its first labels
    return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(prefix))


def _blocks_used(address: str) -> int:
    return worker_load(address).kv_blocks_used


def test_router_and_workers_in_separate_namespaces(tmp_path, netns, tiny_served_model):
    state_dir = tmp_path / "cluster"
    state = _start(netns, state_dir, tiny_served_model)
    try:
        cluster.wait_ready(state, {"prefill", "decode_a", "decode_b"}, timeout_s=120)
        c = Cluster(state_dir, state.router_address)
        by_id = {w["id"]: w for w in c.workers()}
        for name in ("prefill", "decode_a", "decode_b"):  # registered at their own hosts' addresses
            assert by_id[name]["address"].startswith(netns.hosts[name].address + ":"), by_id[name]
        reqs = [_request(i, 64 + 24 * i, CUT_RUN_TOKENS) for i in range(4)]
        with c.channel() as ch, cf.ThreadPoolExecutor(len(reqs)) as pool:
            # Undisturbed: each prefilled on one host, decoded on another.
            stub = generation_pb2_grpc.GenerationStub(ch)
            runs = {r.request_id: pool.submit(generate, stub, r, 120) for r in reqs}
            want = {rid: f.result()[0] for rid, f in runs.items()}
        assert all(len(ids) == CUT_RUN_TOKENS for ids in want.values())
        moved = {n: _metric(by_id[n]["metrics_url"], "pdserve_kv_transfer_bytes_total") for n in by_id}
        # A prefill worker whose heartbeat a loaded host starved would send these to local prefill instead
        # (the 10 s heartbeat timeout above); the router's routes say which it was.
        remote = _metric(c.status()["router"]["metrics_url"], 'pdserve_router_routes_total{reason="remote"')
        assert moved["decode_a"] > 0 and moved["decode_b"] > 0, f"KV bytes over the veths: {moved}, {remote=}"
        # Every UCX lane is tcp, with pdserve's 64 KB segments: one-sided puts (--kv-puts auto).
        puts = _metric(by_id["prefill"]["metrics_url"], 'pdserve_kv_transfer_opened_total{path="puts"')
        assert puts == _metric(by_id["prefill"]["metrics_url"], "pdserve_kv_transfer_opened_total") > 0

        # Now all four at once (new ids); cut the link of the decode worker streaming most of them.
        again = []
        for r in reqs:
            a = generation_pb2.GenerateRequest()
            a.CopyFrom(r)
            a.request_id = r.request_id + "-again"
            again.append(a)
        with c.channel() as ch:
            streams = ThreadedStreams(generation_pb2_grpc.GenerationStub(ch), again, after=4, timeout=120)
            assert streams.wait_streaming(90)
            # Asked of the decode workers themselves (milliseconds), not of the router's heartbeat view
            # through the CLI (a second or more): on a fast CPU the victim's streams ended in between.
            busy = {n: worker_load(by_id[n]["address"]).running for n in ("decode_a", "decode_b")}
            victim = max(busy, key=lambda k: busy[k])
            assert busy[victim] > 0, busy
            netns.link(victim, up=False)
            cut_at = time.monotonic()
            streams.join(120)
            resumed_s = time.monotonic() - cut_at
        assert not streams.errors, streams.errors
        for a, r in zip(again, reqs, strict=True):
            got = streams.got[a.request_id]  # no gap, no duplicate
            assert len(got) == CUT_RUN_TOKENS and got == want[r.request_id], a.request_id
        router_metrics = c.status()["router"]["metrics_url"]
        migrations = _metric(router_metrics, "pdserve_router_migrations_total")
        moved_live = metric_sum(router_metrics, "pdserve_router_live_moves_total", outcome="moved")
        assert migrations >= 1, f"the cut-off worker's streams were not migrated ({busy=}, {moved_live=})"
        assert resumed_s < 60, resumed_s

        netns.link(victim, up=True)  # the cut-off worker frees what it held once it can hear again
        deadline = time.monotonic() + 20
        while _blocks_used(by_id[victim]["address"]) and time.monotonic() < deadline:
            time.sleep(0.25)
        assert _blocks_used(by_id[victim]["address"]) == 0
        with c.channel() as ch:
            ids, _, reason, _ = generate(generation_pb2_grpc.GenerationStub(ch), _request(9, 80), timeout=60)
        assert reason == "length" and len(ids) == MAX_TOKENS
        c.assert_no_leaks(timeout_s=10)
    finally:
        cluster.stop_processes([state.router, *state.workers], term_timeout_s=3.0)
