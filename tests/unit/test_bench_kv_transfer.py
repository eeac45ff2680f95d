"""``benchmarks.kv_transfer``'s command line: which transports a device may use, and a clear error where CUDA
is asked for without a CUDA device. No peer process is started (``run`` is replaced)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from benchmarks import kv_transfer as bench
from pdserve.kv_transfer.testing import PeerSpec
from pdserve.kv_transfer.wire import PROTOCOL_VERSION


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """What ``main`` asked ``run`` for, instead of running it."""
    calls: list[dict[str, Any]] = []

    def fake_run(transports: list[str], reps: int, *args: Any) -> dict[str, Any]:
        calls.append({"transports": transports, "reps": reps, "args": args})
        return {"rows": [], "bit_exact": [{"ok": True}]}

    monkeypatch.setattr(bench, "run", fake_run)
    return calls


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2  # argparse's usage error, before any process starts
    return capsys.readouterr().err


def test_cuda_without_a_cuda_device_is_a_clear_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], runs: list[dict[str, Any]]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _error(capsys, ["--device", "cuda"])
    assert "--device cuda needs a CUDA device" in err
    err = _error(capsys, ["--device", "cuda", "--transports", "cuda", "--tokens", "256,1024,4096"])
    assert "--device cuda needs a CUDA device" in err
    assert not runs


def test_the_cuda_transport_needs_device_cuda(
    capsys: pytest.CaptureFixture[str], runs: list[dict[str, Any]]
) -> None:
    err = _error(capsys, ["--transports", "cuda"])
    assert "transports cuda do not move cpu memory" in err and "tcp,shm" in err
    err = _error(capsys, ["--transports", "tcp,cuda", "--device", "cpu"])
    assert "transports cuda do not move cpu memory" in err
    assert "invalid choice" in _error(capsys, ["--device", "gpu"])
    assert not runs


def test_host_transports_are_refused_on_cuda(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], runs: list[dict[str, Any]]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    err = _error(capsys, ["--device", "cuda", "--transports", "tcp,shm"])
    assert "transports tcp,shm do not move cuda memory (with --device cuda: cuda,cuda_ipc)" in err
    assert not runs


def test_each_device_gets_its_transports_by_default(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], runs: list[dict[str, Any]]
) -> None:
    bench.main(["--reps", "3"])
    assert runs[-1]["transports"] == ["tcp", "shm"]
    assert runs[-1]["args"][-2:] == ("cpu", 0)  # (device, burst)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    bench.main(["--device", "cuda", "--transports", "cuda", "--tokens", "256,1024,4096", "--reps", "5"])
    assert runs[-1]["transports"] == ["cuda"] and runs[-1]["reps"] == 5
    ucx_env, tokens, modes, device, burst = runs[-1]["args"]
    assert (tokens, modes, device, burst) == ((256, 1024, 4096), ("rma", "tagged"), "cuda", 0)
    bench.main(["--device", "cuda"])
    assert runs[-1]["transports"] == ["cuda", "cuda_ipc"]
    assert json.loads(capsys.readouterr().out.split("\n}\n")[0] + "}")["bit_exact"] == [{"ok": True}]


def test_a_bit_exactness_failure_fails_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    report = {"rows": [], "bit_exact": [{"transport": "tcp", "mode": "rma", "ok": False}]}
    monkeypatch.setattr(bench, "run", lambda *a: report)
    with pytest.raises(SystemExit) as exc:
        bench.main(["--transports", "tcp"])
    assert "KV received differs" in str(exc.value.code)


def test_a_failed_pair_fails_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    failed = {"transport": "cuda", "mode": "rma", "layout": "payload", "error": "PeerCallError: put refused"}
    monkeypatch.setattr(bench, "run", lambda *a: {"rows": [], "bit_exact": [], "errors": [failed]})
    with pytest.raises(SystemExit) as exc:
        bench.main(["--transports", "tcp"])
    assert "put refused" in str(exc.value.code)


def test_every_transport_names_its_device() -> None:
    assert set(bench.TRANSPORT_DEVICE) == set(bench.TRANSPORTS)
    assert set(bench.TRANSPORT_DEVICE.values()) <= set(bench.DEVICES)
    tls, same_host = bench.TRANSPORTS["cuda"]
    # ucxx refuses CUDA buffers without cuda_copy; cross-memory attach cannot write device memory.
    assert {"cuda_copy", "cuda_ipc"} <= set(tls.split(",")) and not same_host
    tls, same_host = bench.TRANSPORTS["cuda_ipc"]  # pdserve's writes by CUDA IPC on one host
    assert {"cuda_copy", "cuda_ipc"} <= set(tls.split(",")) and same_host


def test_peer_spec_takes_only_known_devices() -> None:
    assert PeerSpec().device == "cpu"
    assert PeerSpec(device="cuda").device == "cuda"  # checked, not allocated: no GPU needed
    with pytest.raises(ValueError, match="device must be one of cpu, cuda"):
        PeerSpec(device="gpu")


def test_run_reports_a_failed_pair_and_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    class Refused:
        def __init__(self, layout: dict[str, Any], *args: Any) -> None:
            self.layers = layout["num_layers"]

        def __enter__(self) -> None:
            raise RuntimeError(f"peer refused ({self.layers} layers)")

        def __exit__(self, *exc: object) -> None:
            pass

    monkeypatch.setattr(bench, "_Pair", Refused)
    report = bench.run(["tcp"], 1, tokens=(16,))
    assert report["rows"] == [] and report["bit_exact"] == [] and report["device"] == {"type": "cpu"}
    assert report["machine"]["isa"] and report["machine"]["device"] == {"type": "cpu"}
    assert report["protocol"] == PROTOCOL_VERSION
    assert [(e["mode"], e["layout"]) for e in report["errors"]] == [
        ("rma", "smollm2"), ("rma", "payload"), ("tagged", "smollm2"), ("tagged", "payload"),
    ]  # fmt: skip
    assert report["errors"][1]["error"] == "RuntimeError: peer refused (1 layers)"


def test_burst_reaches_the_run_and_a_negative_one_is_refused(
    runs: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    bench.main(["--transports", "tcp", "--burst", "30"])
    assert runs[-1]["args"][-1] == 30  # layers per push call, handed to ``run``
    bench.main(["--transports", "tcp"])
    assert runs[-1]["args"][-1] == 0  # the default: one push per layer
    assert "--burst must be >= 0" in _error(capsys, ["--burst", "-1"])
