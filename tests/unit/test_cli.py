"""The pdserve CLI: parsing, the state file, and up/status/down against a real router process."""

from __future__ import annotations

import json
import socket
import time

import pytest

from pdserve.cli import main as cli
from pdserve.cli import serve_cmds
from pdserve.decode_pool import app as decode_app
from pdserve.deploy.local import cluster
from pdserve.proto import worker_pb2
from pdserve.worker.role import Role
from tests.e2e.cluster_harness import fake_state
from tests.ports import free_port


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


def test_up_serves_the_openai_front_on_8000_unless_told_otherwise(capsys):
    """`up` hands its router --http-port 8000 by default; 0 picks a free port, --no-http serves none; a
    router started alone serves HTTP only when given --http-port."""
    from pdserve.cli.router_flags import ROUTER_FLAGS
    from pdserve.worker.flagspec import forward

    p = cli.build_parser()
    for argv, port, handed in (
        (["up"], 8000, ["--http-port", "8000"]),
        (["up", "--http-port", "0"], 0, ["--http-port", "0"]),
        (["up", "--no-http"], None, []),
    ):
        a = p.parse_args(argv)
        assert a.http_port == port and forward(a, ROUTER_FLAGS) == handed, argv
    assert p.parse_args(["router"]).http_port is None
    with pytest.raises(SystemExit):
        p.parse_args(["up", "--no-http", "--http-port", "9000"])
    assert "not allowed with argument" in capsys.readouterr().err


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
    w = serve_cmds.worker_args(a, "host", 42, cpus=2)
    assert (w.role, w.router, w.worker_id, w.port) == (Role.DECODE, "r:1", "decode-host-42", 0)
    assert w.threads == 2 and w.kv_cache_bytes == 3 << 20  # a worker alone gets every core
    assert (w.dtype, w.device, w.gpu_memory_utilization) == ("auto", "cpu", 0.9)
    assert not w.mixed_steps and not decode_app.engine_config(w).mixed_steps
    a = p.parse_args(["worker", "--role", "both", "--router", "r:1", "--mixed-steps"])
    assert decode_app.engine_config(serve_cmds.worker_args(a, "host", 42, cpus=2)).mixed_steps
    info = w.worker_info("h:5", kv_blocks_total=7, context_length=99, pid=1, dtype="float32", device="cpu")
    assert (info.role, info.dtype, info.device) == (worker_pb2.ROLE_DECODE, "float32", "cpu")
    # Workers sharing the 2 cores get one thread each.
    assert [cluster.default_threads(n, cpus=2) for n in (0, 1, 2, 3)] == [2, 2, 1, 1]
    c = serve_cmds.router_config(p.parse_args(["router", "--port", "0", "--max-waiting", "3"]))
    assert (c.port, c.max_waiting, c.bind_address) == (0, 3, "127.0.0.1:0")
    with pytest.raises(ValueError, match="--heartbeat-timeout, 0.1 s"):
        serve_cmds.router_config(p.parse_args(["router", "--heartbeat-timeout", "0.1"]))


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
        "--http-port",
        "0",
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


def test_router_start_errors_name_what_failed_not_the_model(capsys):
    """A port in use and a bad setting are one line naming them (they were reported as the model failing
    to load, and a taken gRPC port as a traceback)."""

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
        assert (
            f"cannot serve the HTTP API on port {port} (--http-port" in err
            and "cannot serve model" not in err
        )
    assert cli.main(["router", "--heartbeat-interval", "0.5", "--heartbeat-timeout", "0.2"]) == 1
    err = capsys.readouterr().err
    assert "--heartbeat-timeout, 0.2 s) must exceed" in err and "cannot serve model" not in err


def test_bench_options_before_the_mode_word_are_refused(capsys):
    """argparse let `sweep`'s defaults overwrite options given before the mode word, silently."""
    with pytest.raises(SystemExit):
        cli.main(["bench", "--num-prompts", "4", "sweep", "--shape", "2C", "--rates", "1", "--out-dir", "x"])
    assert "--num-prompts before `sweep`" in capsys.readouterr().err


