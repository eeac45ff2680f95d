"""Real local clusters for integration tests: `pdserve up` in a temporary state dir, always torn down.

Every cluster a test starts is stopped by the context manager, even when the
test fails (``pdserve down``, then SIGKILL of anything the state file still
lists). ``assert_no_leaks`` is the leak check every such test ends with: the router has no request
running or waiting, and every worker reports zero KV blocks used and nothing running, each expected
worker among them (checked over a few heartbeats, bounded).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from pdserve.deploy.local import cluster
from pdserve.proto import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.worker.auth import token_metadata
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll a condition (bounded: a failure bound, not a latency check)."""
    give_up = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def pdserve(*args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=check,
        stdin=subprocess.DEVNULL,
    )


@dataclass
class Cluster:
    state_dir: Path
    address: str

    def status(self) -> dict:
        out = pdserve("status", "--json", "--state-dir", str(self.state_dir), timeout=30)
        return json.loads(out.stdout)

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)

    def stub(self, channel: grpc.Channel) -> generation_pb2_grpc.GenerationStub:
        return generation_pb2_grpc.GenerationStub(channel)

    def workers(self) -> list[dict]:
        return self.status()["workers"]

    def token_metadata(self) -> tuple[tuple[str, str], ...]:
        """What a direct call to a worker must carry: `up` gave the cluster a token."""
        state = cluster.load_state(self.state_dir)
        assert state is not None
        return token_metadata(cluster.state_token(state))

    def worker_pid(self, worker_id: str) -> int:
        state = cluster.load_state(self.state_dir)
        assert state is not None
        for w in state.workers:
            if w.id == worker_id:
                return w.pid
        raise KeyError(worker_id)

    def assert_workers_idle_direct(self, timeout_s: float) -> float:
        """Ask every worker itself (Worker.GetLoad: no heartbeat lag) until all report 0 KV blocks used.

        Returns the seconds it took; fails after ``timeout_s``.
        """
        from pdserve.proto import worker_pb2, worker_pb2_grpc

        addresses = {w["id"]: w["address"] for w in self.workers()}
        t0 = time.monotonic()
        while True:
            used = {}
            for wid, addr in addresses.items():
                with grpc.insecure_channel(addr) as ch:
                    load = worker_pb2_grpc.WorkerStub(ch).GetLoad(
                        worker_pb2.Empty(), timeout=5, metadata=self.token_metadata()
                    )
                used[wid] = load.kv_blocks_used
            elapsed = time.monotonic() - t0
            if all(v == 0 for v in used.values()):
                return elapsed
            if elapsed > timeout_s:
                raise AssertionError(f"KV blocks still used after {timeout_s}s: {used}")
            time.sleep(0.05)

    def live_workers(self) -> list[str]:
        """The ids of the workers the state file lists whose processes still run."""
        state = cluster.load_state(self.state_dir)
        assert state is not None, f"no cluster state in {self.state_dir}"
        return [w.id for w in state.workers if cluster.alive(w)]

    def assert_no_leaks(self, timeout_s: float = 5.0, workers: Collection[str] | None = None) -> None:
        """Nothing left in flight anywhere (heartbeats lag, so poll, bounded): the router runs and queues
        no request, every worker it lists runs nothing and holds 0 KV blocks, and every expected worker is
        among them. Expected: ``workers`` when given (each must also still run), else every worker the
        state file lists as running; an empty list fails (a check of no worker checks nothing)."""
        if workers is None:
            expected = self.live_workers()
        else:
            expected = list(workers)
            live = set(self.live_workers())
            dead = [w for w in expected if w not in live]
            assert not dead, f"expected workers not running (per {self.state_dir}): {dead}"
        assert expected, f"no live worker to check for leaks in {self.state_dir}"
        deadline = time.monotonic() + timeout_s
        while True:
            doc = self.status()
            ws, router = doc["workers"], doc["router"]
            used = {w["id"]: w["kv_blocks_used"] for w in ws}
            running = {w["id"]: w["running"] for w in ws}
            missing = sorted(set(expected) - set(used))
            in_router = {k: router[k] for k in ("requests_running", "requests_waiting")}
            for r in doc.get("routers", []):  # (every router of a cluster of several)
                if r["alive"]:
                    in_router[f"{r['address']} requests_running"] = r["requests_running"]
            if (
                not missing
                and all(v == 0 for v in used.values())
                and all(v == 0 for v in running.values())
                and all(v == 0 for v in in_router.values())
            ):
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"leaks after {timeout_s}s: KV blocks used {used}, running {running}, "
                    f"router {in_router}, expected workers missing from the router {missing}"
                )
            time.sleep(0.25)


@contextlib.contextmanager
def running_cluster(
    tmp_path: Path,
    *,
    prefill: int = 0,
    decode: int = 0,
    colocated: int = 0,
    dtype: str = "float32",
    model: Path | None = None,
    extra: tuple[str, ...] = (),
) -> Iterator[Cluster]:
    """`pdserve up` of the shape given in a state dir under ``tmp_path``, stopped when the block ends.
    ``model``: a model directory to serve (``tiny_served_model``, for tests of serving mechanics) instead
    of the default model, with a 64 MiB KV cache per worker unless ``extra`` says otherwise (the default
    size holds ~87,000 of the tiny model's blocks, seconds to allocate)."""
    state_dir = tmp_path / f"cluster-{prefill}p{decode}d{colocated}c"
    port = free_port()
    args = [
        "up",
        "--prefill",
        str(prefill),
        "--decode",
        str(decode),
        "--colocated",
        str(colocated),
        "--dtype",
        dtype,
        "--port",
        str(port),
        "--state-dir",
        str(state_dir),
        *(("--model", str(model), "--kv-cache-mib", "64") if model is not None else ()),
        # The OpenAI front is on by default (port 8000): a free port, unless the test chose.
        *(() if {"--http-port", "--no-http"} & set(extra) else ("--http-port", "0")),
        *extra,
    ]
    try:
        pdserve(*args, timeout=300)
        yield Cluster(state_dir, f"127.0.0.1:{port}")
    except subprocess.CalledProcessError as e:
        raise AssertionError(f"pdserve up failed:\n{e.stdout}\n{e.stderr}") from e
    finally:
        stop_cluster(state_dir)


