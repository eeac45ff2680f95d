"""`pdserve up` makes the cluster token, and a worker started without it cannot join."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from pdserve.cli import main as cli
from pdserve.deploy.local import cluster
from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.worker.auth import (
    read_token_file,
    token_metadata,
)
from tests.e2e.cluster_harness import free_port
from tests.fake_workers import make_model_dir


@pytest.mark.slow
def test_up_makes_a_token_and_a_worker_without_it_cannot_join(tmp_path, capsys):
    """`pdserve up` (fake workers, no model load): its processes share a new token; one started by hand
    without it is refused; `status`/`scale`/`down` use the state's token."""
    state_dir = tmp_path / "state"
    port = free_port()
    model = make_model_dir(tmp_path / "model")
    base = ["--state-dir", str(state_dir)]
    up = [
        "up",
        "--prefill",
        "0",
        "--decode",
        "0",
        "--colocated",
        "1",
        "--model",
        str(model),
        "--port",
        str(port),
        "--http-port",
        "0",
    ]
    assert cli.main([*up, "--worker-module", "tests.fake_workers", "--timeout", "60", *base]) == 0
    stray = None
    try:
        state = cluster.load_state(state_dir)
        token_file = Path(state.token_file)
        assert token_file.parent == state_dir.resolve() and stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert cli.main(["status", "--json", *base]) == 0 and '"both-1"' in capsys.readouterr().out
        # Without the token: status by address is refused, and so is a worker joining.
        assert cli.main(["status", "--router", state.router_address]) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        env = {k: v for k, v in os.environ.items() if k != "PDSERVE_CLUSTER_TOKEN_FILE"}
        argv = [
            sys.executable,
            "-m",
            "pdserve.cli",
            "worker",
            "--role",
            "both",
            "--router",
            state.router_address,
        ]
        argv += ["--worker-module", "tests.fake_workers", "--model", str(model), "--worker-id", "stray"]
        stray = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        assert stray.returncode != 0 and "UNAUTHENTICATED" in stray.stderr
        # The workers take calls only from holders of the token too (the router sends it).
        worker = json.loads(_status_json(base, capsys))["workers"][0]["address"]
        with grpc.insecure_channel(worker) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.GetLoad(worker_pb2.Empty(), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            meta = token_metadata(read_token_file(token_file))
            assert stub.GetLoad(worker_pb2.Empty(), timeout=10, metadata=meta).kv_blocks_total > 0
        # With it (by flag): the same status works.
        assert (
            cli.main(["status", "--router", state.router_address, "--cluster-token-file", str(token_file)])
            == 0
        )
        assert "stray" not in capsys.readouterr().out
        assert cli.main(["scale", "--colocated", "2", "--timeout", "60", *base]) == 0
        assert cli.main(["scale", "--colocated", "1", "--timeout", "60", *base]) == 0
        capsys.readouterr()
        assert cli.main(["status", "--json", *base]) == 0  # the leak check: no KV block in use

        assert json.loads(capsys.readouterr().out)["totals"]["kv_blocks_used"] == 0
    finally:
        assert cli.main(["down", *base]) == 0
    assert not cluster.load_state(state_dir)


def _status_json(base: list[str], capsys) -> str:
    capsys.readouterr()
    assert cli.main(["status", "--json", *base]) == 0
    return capsys.readouterr().out
