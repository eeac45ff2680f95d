"""What up, scale and the chat command hand each worker process: device, dtype, share, KV-transfer flags."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from types import SimpleNamespace

import pytest

from pdserve.cli import main as cli
from pdserve.cli import monitoring, serve_cmds
from pdserve.decode_pool import app as decode_app
from pdserve.deploy.local import cluster
from pdserve.engine import device as dev
from pdserve.engine.quant import kv_model_id
from pdserve.worker.args import WorkerArgs
from pdserve.worker.role import Role


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this process sees ``n`` CUDA devices (``set(n, bf16=...)``); nothing touches a real one."""

    class Gpus:
        def set(self, n: int, bf16: bool = True) -> None:
            monkeypatch.setattr(dev, "_cuda_count", lambda: n)
            monkeypatch.setattr(dev, "_cuda_bf16", lambda index: bf16)

    g = Gpus()
    g.set(0)
    return g


# -- the local launcher -------------------------------------------------------------------------------------
@pytest.fixture
def launcher(monkeypatch, tmp_path):
    """``up`` and ``scale`` with stand-ins: every process they start is a ``sleep`` (stopped at the end)
    and its real command line is recorded; readiness and Prometheus targets are skipped, and the router's
    status (``up`` reads the OpenAI front's URL from it) is a stand-in."""
    argvs: dict[str, list[str]] = {}
    started: list[cluster.ProcessEntry] = []
    real_spawn = cluster.spawn

    def spawn(entry_id, argv, log_path, env, role=None, cpus=()):
        argvs[entry_id] = list(argv)
        entry = real_spawn(entry_id, ["sleep", "120"], log_path, env, role, cpus)
        started.append(entry)
        return entry

    monkeypatch.setattr(cluster, "spawn", spawn)  # `up`'s own (Prometheus, autoscaler)
    monkeypatch.setattr(cluster.processes, "spawn", spawn)  # the router and workers
    monkeypatch.setattr(cluster, "wait_ready", lambda *a, **k: None)
    monkeypatch.setattr(monitoring, "write_targets", lambda *a, **k: None)
    monkeypatch.setattr(cluster, "cluster_status", lambda *a, **k: SimpleNamespace(http_url="http://h:1"))
    yield SimpleNamespace(argvs=argvs, state_dir=tmp_path / "state")
    cluster.stop_processes(started, term_timeout_s=5.0)


def parsed_worker(argv: list[str]) -> WorkerArgs:
    """The WorkerArgs a launched worker builds from its command line (``python -m pdserve.cli worker``)."""
    assert argv[:3] == [sys.executable, "-m", "pdserve.cli"] and argv[3] == "worker"
    return serve_cmds.worker_args(cli.build_parser().parse_args(argv[3:]), "h", 1, cpus=1)


def test_up_and_scale_hand_each_worker_its_device_dtype_and_share(launcher, gpus, capsys):
    gpus.set(1)
    sd = ["--state-dir", str(launcher.state_dir)]
    up = ["up", "--prefill", "1", "--decode", "1", "--model", "m", "--port", "50999", "--device", "cuda", *sd]
    assert cli.main([*up, "--gpu-memory-utilization", "0.6"]) == 1  # 2 x 0.6 of one GPU
    err = capsys.readouterr().err
    assert "--gpu-memory-utilization 0.6 for each of 2 new worker(s) on cuda:0 adds up to 1.20" in err
    assert "give at most 0.500" in err and not launcher.argvs  # refused before anything started
    assert cli.main([*up, "--dtype", "bfloat16"]) == 0
    assert "2 workers on cuda:0 (0.45 of its memory each)" in capsys.readouterr().err
    state = cluster.load_state(launcher.state_dir)
    assert (state.device, state.dtype, state.gpu_memory_utilization) == ("cuda:0", "bfloat16", 0.45)
    for wid in ("prefill-1", "decode-2"):
        w = parsed_worker(launcher.argvs[wid])
        assert (w.device, w.dtype, w.gpu_memory_utilization) == ("cuda:0", "bfloat16", 0.45)
    assert {(w.device, w.gpu_memory_utilization) for w in state.workers} == {("cuda:0", 0.45)}

    # One more decode worker at the cluster's 0.45 does not fit beside the two ...
    assert cli.main(["scale", "--decode", "2", *sd]) == 1
    assert "beside the 0.90 its workers already take; give at most 0.100" in capsys.readouterr().err
    # ... a smaller share does; and a worker that leaves frees its share for a new one.
    assert cli.main(["scale", "--decode", "2", "--gpu-memory-utilization", "0.1", *sd]) == 0
    w = parsed_worker(launcher.argvs["decode-3"])
    assert (w.device, w.dtype, w.gpu_memory_utilization) == ("cuda:0", "bfloat16", 0.1)
    assert cli.main(["scale", "--prefill", "0", "--decode", "3", "--timeout", "1", *sd]) == 0
    assert parsed_worker(launcher.argvs["decode-4"]).gpu_memory_utilization == 0.45
    state = cluster.load_state(launcher.state_dir)
    assert sorted(w.id for w in state.workers) == ["decode-2", "decode-3", "decode-4"]
    # CPU workers beside them take no share of the GPU.
    assert cli.main(["scale", "--colocated", "1", "--device", "cpu", *sd]) == 0
    assert parsed_worker(launcher.argvs["both-5"]).device == "cpu"
    gpus.set(0)
    assert cli.main(["scale", "--colocated", "2", "--device", "cuda", *sd]) == 1
    assert "CUDA is not available" in capsys.readouterr().err


