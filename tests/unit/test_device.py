"""``--device``, ``--dtype auto`` and ``--gpu-memory-utilization``: resolution, validation, and the way from
the CLI through the local launcher and the worker to the engine; NVML metrics of a GPU worker's device.

No GPU is needed: CUDA's presence and CPU flags are stand-ins (``engine.device``'s hooks)."""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry

from pdserve.cli import main as cli
from pdserve.cli import serve_cmds
from pdserve.deploy.local import cluster
from pdserve.engine import device as dev
from pdserve.engine import llm_engine
from pdserve.engine.llm_engine import EngineConfig, LLMEngine, engine_config_fields
from pdserve.telemetry import gpu as gpu_metrics
from pdserve.worker.args import WorkerArgs
from pdserve.worker.bringup import add_device_metrics
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


def with_flags(monkeypatch, *flags: str) -> None:
    """This CPU's flags, as /proc/cpuinfo would list them (through ``cpu_kernels.cpu_isa``)."""
    from pdserve.engine import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: "flags\t\t: fpu sse2 " + " ".join(flags))


# -- resolution ---------------------------------------------------------------------------------------------
def test_resolve_device(gpus):
    assert dev.resolve_device("cpu") == "cpu"
    for bad in ("gpu", "cuda:", "cuda:-1", "cpu:0", "CUDA", "", "cuda:1:2", "mps", " cuda"):
        with pytest.raises(ValueError, match="device must be cpu, cuda .GPU 0. or cuda:N"):
            dev.resolve_device(bad)
    with pytest.raises(ValueError, match="CUDA is not available here.*--device cpu"):
        dev.resolve_device("cuda")
    gpus.set(2)
    assert dev.resolve_device("cuda") == "cuda:0" and dev.resolve_device("cuda:1") == "cuda:1"
    with pytest.raises(
        ValueError, match=r"'cuda:2' asked for, but this process sees 2 CUDA device\(s\): cuda:0, cuda:1"
    ):
        dev.resolve_device("cuda:2")
    assert dev.resolve_device("cuda:7", cuda_count=lambda: 8) == "cuda:7"
    assert [dev.device_index(d) for d in ("cpu", "cuda", "cuda:3")] == [None, 0, 3]


def test_resolve_device_on_this_host():
    if torch.cuda.is_available():
        assert dev.resolve_device("cuda") == "cuda:0"
    else:
        with pytest.raises(ValueError, match="CUDA is not available"):
            dev.resolve_device("cuda")


def test_resolve_dtype_auto_by_device_and_cpu_flags():
    for dtype in ("float32", "bfloat16", "float16"):
        assert dev.resolve_dtype(dtype, "cpu", cpu_flags=()) == dtype
        assert dev.resolve_dtype(dtype, "cuda:0", cuda_bf16=lambda i: True) == dtype
    assert (
        dev.resolve_dtype("auto", "cpu", cpu_flags=["avx2", "fma"]) == "float32"
    )  # AVX2 only: fp32 is faster
    assert dev.resolve_dtype("auto", "cpu", cpu_flags=["avx512f", "avx512_vnni"]) == "float32"
    assert dev.resolve_dtype("auto", "cpu", cpu_flags=["avx512f", "avx512_bf16"]) == "bfloat16"
    assert dev.resolve_dtype("auto", "cpu", cpu_flags=["amx_bf16"]) == "bfloat16"
    assert dev.resolve_dtype("auto", "cpu", cpu_flags=["asimd"]) == "float32"
    asked: list[int] = []
    assert dev.resolve_dtype("auto", "cuda:1", cuda_bf16=lambda i: asked.append(i) or True) == "bfloat16"
    assert asked == [1]
    assert dev.resolve_dtype("auto", "cuda", cuda_bf16=lambda i: False) == "float16"  # pre-Ampere: no bf16
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16, float16, got 'int8'"):
        dev.resolve_dtype("int8", "cpu")


def test_auto_reads_the_cpu_flags_cpu_kernels_reads(monkeypatch):
    with_flags(monkeypatch, "avx2", "avx512f", "avx512_bf16")
    assert dev.resolve_dtype("auto", "cpu") == "bfloat16"
    with_flags(monkeypatch, "avx2", "fma", "amx_tile", "amx_bf16")
    assert dev.resolve_dtype("auto", "cpu") == "bfloat16"
    with_flags(monkeypatch, "avx2", "fma")
    assert dev.resolve_dtype("auto", "cpu") == "float32"


