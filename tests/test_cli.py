"""The pdserve CLI: parsing, the state file, and up/status/down against a real router process."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import grpc
import pytest

from pdserve.cli import main as cli
from pdserve.decode_pool import servicer as decode_servicer
from pdserve.deploy.local import cluster
from pdserve.proto import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.worker.auth import token_metadata
from pdserve.worker.role import Role
from tests.cluster_harness import fake_state, stop_cluster
from tests.fake_workers import make_model_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_parser_defaults_and_validation():
    p = cli.build_parser()
    a = p.parse_args(["up"])
    assert (a.prefill, a.decode, a.colocated) == (1, 1, 0)
    assert (a.model, a.dtype, a.host, a.port) == ("smollm2-135m-instruct", "auto", "127.0.0.1", 50051)
    assert (a.device, a.gpu_memory_utilization) == ("cpu", None)  # None: `up` shares 0.9 among GPU workers
    assert str(a.state_dir) == ".pdserve" and a.threads is None
    a = p.parse_args(["scale", "--decode", "2", "--state-dir", "x"])
    assert (a.prefill, a.decode, a.colocated, str(a.state_dir)) == (None, 2, None, "x")
    a = p.parse_args(["generate", "hi", "--chat", "--max-tokens", "5", "--seed", "3", "--json"])
    assert a.chat and a.json and (a.prompt, a.max_tokens, a.seed, a.temperature) == ("hi", 5, 3, None)
    for command in ("status", "down"):
        assert str(p.parse_args([command, "--state-dir", "d"]).state_dir) == "d"
    for bad in (
        ["up", "--prefill", "-1"],
        ["up", "--dtype", "int8"],
        ["up", "--device", "gpu"],
        ["up", "--gpu-memory-utilization", "0"],
        ["scale", "--device", "cuda:x"],
        ["scale", "--dtype", "float32"],  # a cluster keeps its dtype
        ["worker", "--role", "decode", "--router", "a:1", "--gpu-memory-utilization", "1.5"],
        ["worker", "--role", "prefill"],
        ["worker", "--role", "gpu", "--router", "a:1"],
        ["router", "--state-dir", "d"],  # the foreground pieces keep no state: it did nothing there
        ["worker", "--role", "decode", "--router", "a:1", "--state-dir", "d"],
        ["generate", "hi", "--max-tokens", "-3"],  # the proto fields are unsigned: was a traceback
        ["generate", "hi", "--max-tokens", "0"],
        ["generate", "hi", "--max-tokens", "99999999999"],
        ["generate", "hi", "--seed", "-1"],
        ["up", "--block-size", "0"],  # (these three failed in the worker, not naming the flag)
        ["up", "--max-running", "0"],
        ["worker", "--role", "decode", "--router", "a:1", "--max-batched-tokens", "0"],
        # Checked here, naming the flag: they failed in the spawned router or worker seconds later
        # (naming a config field), or after the whole cluster had started (a traceback), or never
        # (a negative --timeout left `scale`'s new worker starting).
        ["up", "--timeout", "0"],
        ["scale", "--timeout", "-1"],
        ["down", "--timeout", "nan"],
        ["drain", "--worker-id", "d", "--timeout", "-1"],
        ["generate", "hi", "--timeout", "-5"],
        ["up", "--prometheus", "--scrape-interval", "0"],
        ["up", "--alertmanager", "--alert-for", "-1"],
        ["up", "--prometheus-port", "99999"],
        ["up", "--heartbeat-interval", "0"],
        ["up", "--queue-timeout", "-1"],
        ["up", "--request-timeout", "-1"],
        ["up", "--request-timeout", "nan"],
        ["up", "--http-port", "70000"],
        ["up", "--metrics-port", "99999"],
        ["up", "--threads", "-3"],
        ["up", "--kv-stall-timeout", "0"],
        ["frobnicate"],
    ):
        with pytest.raises(SystemExit):
            p.parse_args(bad)


def test_up_refuses_a_heartbeat_timeout_under_the_interval_before_anything_starts(capsys):
    """The router refused it, seconds later, once the cluster had started ("router exited while starting")."""
    with pytest.raises(SystemExit):
        cli.main(["up", "--heartbeat-interval", "5", "--heartbeat-timeout", "1", "--port", str(free_port())])
    assert "--heartbeat-timeout, 1.0 s) must exceed" in capsys.readouterr().err


def test_autoscaling_errors_name_the_flags(tmp_path, capsys):
    """The policy's checks speak of its fields; what an operator reads names the flags that set them."""
    for bad, said in (
        (["--kv-usage-high", "0.3", "--kv-usage-low", "0.5"], "need 0 <= --kv-usage-low < --kv-usage-high"),
        (["--decode-min", "3", "--decode-max", "2"], "--decode-min, --decode-max, --warm-decode: "),
        (["--scale-up-after", "0"], "--scale-up-after and --scale-down-after must be >= 1"),
    ):
        up = ["up", "--autoscale", *bad, "--port", str(free_port()), "--state-dir", str(tmp_path / "c")]
        assert cli.main(up) == 1
        assert said in capsys.readouterr().err