def test_up_on_cpu_passes_auto_and_the_default_share(launcher, capsys):
    sd = ["--state-dir", str(launcher.state_dir)]
    assert cli.main(["up", "--prefill", "0", "--decode", "1", "--model", "m", "--port", "50998", *sd]) == 0
    w = parsed_worker(launcher.argvs["decode-1"])
    assert (w.device, w.dtype, w.gpu_memory_utilization) == ("cpu", "auto", 0.9)
    router = launcher.argvs["router"]  # the OpenAI front on by default, on 8000
    assert router[router.index("--http-port") + 1] == "8000"
    assert w.kv_cross_memory and w.kv_interface == ""


def test_up_hands_the_kv_transfer_flags_to_every_worker_scale_starts_too(launcher):
    sd = ["--state-dir", str(launcher.state_dir)]
    kv = ["--no-kv-cross-memory", "--kv-interface", "lo", "--kv-puts", "always", "--kv-shared-memory"]
    assert (
        cli.main(["up", "--prefill", "1", "--decode", "1", "--model", "m", "--port", "50997", *kv, *sd]) == 0
    )
    assert cli.main(["scale", "--decode", "2", *sd]) == 0
    for wid in ("prefill-1", "decode-2", "decode-3"):
        w = parsed_worker(launcher.argvs[wid])
        assert (w.kv_cross_memory, w.kv_interface, w.kv_puts) == (False, "lo", "always"), wid
        assert w.kv_shared_memory, wid
        config = w.transfer_config()
        assert not config.same_host and config.rma and config.rma_over_tcp, wid
    assert decode_app.engine_config(parsed_worker(launcher.argvs["decode-3"])).kv_shared_memory
    with pytest.raises(ValueError, match="host memory"):  # a KV cache on a GPU is not in shared memory
        dataclasses.replace(parsed_worker(launcher.argvs["decode-3"]), device="cuda")


def test_shared_kv_caches_are_refused_for_gpu_workers_before_anything_starts(launcher, gpus, capsys):
    gpus.set(1)
    sd = ["--state-dir", str(launcher.state_dir)]
    up = ["up", "--prefill", "1", "--decode", "1", "--model", "m", "--port", "50996", *sd]
    up.append("--kv-shared-memory")
    assert cli.main([*up, "--device", "cuda"]) == 1
    assert "--kv-shared-memory keeps decode KV caches in host shared memory" in capsys.readouterr().err
    assert not launcher.argvs
    assert cli.main(up) == 0  # on CPU: started
    assert cli.main(["scale", "--decode", "2", "--device", "cuda", *sd]) == 1  # not beside them on a GPU
    assert "workers on cuda:0 cannot" in capsys.readouterr().err


def test_kv_puts_picks_puts_or_tagged_messages(launcher, capsys):
    """--kv-puts maps onto the transfer's two switches; the default leaves puts to where they are
    one-sided; a bad value is a usage error naming the choices."""
    sd = ["--state-dir", str(launcher.state_dir)]
    assert cli.main(["up", "--prefill", "1", "--decode", "1", "--model", "m", "--port", "50996", *sd]) == 0
    w = parsed_worker(launcher.argvs["decode-2"])
    assert w.kv_puts == "auto" and "--kv-puts" not in launcher.argvs["decode-2"]
    assert (w.transfer_config().rma, w.transfer_config().rma_over_tcp) == (True, None)  # auto
    never = dataclasses.replace(w, kv_puts="never").transfer_config()
    assert (never.rma, never.rma_over_tcp) == (False, False)
    with pytest.raises(ValueError, match="kv_puts must be one of auto, always, never"):
        dataclasses.replace(w, kv_puts="sometimes")
    with pytest.raises(SystemExit):
        cli.main(["worker", "--role", "decode", "--kv-puts", "sometimes"])
    assert "invalid choice: 'sometimes'" in capsys.readouterr().err