def test_gpu_memory_utilization_range():
    assert dev.check_gpu_memory_utilization(1) == 1.0 and dev.check_gpu_memory_utilization(0.05) == 0.05
    for bad in (0, 0.0, -0.5, 1.01, 90, True, "0.9", float("nan")):
        with pytest.raises(ValueError, match=r"gpu_memory_utilization must be a fraction in \(0, 1\]"):
            dev.check_gpu_memory_utilization(bad)


# -- EngineConfig and the engine ----------------------------------------------------------------------------
def test_engine_config_keeps_the_request_and_resolves_it(monkeypatch, gpus):
    c = EngineConfig()
    assert (c.dtype, c.device, c.gpu_memory_utilization) == ("auto", "cpu", 0.9)
    assert c.resolved_device == "cpu" and c.resolved_dtype == dev.resolve_dtype("auto", "cpu")
    with_flags(monkeypatch, "avx512_bf16")
    c = EngineConfig()
    assert (c.dtype, c.resolved_dtype, c.torch_dtype) == ("auto", "bfloat16", torch.bfloat16)
    with_flags(monkeypatch, "avx2")
    assert EngineConfig().torch_dtype == torch.float32
    assert dataclasses.replace(c, dtype="float16").resolved_dtype == "float16"  # recomputed, not copied
    assert EngineConfig(dtype=torch.bfloat16).dtype == "bfloat16"
    gpus.set(2, bf16=True)
    c = EngineConfig(device="cuda", gpu_memory_utilization=0.5)
    assert (c.device, c.resolved_device, c.resolved_dtype, c.gpu_memory_utilization) == (
        "cuda",
        "cuda:0",
        "bfloat16",
        0.5,
    )
    assert EngineConfig(device="cuda:1", dtype="float32").resolved_dtype == "float32"
    # What LLM(**options) takes: the requested values, never the resolved ones.
    fields = engine_config_fields()
    assert {"dtype", "device", "gpu_memory_utilization"} <= fields and not {"resolved_dtype"} & fields


