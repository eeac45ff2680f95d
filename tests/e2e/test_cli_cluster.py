"""The CLI's up, scale, down, status and drain against the processes they start and stop."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import grpc

from pdserve.cli import main as cli
from pdserve.deploy.local import cluster
from pdserve.proto import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.worker.auth import token_metadata
from pdserve.worker.role import Role
from tests.e2e.cluster_harness import fake_state, stop_cluster
from tests.fake_workers import make_model_dir
from tests.ports import free_port


def test_up_after_a_router_crash_stops_what_the_old_cluster_left_running(tmp_path, capsys):
    """The old router is gone but a worker of its cluster still runs: ``up`` stops it before the new
    state file forgets it (it would otherwise run on, knocking on the new router with the old token)."""
    import subprocess
    import sys

    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        stat = cluster.proc_stat(orphan.pid)
        assert stat is not None
        dead_router = cluster.ProcessEntry(id="router", pid=orphan.pid, start=-1, log="r.log")  # not it
        worker = cluster.ProcessEntry(
            id="decode-1", pid=orphan.pid, start=stat[1], log="d.log", role=Role.DECODE
        )
        state = fake_state(dead_router, (worker,), 2)
        cluster.save_state(tmp_path, state)
        args = ["up", "--prefill", "0", "--decode", "0", "--model", str(tmp_path / "no-such-model")]
        args += [
            "--port",
            str(free_port()),
            "--http-port",
            "0",
            "--timeout",
            "60",
            "--state-dir",
            str(tmp_path),
        ]
        assert cli.main(args) == 1  # the new router cannot load its model: beside the point here
        assert "left running after its router exited: decode-1" in capsys.readouterr().err
        assert orphan.wait(timeout=10) is not None
    finally:
        orphan.kill()
        orphan.wait()


def test_up_status_json_and_down_with_a_real_router(tmp_path, capsys):
    model = make_model_dir(tmp_path / "model")
    state_dir = tmp_path / "state"
    port = free_port()
    up = [
        "up",
        "--prefill",
        "0",
        "--decode",
        "0",
        "--model",
        str(model),
        "--port",
        str(port),
        "--http-port",
        "0",
        "--heartbeat-timeout",
        "120",
        "--timeout",
        "60",
        "--state-dir",
        str(state_dir),
    ]
    try:
        assert cli.main(up) == 0
        state = cluster.load_state(state_dir)
        assert state is not None
        address = f"127.0.0.1:{port}"
        assert capsys.readouterr().out.strip() == address and state.router_address == address
        assert cli.main(up) == 1  # one cluster per state dir
        assert "already running" in capsys.readouterr().err
        meta = token_metadata(cluster.state_token(state))  # `up` made the cluster a token
        with grpc.insecure_channel(address) as channel:
            reg = worker_pb2_grpc.RegistryStub(channel)
            # d1 runs on a GPU; p1 registers no device, as a worker from before the field did (the CPU).
            for wid, role, used, device, dtype, quant in (
                ("d1", worker_pb2.ROLE_DECODE, 3, "cuda:0", "bfloat16", ""),
                ("p1", worker_pb2.ROLE_PREFILL, 0, "", "float32", "int8"),
            ):
                reg.Register(
                    worker_pb2.WorkerInfo(
                        worker_id=wid,
                        role=role,
                        address=f"127.0.0.1:{port + 1}",
                        kv_blocks_total=10,
                        block_size=16,
                        max_running=4,
                        metrics_url=f"http://127.0.0.1:9/{wid}",
                        model="m",
                        dtype=dtype,
                        device=device,
                        quantization=quant,
                    ),
                    timeout=5,
                    metadata=meta,
                )
                reg.Heartbeat(
                    worker_pb2.WorkerLoad(
                        worker_id=wid,
                        state=worker_pb2.WORKER_STATE_READY,
                        running=2,
                        queued=1,
                        kv_blocks_used=used,
                        kv_blocks_total=10,
                    ),
                    timeout=5,
                    metadata=meta,
                )
        assert cli.main(["status", "--json", "--state-dir", str(state_dir)]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["router"]["address"] == address
        http_url = doc["router"]["http_url"]  # the OpenAI front, on by default (here on a free port)
        assert http_url.startswith("http://127.0.0.1:") and not http_url.endswith(":0")
        keys = {
            "id",
            "role",
            "address",
            "state",
            "running",
            "queued",
            "kv_blocks_used",
            "kv_blocks_total",
            "metrics_url",
        }
        assert all(keys <= set(w) for w in doc["workers"])
        by_id = {w["id"]: w for w in doc["workers"]}
        assert (by_id["d1"]["role"], by_id["d1"]["state"], by_id["d1"]["kv_blocks_used"]) == (
            "decode",
            "ready",
            3,
        )
        assert by_id["p1"]["role"] == "prefill" and by_id["d1"]["metrics_url"] == "http://127.0.0.1:9/d1"
        assert [(by_id[w]["device"], by_id[w]["dtype"], by_id[w]["quantization"]) for w in ("d1", "p1")] == [
            ("cuda:0", "bfloat16", "none"),  # a worker from before the field has unquantised weights
            ("cpu", "float32", "int8"),
        ]
        t = doc["totals"]
        assert (t["workers"], t["running"], t["queued"], t["kv_blocks_used"], t["kv_blocks_total"]) == (
            2,
            4,
            2,
            3,
            20,
        )
        assert t["pools"]["decode"]["kv_blocks_used"] == 3 and t["pools"]["prefill"]["kv_blocks_used"] == 0
        assert t["pools"]["decode"]["kv_blocks_total"] == 10 and t["pools"]["prefill"]["ready"] == 1
        assert cli.main(["status", "--state-dir", str(state_dir)]) == 0
        table = capsys.readouterr().out
        assert "d1" in table and "p1" in table and "3/10" in table
        assert f"OpenAI API {http_url}/v1" in table.splitlines()[0]
        totals = [line.split() for line in table.splitlines() if line.startswith("TOTAL")]
        assert [(r[1], r[2], r[-1]) for r in totals] == [
            ("decode", "1/1", "3/10"),
            ("prefill", "1/1", "0/10"),
        ]
        [d1_row] = [line for line in table.splitlines() if line.startswith("d1 ")]
        assert "DEVICE" in table and "cuda:0" in d1_row and "bfloat16 " in d1_row
        [p1_row] = [line for line in table.splitlines() if line.startswith("p1 ")]
        assert "float32/int8" in p1_row
        assert cli.main(["down", "--state-dir", str(state_dir)]) == 0
        assert cluster.wait_exit([state.router], 10) == []
        assert cluster.load_state(state_dir) is None
        assert (state_dir / "logs" / "router.log").is_file()  # logs stay for a post-mortem
    finally:
        stop_cluster(state_dir)


def test_scale_grows_and_shrinks_pools_and_a_removed_worker_drains_first(tmp_path, capsys):
    model = make_model_dir(tmp_path / "model")
    state_dir = tmp_path / "state"
    base = ["--state-dir", str(state_dir)]
    up = [
        "up",
        "--prefill",
        "0",
        "--decode",
        "1",
        "--model",
        str(model),
        "--port",
        str(free_port()),
        "--http-port",
        "0",
        "--heartbeat-interval",
        "0.1",
        "--worker-module",
        "tests.fake_workers",
        "--timeout",
        "60",
        *base,
    ]

    def workers() -> dict[str, str]:
        assert cli.main(["status", "--json", *base]) == 0
        return {w["id"]: w["state"] for w in json.loads(capsys.readouterr().out)["workers"]}

    try:
        assert cli.main(up) == 0
        address = capsys.readouterr().out.strip()
        # A warm-pool worker an autoscaler left behind is promoted, not counted as serving.
        state = cluster.spawn_workers(state_dir, cluster.load_state(state_dir), Role.DECODE, 1, standby=True)
        cluster.save_state(state_dir, state)
        cluster.wait_ready(state, {"decode-2"}, 60, lambda _msg: None)
        assert workers() == {"decode-1": "ready", "decode-2": "standby"}
        assert cli.main(["scale", "--decode", "2", "--timeout", "60", *base]) == 0
        assert "promoted from the warm pool: decode-2" in capsys.readouterr().err
        assert workers() == {"decode-1": "ready", "decode-2": "ready"}
        started = cluster.load_state(tmp_path / "state").workers
        assert not any(w.standby for w in started)
        assert cli.main(["scale", "--decode", "1", "--timeout", "60", *base]) == 0
        assert workers() == {"decode-1": "ready"}  # the newest went first
        assert not cluster.alive(started[1])

        # A request in flight on decode-1 that the fake holds until its worker drains.
        got: list = []
        first = threading.Event()

        def client() -> None:
            req = generation_pb2.GenerateRequest(request_id="hold-1", prompt="hello")
            try:
                with grpc.insecure_channel(address) as channel:
                    for m in generation_pb2_grpc.GenerationStub(channel).Generate(req, timeout=60):
                        got.append(m)
                        first.set()
            except grpc.RpcError as e:
                got.append(e)
                first.set()

        thread = threading.Thread(target=client)
        thread.start()
        try:
            assert first.wait(30)
            # No decoding worker left: refused as `up` refuses it, before anything changes.
            assert cli.main(["scale", "--decode", "0", "--timeout", "60", *base]) == 1
            assert "at least one decode or colocated worker" in capsys.readouterr().err
            assert cli.main(["scale", "--decode", "0", "--colocated", "1", "--timeout", "60", *base]) == 0
        finally:
            thread.join(60)
        assert all(isinstance(m, generation_pb2.GenerateResponse) for m in got), got
        assert [t for m in got for t in m.token_ids] == [4, 5, 6, 7] and got[-1].finish_reason == "length"
        assert workers() == {"both-3": "ready"}
        assert not cluster.alive(started[0])
        assert "draining (1 in flight)" in Path(started[0].log).read_text()
        assert [w.id for w in cluster.load_state(tmp_path / "state").workers] == ["both-3"]
        # A scale that gives up waiting says its worker goes on starting (it does, and joins).
        assert cli.main(["scale", "--colocated", "2", "--timeout", "0.01", *base]) == 1
        assert "both-4 still starting: joins the cluster once ready" in capsys.readouterr().err
        cluster.wait_ready(cluster.load_state(state_dir), {"both-4"}, 60)
        assert workers() == {"both-3": "ready", "both-4": "ready"}
        assert cli.main(["down", *base]) == 0
    finally:
        stop_cluster(state_dir)


def test_the_death_of_the_last_decode_worker_promotes_a_standby_and_scale_counts_it(tmp_path, capsys):
    """A warm decode worker stands by; the only serving one is SIGKILLed: the router promotes the standby
    on its own (requests are not refused until an autoscaler tick), and `scale` then counts it as serving
    rather than starting workers beside it."""
    import os
    import signal

    model = make_model_dir(tmp_path / "model")
    state_dir = tmp_path / "state"
    base = ["--state-dir", str(state_dir)]
    up = [
        "up", "--prefill", "0", "--decode", "1", "--model", str(model), "--port", str(free_port()),
        "--http-port", "0", "--heartbeat-interval", "0.1", "--worker-module", "tests.fake_workers",
        "--timeout", "60", *base,
    ]  # fmt: skip

    def workers() -> dict[str, str]:
        assert cli.main(["status", "--json", *base]) == 0
        return {w["id"]: w["state"] for w in json.loads(capsys.readouterr().out)["workers"]}

    try:
        assert cli.main(up) == 0
        capsys.readouterr()
        state = cluster.spawn_workers(state_dir, cluster.load_state(state_dir), Role.DECODE, 1, standby=True)
        cluster.save_state(state_dir, state)
        cluster.wait_ready(state, {"decode-2"}, 60, lambda _msg: None)
        assert workers() == {"decode-1": "ready", "decode-2": "standby"}
        [d1] = [w for w in state.workers if w.id == "decode-1"]
        os.kill(d1.pid, signal.SIGKILL)
        for _ in range(200):
            if workers() == {"decode-2": "ready"}:
                break
            time.sleep(0.05)
        assert workers() == {"decode-2": "ready"}
        assert "standby worker decode-2 promoted" in (state_dir / "logs" / "router.log").read_text()
        assert cli.main(["scale", "--decode", "1", "--timeout", "60", *base]) == 0
        assert "decode-2 serves: the router promoted it" in capsys.readouterr().err
        [w] = cluster.load_state(state_dir).workers
        assert (w.id, w.standby) == ("decode-2", False)  # nothing started beside it
        assert cli.main(["down", *base]) == 0
    finally:
        stop_cluster(state_dir)


def test_log_tail_shows_the_latest_run_only_and_scale_needs_a_live_router(tmp_path, capsys):
    """A log is appended to across runs; what ``up`` shows of it when a start fails is the latest run's
    (it showed earlier clusters' lines). ``scale`` refuses a cluster whose router has exited instead of
    starting workers for it."""
    import os
    import sys
    import time

    log = tmp_path / "w.log"
    log.write_text("an earlier cluster's line\n")
    entry = cluster.spawn("decode-1", [sys.executable, "-c", "print('this run')"], log, dict(os.environ))
    for _ in range(100):
        if not cluster.alive(entry):
            break
        time.sleep(0.05)
    assert "this run" in log.read_text() and "earlier" in log.read_text()
    assert cluster.log_tail(log) == "this run"
    state = fake_state(cluster.ProcessEntry(id="router", pid=entry.pid, start=-1, log=""))
    cluster.save_state(tmp_path, state)
    assert cli.main(["scale", "--decode", "2", "--state-dir", str(tmp_path)]) == 1
    assert "router of the cluster" in capsys.readouterr().err
    assert cluster.load_state(tmp_path) == state  # nothing started
    for command in (["status"], ["drain", "--worker-id", "decode-1"], ["generate", "hi"]):
        assert cli.main([*command, "--state-dir", str(tmp_path)]) == 1  # not a raw gRPC error
        assert "has exited: `pdserve down`, then `pdserve up` again" in capsys.readouterr().err, command


def test_a_second_command_changing_the_cluster_at_once_is_refused(tmp_path, capsys):
    """Two `scale` calls at once started two workers under one id; one command holds the state dir."""
    import os

    with cluster.state_lock(tmp_path):
        for command in (["scale", "--decode", "2"], ["up"]):
            assert cli.main([*command, "--state-dir", str(tmp_path)]) == 1
            assert f"another pdserve command (pid {os.getpid()}) is changing" in capsys.readouterr().err
    assert cli.main(["down", "--state-dir", str(tmp_path)]) == 0  # free again

    # `down` is how an operator stops it all: it interrupts the holder (as Ctrl-C: `up` then stops what it
    # started), then goes on.
    import subprocess
    import sys

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from pdserve.deploy.local import cluster\n"
            f"with cluster.state_lock({str(tmp_path)!r}):\n"
            "    print('holding', flush=True)\n"
            "    time.sleep(120)\n",
            "scale",  # (what `down` checks it interrupts: a pdserve command that changes the cluster)
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        assert cli.main(["down", "--state-dir", str(tmp_path)]) == 0
        assert f"asking the pdserve command holding {tmp_path} (pid {holder.pid}) to stop" in (
            capsys.readouterr().err
        )
        assert holder.wait(timeout=10) != 0  # interrupted
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()


def test_a_broken_state_file_is_named_and_down_still_stops_its_cluster(tmp_path, capsys):
    """Every command names the unreadable file in one line; ``down`` finds the processes ``up`` started
    for the state dir by the mark in their environment, stops them and removes the file."""
    import os
    import sys

    other = tmp_path / "other"
    mine = cluster.spawn(
        "router",
        [sys.executable, "-c", "import time; time.sleep(60)"],
        tmp_path / "logs" / "r.log",
        dict(os.environ),
    )
    theirs = cluster.spawn(
        "router",
        [sys.executable, "-c", "import time; time.sleep(60)"],
        other / "logs" / "r.log",
        dict(os.environ),
    )
    try:
        (tmp_path / "cluster.json").write_text('{"router_address": "127.0.0.1:1", "rou')  # cut short
        for command in (["status"], ["scale", "--decode", "2"], ["up"]):
            assert cli.main([*command, "--state-dir", str(tmp_path)]) == 1
            err = capsys.readouterr().err
            assert "cluster.json is not a readable pdserve state file" in err and "Traceback" not in err
        assert [p.pid for p in cluster.marked_processes(tmp_path)] == [mine.pid]
        assert cli.main(["down", "--timeout", "10", "--state-dir", str(tmp_path)]) == 0
        assert f"python (pid {mine.pid})" in capsys.readouterr().err
        assert not cluster.alive(mine) and cluster.alive(theirs)  # another state dir's is left alone
        assert not (tmp_path / "cluster.json").exists()
    finally:
        cluster.stop_processes([mine, theirs], term_timeout_s=5)


def test_a_drain_past_its_time_is_cut_by_a_second_sigterm_not_killed(tmp_path):
    """A worker still draining when --timeout passed takes its first SIGTERM for a drain; ``cut_drains``
    sends a second, which cuts (the worker deregisters and exits cleanly), before any SIGKILL."""
    import os
    import sys
    import time

    code = (
        "import signal, sys, time\n"
        "seen = []\n"
        "def on(*_):\n"
        "    seen.append(1)\n"
        "    if len(seen) == 2: sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, on)\n"
        "print('draining', flush=True)\n"
        "time.sleep(120)\n"
    )
    log = tmp_path / "w.log"
    entry = cluster.spawn("decode-1", [sys.executable, "-c", code], log, dict(os.environ))
    deadline = time.monotonic() + 30
    while "draining" not in log.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert cluster.cut_drains([entry], term_timeout_s=10.0) == []  # not killed: it stopped on the second
    assert not cluster.alive(entry)


def test_down_also_stops_what_the_state_file_does_not_list(tmp_path, capsys):
    """A worker an interrupted `up` or `scale` started before it was written down: `down` finds it by the
    mark every process of this state dir carries."""
    import os
    import sys

    unlisted = cluster.spawn(
        "decode-9",
        [sys.executable, "-c", "import time; time.sleep(60)"],
        tmp_path / "logs" / "d.log",
        dict(os.environ),
    )
    try:
        cluster.save_state(tmp_path, fake_state(cluster.ProcessEntry(id="router", pid=1, start=-1, log="")))
        assert cli.main(["down", "--state-dir", str(tmp_path)]) == 0
        assert f"(pid {unlisted.pid})" in capsys.readouterr().err
        assert not cluster.alive(unlisted)
    finally:
        cluster.stop_processes([unlisted], term_timeout_s=5)


def test_a_worker_the_router_does_not_know_is_stopped_by_signal_not_waited_for(tmp_path, monkeypatch):
    """Removing a worker still loading (not registered): it gets SIGTERM at once, as the message says,
    rather than a wait to the drain timeout while it registers and takes requests (``remove_workers``)."""
    import os
    import sys

    loading = cluster.spawn(
        "decode-2",
        [sys.executable, "-c", "import time; time.sleep(60)"],
        tmp_path / "logs" / "d.log",
        dict(os.environ),
    )
    said: list[str] = []
    monkeypatch.setattr(cluster.rpc, "drain_worker", lambda *a, **k: False)  # the router: no such worker
    try:
        state = fake_state(cluster.ProcessEntry(id="router", pid=1, start=-1, log=""), (loading,))
        assert cluster.remove_workers(state, [loading], drain_timeout_s=20.0, progress=said.append) == []
        assert said == ["decode-2 is not registered with the router; stopping it by signal"]
        assert not cluster.alive(loading)
    finally:
        cluster.stop_processes([loading], term_timeout_s=5)


def test_a_worker_added_later_shares_the_cores_with_those_running(tmp_path, monkeypatch, capsys):
    """`up` without --threads gave its one worker every core; a worker `scale` or the autoscaler adds gets
    only its share of the cores among the CPU workers then running (it had the first one's count: on 2 cores
    two workers ran 4 threads, and decoding slowed ~20x). An explicit --threads is kept."""
    import os
    import sys

    import msgspec

    first = cluster.spawn(
        "decode-1",
        [sys.executable, "-c", "import time; time.sleep(60)"],
        tmp_path / "d1.log",
        dict(os.environ),
    )
    first = cluster.ProcessEntry(**{**msgspec.structs.asdict(first), "role": Role.DECODE, "device": "cpu"})
    started: list[list[str]] = []

    def spawn(wid, argv, log, env, role=None, cpus=()):
        started.append(argv)
        assert env["OMP_NUM_THREADS"] == argv[argv.index("--threads") + 1]
        return cluster.ProcessEntry(id=wid, pid=first.pid, start=first.start, log=str(log), role=role)

    monkeypatch.setattr(cluster.processes, "spawn", spawn)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    router = cluster.ProcessEntry(id="router", pid=1, start=-1, log="")
    try:
        auto = msgspec.structs.replace(fake_state(router, (first,), 2), threads=2, threads_auto=True)
        state = cluster.spawn_workers(tmp_path, auto, Role.DECODE, 1)
        assert started[-1][started[-1].index("--threads") + 1] == "1"
        assert state.workers[-1].threads == 1 and cluster.cpu_threads(state) == 2 + 1
        given = msgspec.structs.replace(auto, threads_auto=False)  # `up --threads 2`
        cluster.spawn_workers(tmp_path, given, Role.DECODE, 1)
        assert started[-1][started[-1].index("--threads") + 1] == "2"
    finally:
        cluster.stop_processes([first], term_timeout_s=5)