def test_an_up_that_fails_starting_a_worker_stops_everything_it_started(monkeypatch, tmp_path, capsys):
    """Not only a failed wait: a worker that cannot be started (here the third process) takes the router
    and the workers started before it down with it, and leaves no state file behind."""
    started: list[cluster.ProcessEntry] = []
    real_spawn = cluster.spawn

    def spawn(entry_id, argv, log_path, env, role=None, cpus=()):
        if len(started) == 2:
            raise OSError(f"cannot start {entry_id}")
        entry = real_spawn(entry_id, ["sleep", "120"], log_path, env, role, cpus)
        started.append(entry)
        return entry

    monkeypatch.setattr(cluster.processes, "spawn", spawn)
    monkeypatch.setattr(cluster, "wait_ready", lambda *a, **k: None)
    try:
        code = cli.main(["up", "--prefill", "1", "--decode", "2", "--model", "m", "--port", "50996",
                         "--state-dir", str(tmp_path)])  # fmt: skip
        assert code == 1  # one line, not a traceback
        assert [e.id for e in started] == ["router", "prefill-1"]
        assert not any(cluster.alive(e) for e in started)
        assert cluster.load_state(tmp_path) is None
        err = capsys.readouterr().err
        assert "start failed, stopping what was started: OSError: cannot start decode-2" in err
        assert "pdserve up: cannot start decode-2" in err
    finally:
        cluster.stop_processes(started, term_timeout_s=5.0)


def test_spawn_workers_stops_its_own_batch_when_one_cannot_start(monkeypatch, tmp_path):
    started: list[cluster.ProcessEntry] = []
    real_spawn = cluster.spawn

    def spawn(entry_id, argv, log_path, env, role=None, cpus=()):
        if len(started) == 2:
            raise OSError("no more processes")
        entry = real_spawn(entry_id, ["sleep", "120"], log_path, env, role, cpus)
        started.append(entry)
        return entry

    monkeypatch.setattr(cluster.processes, "spawn", spawn)
    router = cluster.ProcessEntry(id="router", pid=1, start=-1, log="r.log")
    state = cluster.ClusterState("127.0.0.1:1", router, model="m", dtype="float32", threads=1, host="h")
    try:
        with pytest.raises(OSError):
            cluster.spawn_workers(tmp_path, state, Role.DECODE, 3)
        assert len(started) == 2 and not any(cluster.alive(e) for e in started)
    finally:
        cluster.stop_processes(started, term_timeout_s=5.0)


def test_chat_takes_device_and_dtype():
    from pdserve.engine.chat import parse_args

    a = parse_args([])
    assert (a.dtype, a.device) == ("auto", "cpu")
    assert parse_args(["--dtype", "float16", "--device", "cuda:1"]).device == "cuda:1"
    r = subprocess.run(
        [sys.executable, "-m", "pdserve.engine.chat", "--dtype", "int4"], capture_output=True, text=True
    )
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_quantization_reaches_every_worker_up_and_scale_start(launcher, capsys):
    """``up --quantization int8`` hands it to each worker it starts, and ``scale`` reuses it (a cluster
    keeps one quantization: KV from an int8 prefill is refused by an unquantised decode worker)."""
    from pdserve.decode_pool.app import engine_config

    sd = ["--state-dir", str(launcher.state_dir)]
    up = [
        "up",
        "--prefill",
        "1",
        "--decode",
        "1",
        "--model",
        "m",
        "--port",
        "50998",
        "--quantization",
        "int8",
    ]
    assert cli.main([*up, *sd]) == 0
    assert cli.main(["scale", "--decode", "2", *sd]) == 0
    for wid in ("prefill-1", "decode-2", "decode-3"):
        w = parsed_worker(launcher.argvs[wid])
        assert w.quantization == "int8" and engine_config(w).quantization == "int8"
    assert (
        parsed_worker(launcher.argvs["prefill-1"])
        .worker_info("h:1", kv_blocks_total=1, context_length=1, pid=1, dtype="float32", device="cpu")
        .quantization
        == "int8"
    )
    p = cli.build_parser()
    assert p.parse_args(["worker", "--role", "decode", "--router", "r:1"]).quantization == "none"
    for bad in (["up", "--quantization", "int4"], ["scale", "--quantization", "int8"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
    assert kv_model_id("m", "none") == "m" and kv_model_id("m", "int8") == "m+int8"