def test_an_autoscaled_decode_pool_may_reach_zero_only_beside_colocated_workers(tmp_path, capsys):
    """`--decode-min 0` with no colocated worker let the autoscaler take the decode pool to zero, where
    every request is refused at once and nothing it watches grows the pool back: refused up front, by
    `up --autoscale` and by `autoscale` beside a running cluster, naming the flag."""
    from pdserve.cli.autoscale_cmds import check_decode_floor
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


def test_status_lists_a_worker_whose_process_exited_and_counts_it_in_its_pool(tmp_path, capsys, monkeypatch):
    """A crashed worker vanished from `pdserve status` (its pool just looked smaller: "1/1 ready" of two
    started); only a later `scale` said it had exited."""
    router = cluster.ProcessEntry(id="router", pid=11, start=5, log="r.log")
    served = cluster.ProcessEntry(id="decode-1", pid=12, start=6, log="d1.log", role=Role.DECODE)
    gone = cluster.ProcessEntry(id="decode-2", pid=13, start=7, log="d2.log", role=Role.DECODE)
    cluster.save_state(tmp_path, fake_state(router, (served, gone), 3))
    alive = lambda p: p.id != "decode-2"  # noqa: E731
    monkeypatch.setattr(cluster, "alive", alive)
    monkeypatch.setattr(cluster.processes, "alive", alive)  # (``live_router``'s)
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
    assert [(r["address"], r["pid"], r["workers"]) for r in doc["routers"]] == [("127.0.0.1:1", 11, 1)]
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


def test_status_shows_streams_moving_live():
    from pdserve.cli import client

    status = worker_pb2.ClusterStatus(router_address="127.0.0.1:1", requests_running=5, streams_moving=3)
    doc = client.status_dict(status, now_unix=0.0)
    assert doc["router"]["streams_moving"] == 3
    assert "5 running, 0 waiting, 3 moving" in client.status_table(doc).splitlines()[0]
    quiet = client.status_dict(worker_pb2.ClusterStatus(router_address="127.0.0.1:1"), now_unix=0.0)
    assert "moving" not in client.status_table(quiet).splitlines()[0]


def test_a_long_drain_says_what_it_still_waits_for(monkeypatch):
    """`down` (and `scale`) drained 3 long streams for 37 s without a word; now every few seconds it names
    the workers still draining, what they run, and the time left."""
    entry = cluster.ProcessEntry(id="decode-1", pid=12, start=6, log="d.log", role=Role.DECODE)
    state = fake_state(cluster.ProcessEntry(id="router", pid=11, start=5, log="r.log"), (entry,))
    exits_at = time.monotonic() + 0.5
    monkeypatch.setattr(cluster.processes, "alive", lambda p: time.monotonic() < exits_at)
    monkeypatch.setattr(cluster.control, "_DRAIN_NOTE_S", 0.2)
    monkeypatch.setattr(cluster.processes, "_POLL_S", 0.01)
    load = worker_pb2.WorkerLoad(worker_id="decode-1", running=3)
    status = worker_pb2.ClusterStatus(
        workers=[worker_pb2.WorkerEntry(info=worker_pb2.WorkerInfo(worker_id="decode-1"), load=load)]
    )
    monkeypatch.setattr(cluster.rpc, "cluster_status", lambda *a, **k: status)
    said: list[str] = []
    assert cluster.control._wait_drained(state, [entry], 30.0, said.append) == []  # it exited: none stuck
    assert 1 <= len(said) <= 3 and all("still draining after" in s for s in said), said
    assert "decode-1 (3 running); 30s left" in said[0]


def test_an_unreachable_router_given_by_flag_hints_at_tls(capsys):
    """gRPC says only "Socket closed" when a TLS router meets plain gRPC (or a client without the certificate
    it requires): the error says which flag would give it."""
    port = free_port()
    assert cli.main(["generate", "hi", "--router", f"127.0.0.1:{port}", "--timeout", "5"]) == 1
    err = capsys.readouterr().err
    assert "UNAVAILABLE" in err and "give its CA with --tls-ca" in err