def fake_state(
    router: cluster.ProcessEntry, workers: tuple[cluster.ProcessEntry, ...] = (), next_index: int = 1
) -> cluster.ClusterState:
    """A cluster's state file as ``up`` writes it, for the processes given (tests of the CLI and harness)."""
    return cluster.ClusterState(
        router_address="127.0.0.1:1",
        router=router,
        model="m",
        dtype="float32",
        threads=1,
        host="127.0.0.1",
        workers=workers,
        next_index=next_index,
    )


def stop_cluster(state_dir: Path) -> None:
    """``pdserve down``, then a stop (SIGTERM, SIGKILL) of anything the state file still lists, then of
    any process still carrying this state dir's mark (an ``up`` that failed or was cut before it wrote
    them down). Without a state file or a marked process there is nothing to stop: no ``down`` runs."""
    if cluster.state_path(state_dir).exists() or cluster.marked_processes(state_dir):
        with contextlib.suppress(Exception):
            pdserve("down", "--state-dir", str(state_dir), "--timeout", "20", timeout=60, check=False)
    with contextlib.suppress(cluster.ClusterError):  # (a broken state file: the mark finds them below)
        cluster.stop_survivors(state_dir, term_timeout_s=0.5)
    cluster.stop_processes(cluster.marked_processes(state_dir), term_timeout_s=0.5)


def generate(
    stub, request: generation_pb2.GenerateRequest, timeout: float = 300
) -> tuple[list[int], str, str, list]:
    """Run one Generate stream; returns (token ids, text, finish_reason, messages)."""
    ids: list[int] = []
    text = []
    reason = ""
    msgs = []
    for m in stub.Generate(request, timeout=timeout):
        msgs.append((time.time(), m))
        ids.extend(m.token_ids)
        text.append(m.text)
        if m.finish_reason:
            reason = m.finish_reason
    return ids, "".join(text), reason, msgs


class ThreadedStreams:
    """Generate streams run in threads, for tests that break something while they stream.

    ``streaming[id]`` is set once that stream has ``after`` tokens (or failed); ``got[id]`` holds its
    token ids once it ended; ``errors`` what any stream raised; ``at[id]`` the time.monotonic() of each
    of its messages.
    """

    def __init__(self, stub, reqs, *, after: int, timeout: float = 180) -> None:
        import threading

        self.got: dict[str, list[int]] = {}
        self.errors: list[BaseException] = []
        self.at: dict[str, list[float]] = {r.request_id: [] for r in reqs}
        self.streaming = {r.request_id: threading.Event() for r in reqs}
        self._threads = [threading.Thread(target=self._run, args=(stub, r, after, timeout)) for r in reqs]
        for t in self._threads:
            t.start()

    def _run(self, stub, r, after: int, timeout: float) -> None:
        ids: list[int] = []
        try:
            for m in stub.Generate(r, timeout=timeout):
                self.at[r.request_id].append(time.monotonic())
                ids.extend(m.token_ids)
                if len(ids) >= after:
                    self.streaming[r.request_id].set()
            self.got[r.request_id] = ids
        except BaseException as e:  # noqa: BLE001 - the test reports it
            self.errors.append(e)
            self.streaming[r.request_id].set()

    def wait_streaming(self, timeout: float) -> bool:
        """True once every stream has its ``after`` tokens (or failed) within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        return all(e.wait(max(deadline - time.monotonic(), 0)) for e in self.streaming.values())

    def join(self, timeout: float) -> None:
        for t in self._threads:
            t.join(timeout)


def worker_load(address: str, metadata: tuple[tuple[str, str], ...] = ()) -> worker_pb2.WorkerLoad:
    """A worker's load asked of the worker itself (GetLoad, milliseconds): what it runs and holds now,
    where the router's view lags a heartbeat and ``Cluster.status`` adds a CLI process start (a second
    or more, in which a fast CPU finishes a short stream)."""
    with grpc.insecure_channel(address) as ch:
        return worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.Empty(), timeout=5, metadata=metadata)


def metric_sum(url: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus metric's samples at ``url`` whose labels include ``labels``."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def run_all(address: str, reqs) -> dict[str, tuple[list[int], str, str]]:
    """All requests concurrently (one thread each); returns id -> (tokens, text, finish_reason)."""
    import concurrent.futures as cf

    with grpc.insecure_channel(address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        with cf.ThreadPoolExecutor(len(reqs)) as pool:
            futs = {r.request_id: pool.submit(generate, stub, r) for r in reqs}
            return {rid: f.result()[:3] for rid, f in futs.items()}


def migrations(c: Cluster) -> dict[str, float]:
    """The router's pdserve_router_migrations_total by reason."""
    import urllib.request

    with urllib.request.urlopen(c.status()["router"]["metrics_url"], timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("pdserve_router_migrations_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


@contextlib.contextmanager
def streaming(c: Cluster, reqs, after: int = 1, timeout: float = 180) -> Iterator[ThreadedStreams]:
    """``ThreadedStreams`` of ``reqs`` on the cluster's router, joined (bounded) when the block ends."""
    with c.channel() as ch:
        streams = ThreadedStreams(c.stub(ch), reqs, after=after, timeout=timeout)
        try:
            yield streams
        finally:
            streams.join(timeout)