def test_engine_config_errors(gpus):
    for kwargs, match in (
        ({"dtype": "int8"}, "dtype must be one of auto, float32"),
        ({"device": "tpu"}, "device must be cpu, cuda"),
        ({"gpu_memory_utilization": 0}, "gpu_memory_utilization must be a fraction"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be a fraction"),
        ({"device": "cuda"}, "CUDA is not available"),
    ):
        with pytest.raises(ValueError, match=match):
            EngineConfig(**kwargs)
    gpus.set(1)
    with pytest.raises(ValueError, match="sees 1 CUDA device"):
        EngineConfig(device="cuda:1")


def test_the_engine_runs_and_reports_the_resolved_dtype(tiny_llama_dir, monkeypatch, caplog):
    seen: list[dict] = []

    real = llm_engine.build_runner

    def recording(model_dir, *args, **kwargs):
        seen.append(kwargs)
        return real(model_dir, *args, **kwargs)

    monkeypatch.setattr(llm_engine, "build_runner", recording)
    # Not cpu_kernels' flags here: they also key the kernel library's build cache.
    monkeypatch.setattr(dev, "host_cpu_flags", lambda: ["avx512f", "avx512_bf16"])
    caplog.set_level(logging.INFO, logger="pdserve.engine.llm_engine")
    engine = LLMEngine(tiny_llama_dir, None, EngineConfig(num_blocks=8, gpu_memory_utilization=0.3))
    assert (engine.device, engine.dtype, engine.runner.kv.dtype) == ("cpu", "bfloat16", torch.bfloat16)
    assert seen[-1]["dtype"] == torch.bfloat16 and seen[-1]["device"] == "cpu"
    assert seen[-1]["gpu_memory_utilization"] == 0.3  # the runner ignores it on CPU
    assert "on cpu in bfloat16 (dtype auto asked)" in caplog.text
    monkeypatch.setattr(dev, "host_cpu_flags", lambda: ["avx2", "fma"])
    engine = LLMEngine(tiny_llama_dir, None, EngineConfig(num_blocks=8))
    assert engine.dtype == "float32" and engine.runner.kv.dtype == torch.float32


# -- the worker ---------------------------------------------------------------------------------------------
def wargs(**kw) -> WorkerArgs:
    return WorkerArgs(role=Role.DECODE, router="r:1", worker_id="w", **kw)


def test_worker_args_validate_and_size_the_cache():
    w = wargs()
    assert (w.dtype, w.device, w.gpu_memory_utilization) == ("auto", "cpu", 0.9)
    for kw, match in (
        ({"dtype": "int8"}, "dtype must be one of"),
        ({"device": "gpu:0"}, "device must be"),
        ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"),
    ):
        with pytest.raises(ValueError, match=match):
            wargs(**kw)
    assert wargs(device="cuda:3").device == "cuda:3"  # syntax only: the worker's host checks the GPU
    assert wargs().kv_cache_bytes_or(123) == 123
    assert wargs(kv_blocks=5).kv_cache_bytes_or(123) is None
    assert wargs(device="cuda").kv_cache_bytes_or(123) is None  # the engine sizes it from the utilization
    assert wargs(device="cuda", kv_cache_bytes=77).kv_cache_bytes_or(123) == 77


def test_decode_pool_engine_config_carries_device_dtype_and_utilization(gpus):
    from pdserve.decode_pool.app import DEFAULT_DECODE_KV_BYTES, engine_config

    c = engine_config(wargs(dtype="bfloat16"))
    assert (c.device, c.resolved_dtype, c.kv_cache_bytes) == ("cpu", "bfloat16", DEFAULT_DECODE_KV_BYTES)
    gpus.set(2, bf16=True)
    c = engine_config(wargs(device="cuda:1", gpu_memory_utilization=0.45))
    assert (c.resolved_device, c.resolved_dtype, c.gpu_memory_utilization) == ("cuda:1", "bfloat16", 0.45)
    assert c.kv_cache_bytes is None and c.num_blocks is None


def test_cli_worker_flags_reach_worker_args(gpus, capsys):
    p = cli.build_parser()
    a = p.parse_args(
        ["worker", "--role", "prefill", "--router", "r:1", "--device", "cuda:1", "--dtype", "float16"]
        + ["--gpu-memory-utilization", "0.25"]
    )
    w = serve_cmds.worker_args(a, "h", 1, cpus=2)
    assert (w.device, w.dtype, w.gpu_memory_utilization) == ("cuda:1", "float16", 0.25)
    a = p.parse_args(["up", "--device", "cuda", "--gpu-memory-utilization", "1"])
    assert (a.device, a.gpu_memory_utilization, a.dtype) == ("cuda", 1.0, "auto")
    a = p.parse_args(["scale", "--decode", "2"])
    assert (a.device, a.gpu_memory_utilization) == (None, None)  # the cluster's
    # No GPU here: the worker says so in one line and starts nothing.
    assert cli.main(["worker", "--role", "decode", "--router", "127.0.0.1:9", "--device", "cuda"]) == 2
    assert "pdserve worker: device 'cuda' asked for, but CUDA is not available" in capsys.readouterr().err


def test_a_bad_device_or_fraction_is_a_usage_error(capsys):
    p = cli.build_parser()
    with pytest.raises(SystemExit):
        p.parse_args(["up", "--device", "cuda0"])
    assert "device must be cpu, cuda (GPU 0) or cuda:N, got 'cuda0'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        p.parse_args(["worker", "--role", "decode", "--router", "a:1", "--gpu-memory-utilization", "95"])
    assert "must be a fraction in (0, 1]" in capsys.readouterr().err


def test_an_old_state_file_reads_as_a_cpu_cluster(tmp_path):
    import json

    router = cluster.ProcessEntry(id="router", pid=1, start=-1, log="r.log")
    state = cluster.ClusterState("127.0.0.1:1", router, model="m", dtype="float32", threads=1, host="h")
    cluster.save_state(tmp_path, state)
    doc = json.loads((tmp_path / "cluster.json").read_text())
    for key in ("device", "gpu_memory_utilization"):
        del doc[key]
    (tmp_path / "cluster.json").write_text(json.dumps(doc))
    old = cluster.load_state(tmp_path)
    assert (old.device, old.gpu_memory_utilization) == ("cpu", 0.9)


# -- NVML metrics of a GPU worker ---------------------------------------------------------------------------
class FakeNvml:
    """pynvml's calls, for GPUs named by UUID in NVML's (PCI) order; each reports its index in ``used``."""

    def __init__(self, uuids: list[str], fail_init: bool = False) -> None:
        self.uuids, self.fail_init = uuids, fail_init

    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names
        if self.fail_init:
            raise OSError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:  # noqa: N802
        pass

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return len(self.uuids)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:  # noqa: N802
        if not 0 <= i < len(self.uuids):
            raise RuntimeError("NVML_ERROR_INVALID_ARGUMENT")
        return i

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:  # noqa: N802
        if uuid not in self.uuids:
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return self.uuids.index(uuid)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:  # noqa: N802
        return SimpleNamespace(gpu=50, memory=5)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:  # noqa: N802
        return SimpleNamespace(used=h, total=80 << 30, free=0)


def gpu_samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels["gpu"]): s.value for f in registry.collect() for s in f.samples}