def test_worker_args_threads_and_router_config():
    p = cli.build_parser()
    a = p.parse_args(["worker", "--role", "decode", "--router", "r:1", "--kv-cache-mib", "3"])
    w = cli.worker_args(a, "host", 42, cpus=2)
    assert (w.role, w.router, w.worker_id, w.port) == (Role.DECODE, "r:1", "decode-host-42", 0)
    assert w.threads == 2 and w.kv_cache_bytes == 3 << 20  # a worker alone gets every core
    assert (w.dtype, w.device, w.gpu_memory_utilization) == ("auto", "cpu", 0.9)
    assert not w.mixed_steps and not decode_servicer.engine_config(w).mixed_steps
    a = p.parse_args(["worker", "--role", "both", "--router", "r:1", "--mixed-steps"])
    assert decode_servicer.engine_config(cli.worker_args(a, "host", 42, cpus=2)).mixed_steps
    info = w.worker_info("h:5", kv_blocks_total=7, context_length=99, pid=1, dtype="float32", device="cpu")
    assert (info.role, info.dtype, info.device) == (worker_pb2.ROLE_DECODE, "float32", "cpu")
    # Workers sharing the 2 cores get one thread each.
    assert [cluster.default_threads(n, cpus=2) for n in (0, 1, 2, 3)] == [2, 2, 1, 1]
    c = cli.router_config(p.parse_args(["router", "--port", "0", "--max-waiting", "3"]))
    assert (c.port, c.max_waiting, c.bind_address) == (0, 3, "127.0.0.1:0")
    with pytest.raises(ValueError, match="--heartbeat-timeout, 0.1 s"):
        cli.router_config(p.parse_args(["router", "--heartbeat-timeout", "0.1"]))


def test_state_file_roundtrip(tmp_path):
    router = cluster.ProcessEntry(id="router", pid=11, start=5, log="r.log")
    state = fake_state(
        router, (cluster.ProcessEntry(id="decode-1", pid=12, start=6, log="d.log", role=Role.DECODE),), 2
    )
    assert cluster.load_state(tmp_path) is None
    cluster.save_state(tmp_path, state)
    assert cluster.load_state(tmp_path) == state
    assert json.loads((tmp_path / "cluster.json").read_text())["workers"][0]["role"] == "decode"
    assert [p.name for p in tmp_path.iterdir()] == ["cluster.json"]  # no temporary file left behind
    cluster.remove_state(tmp_path)
    assert cluster.load_state(tmp_path) is None
    # A pid that now belongs to another process (another start time) is not ours.
    assert not cluster.alive(cluster.ProcessEntry(id="x", pid=1, start=-1, log=""))