def test_a_gpu_worker_exports_its_own_gpu(monkeypatch, caplog):
    from pdserve.worker import bringup

    caplog.set_level(logging.DEBUG, logger="pdserve.telemetry.gpu")
    nvml = FakeNvml(["GPU-a", "GPU-b", "GPU-c"])
    # CUDA_VISIBLE_DEVICES=2,1: the worker's cuda:1 is NVML's device 1 ("GPU-b"), found by its UUID.
    monkeypatch.setattr(bringup, "cuda_uuid", lambda device: {"cuda:1": "GPU-b", "cuda:0": "GPU-c"}[device])
    reg = CollectorRegistry()
    assert add_device_metrics(reg, wargs(device="cuda:0"), nvml)
    got = gpu_samples(reg)
    assert set(got) == {
        (m, "0") for m in gpu_metrics.GPU_METRICS
    }  # only its own GPU, labelled as it names it
    assert got[(gpu_metrics.GPU_MEMORY_USED, "0")] == 2  # NVML's device 2, "GPU-c"
    # Without a UUID (torch could not say), the index.
    monkeypatch.setattr(bringup, "cuda_uuid", lambda device: "")
    reg = CollectorRegistry()
    assert add_device_metrics(reg, wargs(device="cuda:1"), nvml)
    assert gpu_samples(reg)[(gpu_metrics.GPU_MEMORY_USED, "1")] == 1
    # A CPU worker exports none; a GPU NVML does not have, none, quietly.
    assert not add_device_metrics(CollectorRegistry(), wargs(), nvml)
    reg = CollectorRegistry()
    assert not add_device_metrics(reg, wargs(device="cuda:5"), nvml) and not gpu_samples(reg)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_gpu_worker_without_driver_or_nvml_is_not_an_error(monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger="pdserve.telemetry.gpu")
    reg = CollectorRegistry()
    assert not add_device_metrics(reg, wargs(device="cuda"), FakeNvml(["GPU-a"], fail_init=True))
    monkeypatch.setattr(gpu_metrics, "_import_nvml", lambda: None)  # nvidia-ml-py not installed
    assert not add_device_metrics(reg, wargs(device="cuda"))
    assert not gpu_samples(reg)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_this_hosts_cuda_uuid_is_empty_without_a_gpu():
    assert dev.cuda_uuid("cpu") == ""
    if not torch.cuda.is_available():
        assert dev.cuda_uuid("cuda:0") == ""


def test_a_worker_without_a_loadable_tokenizer_registers_no_vocabulary_digest(tmp_path, caplog):
    """The digest the router checks (``worker.bringup.vocab_digest``): none without tokenizer files, none
    (with a warning, the worker still starts) when they do not parse; the tokenizer's own otherwise."""
    from pdserve.engine.tokenizer import Tokenizer
    from pdserve.worker.bringup import vocab_digest
    from tests.fake_workers import make_model_dir

    good = make_model_dir(tmp_path / "good")
    assert vocab_digest(good) == Tokenizer.from_dir(good).vocab_digest != ""
    assert vocab_digest(tmp_path) == ""
    broken = make_model_dir(tmp_path / "broken")
    (broken / "tokenizer.json").write_text("{not json")
    with caplog.at_level(logging.WARNING):
        assert vocab_digest(broken) == ""
    assert "no vocabulary digest" in caplog.text