def test_commands_without_a_cluster_fail_cleanly(tmp_path, capsys):
    assert cli.main(["status", "--state-dir", str(tmp_path)]) == 1
    assert "no cluster" in capsys.readouterr().err
    assert cli.main(["down", "--state-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    # A state dir that cannot be one (a file here): one line naming it, no traceback.
    (tmp_path / "a-file").write_text("")
    assert cli.main(["up", "--state-dir", str(tmp_path / "a-file"), "--port", str(free_port())]) == 1
    err = capsys.readouterr().err
    assert "a-file" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_up_fails_with_the_log_tail_and_stops_what_it_started(tmp_path, capsys):
    args = [
        "up",
        "--prefill",
        "0",
        "--decode",
        "0",
        "--model",
        str(tmp_path / "no-such-model"),
        "--port",
        str(free_port()),
        "--timeout",
        "60",
        "--state-dir",
        str(tmp_path),
    ]
    assert cli.main(args) == 1
    err = capsys.readouterr().err
    assert "router" in err and "no-such-model" in err  # the router's own error, from its log
    assert err.count("cannot serve model") == 1  # said once (it was twice, with the log tail twice)
    assert cluster.load_state(tmp_path) is None


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
        args += ["--port", str(free_port()), "--timeout", "60", "--state-dir", str(tmp_path)]
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
        "--heartbeat-interval", "0.1", "--worker-module", "tests.fake_workers", "--timeout", "60", *base,
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


def test_router_start_errors_name_what_failed_not_the_model(capsys):
    """A port in use and a bad setting are one line naming them (they were reported as the model failing
    to load, and a taken gRPC port as a traceback)."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        base = ["router", "--host", "127.0.0.1", "--metrics-port", "0"]
        assert cli.main([*base, "--port", str(port)]) == 1
        err = capsys.readouterr().err
        assert f"cannot serve gRPC on 127.0.0.1:{port}" in err and "cannot serve model" not in err
        assert "Traceback" not in err
        assert cli.main([*base, "--port", "0", "--http-port", str(port)]) == 1
        err = capsys.readouterr().err
        assert f"cannot serve the HTTP API on port {port}" in err and "cannot serve model" not in err
    assert cli.main(["router", "--heartbeat-interval", "0.5", "--heartbeat-timeout", "0.2"]) == 1
    err = capsys.readouterr().err
    assert "--heartbeat-timeout, 0.2 s) must exceed" in err and "cannot serve model" not in err


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


def test_bench_options_before_the_mode_word_are_refused(capsys):
    """argparse let `sweep`'s defaults overwrite options given before the mode word, silently."""
    with pytest.raises(SystemExit):
        cli.main(["bench", "--num-prompts", "4", "sweep", "--shape", "2C", "--rates", "1", "--out-dir", "x"])
    assert "--num-prompts before `sweep`" in capsys.readouterr().err


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
    monkeypatch.setattr(cluster, "drain_worker", lambda *a, **k: False)  # the router: no such worker
    try:
        state = fake_state(cluster.ProcessEntry(id="router", pid=1, start=-1, log=""), (loading,))
        assert cluster.remove_workers(state, [loading], drain_timeout_s=20.0, progress=said.append) == []
        assert said == ["decode-2 is not registered with the router; stopping it by signal"]
        assert not cluster.alive(loading)
    finally:
        cluster.stop_processes([loading], term_timeout_s=5)


def test_an_autoscaled_decode_pool_may_reach_zero_only_beside_colocated_workers(tmp_path, capsys):
    """`--decode-min 0` with no colocated worker let the autoscaler take the decode pool to zero, where
    every request is refused at once and nothing it watches grows the pool back: refused up front, by
    `up --autoscale` and by `autoscale` beside a running cluster, naming the flag."""
    from pdserve.cli.cluster_cmds import check_decode_floor
    from pdserve.router.autoscale import AutoscaleConfig, PoolBounds

    up = ["up", "--autoscale", "--decode-min", "0", "--port", str(free_port())]
    assert cli.main([*up, "--state-dir", str(tmp_path / "c")]) == 1
    err = capsys.readouterr().err
    assert "--decode-min 0 needs colocated workers" in err and "Traceback" not in err
    assert cluster.load_state(tmp_path / "c") is None  # nothing started
    floor0 = AutoscaleConfig(prefill=PoolBounds(0, 1, 0), decode=PoolBounds(0, 1, 0))
    with pytest.raises(cluster.ClusterError, match="--decode-min 0"):
        check_decode_floor(floor0, colocated=0)
    check_decode_floor(floor0, colocated=1)  # a colocated worker decodes: the decode pool may empty


def test_a_worker_added_later_shares_the_cores_with_those_running(tmp_path, monkeypatch, capsys):
    """`up` without --threads gave its one worker every core; a worker `scale` or the autoscaler adds gets
    only its share of the cores among the CPU workers then running (it had the first one's count: on 2 cores
    two workers ran 4 threads, and decoding slowed ~20x). An explicit --threads is kept."""
    import os
    import sys

    first = cluster.spawn(
        "decode-1",
        [sys.executable, "-c", "import time; time.sleep(60)"],
        tmp_path / "d1.log",
        dict(os.environ),
    )
    first = cluster.ProcessEntry(
        **{**cluster.msgspec.structs.asdict(first), "role": Role.DECODE, "device": "cpu"}
    )
    started: list[list[str]] = []

    def spawn(wid, argv, log, env, role=None, cpus=()):
        started.append(argv)
        assert env["OMP_NUM_THREADS"] == argv[argv.index("--threads") + 1]
        return cluster.ProcessEntry(id=wid, pid=first.pid, start=first.start, log=str(log), role=role)

    monkeypatch.setattr(cluster, "spawn", spawn)
    monkeypatch.setattr(cluster.os, "cpu_count", lambda: 2)
    router = cluster.ProcessEntry(id="router", pid=1, start=-1, log="")
    try:
        auto = cluster.msgspec.structs.replace(fake_state(router, (first,), 2), threads=2, threads_auto=True)
        state = cluster.spawn_workers(tmp_path, auto, Role.DECODE, 1)
        assert started[-1][started[-1].index("--threads") + 1] == "1"
        assert state.workers[-1].threads == 1 and cluster.cpu_threads(state) == 2 + 1
        given = cluster.msgspec.structs.replace(auto, threads_auto=False)  # `up --threads 2`
        cluster.spawn_workers(tmp_path, given, Role.DECODE, 1)
        assert started[-1][started[-1].index("--threads") + 1] == "2"
    finally:
        cluster.stop_processes([first], term_timeout_s=5)


def test_status_lists_a_worker_whose_process_exited_and_counts_it_in_its_pool(tmp_path, capsys, monkeypatch):
    """A crashed worker vanished from `pdserve status` (its pool just looked smaller: "1/1 ready" of two
    started); only a later `scale` said it had exited."""
    router = cluster.ProcessEntry(id="router", pid=11, start=5, log="r.log")
    served = cluster.ProcessEntry(id="decode-1", pid=12, start=6, log="d1.log", role=Role.DECODE)
    gone = cluster.ProcessEntry(id="decode-2", pid=13, start=7, log="d2.log", role=Role.DECODE)
    cluster.save_state(tmp_path, fake_state(router, (served, gone), 3))
    monkeypatch.setattr(cluster, "alive", lambda p: p.id != "decode-2")
    entry = worker_pb2.WorkerEntry(
        info=worker_pb2.WorkerInfo(worker_id="decode-1", role=worker_pb2.ROLE_DECODE, address="127.0.0.1:2"),
        load=worker_pb2.WorkerLoad(worker_id="decode-1", state=worker_pb2.WORKER_STATE_READY),
    )
    status = worker_pb2.ClusterStatus(router_address="127.0.0.1:1", workers=[entry])
    monkeypatch.setattr(cluster, "cluster_status", lambda *a, **k: status)
    assert cli.main(["status", "--json", "--state-dir", str(tmp_path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(w["id"], w["pid"], w["log"]) for w in doc["exited"]] == [("decode-2", 13, "d2.log")]
    assert doc["unregistered"] == []
    assert cli.main(["status", "--state-dir", str(tmp_path)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert next(ln.split() for ln in table if ln.startswith("decode-2"))[:3] == [
        "decode-2",
        "decode",
        "exited",
    ]
    assert next(ln.split() for ln in table if ln.startswith("TOTAL"))[:3] == ["TOTAL", "decode", "1/2"]


def test_generate_refuses_a_prompt_that_is_not_utf8_naming_it(tmp_path, capsys):
    """Bytes of argv that are not UTF-8 (Python keeps them as surrogates) were a UnicodeEncodeError
    traceback; nothing is sent."""
    assert cli.main(["generate", "\udcff\udcfe bad", "--router", "127.0.0.1:1"]) == 2
    assert "the prompt is not valid UTF-8 text" in capsys.readouterr().err
    assert cli.main(["generate", "ok", "--stop", "\udcff", "--router", "127.0.0.1:1"]) == 2
    assert "a --stop string is not valid UTF-8 text" in capsys.readouterr().err


def test_status_lists_a_running_worker_the_router_does_not_and_its_pool():
    """A worker process that runs but is not registered (loading, hung, dropped for missed heartbeats) was
    missing from `pdserve status`, and so was its pool's TOTAL row when it was the pool's only worker."""
    from pdserve.cli import client

    doc = client.status_dict(worker_pb2.ClusterStatus(router_address="127.0.0.1:1"), now_unix=0.0)
    doc["unregistered"] = [{"id": "decode-1", "role": "decode", "pid": 4242, "device": "cpu"}]
    table = client.status_table(doc).splitlines()
    row = next(ln.split() for ln in table if ln.startswith("decode-1"))
    assert row[:5] == ["decode-1", "decode", "not", "registered", "cpu"] and "4242" in row
    assert next(ln.split() for ln in table if ln.startswith("TOTAL"))[:4] == [
        "TOTAL",
        "decode",
        "0/1",
        "ready",
    ]


def test_a_long_drain_says_what_it_still_waits_for(monkeypatch):
    """`down` (and `scale`) drained 3 long streams for 37 s without a word; now every few seconds it names
    the workers still draining, what they run, and the time left."""
    entry = cluster.ProcessEntry(id="decode-1", pid=12, start=6, log="d.log", role=Role.DECODE)
    state = fake_state(cluster.ProcessEntry(id="router", pid=11, start=5, log="r.log"), (entry,))
    exits_at = time.monotonic() + 0.5
    monkeypatch.setattr(cluster, "alive", lambda p: time.monotonic() < exits_at)
    monkeypatch.setattr(cluster, "_DRAIN_NOTE_S", 0.2)
    monkeypatch.setattr(cluster, "_POLL_S", 0.01)
    load = worker_pb2.WorkerLoad(worker_id="decode-1", running=3)
    status = worker_pb2.ClusterStatus(
        workers=[worker_pb2.WorkerEntry(info=worker_pb2.WorkerInfo(worker_id="decode-1"), load=load)]
    )
    monkeypatch.setattr(cluster, "cluster_status", lambda *a, **k: status)
    said: list[str] = []
    assert cluster._wait_drained(state, [entry], 30.0, said.append) == []  # it exited: none stuck
    assert 1 <= len(said) <= 3 and all("still draining after" in s for s in said), said
    assert "decode-1 (3 running); 30s left" in said[0]


def test_an_unreachable_router_given_by_flag_hints_at_tls(capsys):
    """gRPC says only "Socket closed" when a TLS router meets plain gRPC (or a client without the certificate
    it requires): the error says which flag would give it."""
    port = free_port()
    assert cli.main(["generate", "hi", "--router", f"127.0.0.1:{port}", "--timeout", "5"]) == 1
    err = capsys.readouterr().err
    assert "UNAVAILABLE" in err and "give its CA with --tls-ca" in err
