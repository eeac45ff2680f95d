"""The cluster token (``worker.auth``): without it no process joins the pools or reads the cluster.

In-process router with a token and fake workers, then a local cluster from ``pdserve up`` (which makes a
token per cluster) where a worker started by hand without the token cannot join. Every test that starts
workers ends with a leak check.
"""

from __future__ import annotations

import contextlib
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
from pdserve.engine.tokenizer import Tokenizer
from pdserve.proto import generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.router.config import RouterConfig
from pdserve.router.server import RouterServer
from pdserve.router.validate import ModelLimits
from pdserve.worker.agent import RegistrationError
from pdserve.worker.auth import (
    TOKEN_METADATA_KEY,
    TokenError,
    read_token_file,
    token_metadata,
    write_new_token,
)
from pdserve.worker.role import Role
from tests.cluster_harness import free_port
from tests.fake_workers import FakeWorker, ids, make_model_dir
from tests.test_router_server import collect, request, run, until

TOKEN = "t" * 16 + "-cluster-secret"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("token-model"))


def refused(server: RouterServer, method: str) -> float:
    value = server.router.metrics.registry.get_sample_value(
        "pdserve_auth_refused_total", {"role": "router", "method": method}
    )
    return value or 0.0


def test_workers_and_callers_without_the_token_are_refused(model_dir):
    async def main():
        server = RouterServer(RouterConfig(port=0, heartbeat_interval_s=0.05, cluster_token=TOKEN))
        await server.start()
        await server.set_frontend(Tokenizer.from_dir(model_dir), ModelLimits.from_model_dir(model_dir))
        good = FakeWorker("b1", Role.BOTH, ids("hello world"))
        stranger = FakeWorker("x1", Role.BOTH, ids("cat cat"))
        impostor = FakeWorker("x2", Role.BOTH, ids("cat cat"))
        try:
            with pytest.raises(RegistrationError, match="UNAUTHENTICATED"):
                await stranger.start(server.address, register_timeout_s=5)
            with pytest.raises(RegistrationError, match="UNAUTHENTICATED"):
                await impostor.start(server.address, register_timeout_s=5, cluster_token="w" * 32)
            assert refused(server, "/pdserve.internal.v1.Registry/Register") == 2
            await good.start(server.address, cluster_token=TOKEN)
            assert [w.worker_id for w in server.router.registry] == ["b1"]  # only the one with the token

            async with grpc.aio.insecure_channel(server.address) as channel:
                registry = worker_pb2_grpc.RegistryStub(channel)
                for meta in ((), token_metadata("nope" * 8)):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await registry.GetClusterStatus(worker_pb2.Empty(), metadata=meta)
                    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await registry.DrainWorker(
                            worker_pb2.DrainWorkerRequest(worker_id="b1"), metadata=meta
                        )
                    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                status = await registry.GetClusterStatus(worker_pb2.Empty(), metadata=token_metadata(TOKEN))
                assert [e.info.worker_id for e in status.workers] == ["b1"]
                # Users need no token: the Generation service is the public API.
                tokens, _, _ = await collect(
                    generation_pb2_grpc.GenerationStub(channel).Generate(request("the cat", max_tokens=2))
                )
                assert tokens == ids("hello world")
            assert not good.active and not good.cancelled
            await until(lambda: not server.router.ledger.jobs, what="the leak check")
        finally:
            for w in (good, stranger, impostor):
                with contextlib.suppress(Exception):
                    await w.stop()
            await server.stop(grace_s=0)

    run(main())


def test_token_files(tmp_path):
    path = write_new_token(tmp_path / "sub" / "token")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    token = read_token_file(path)
    assert len(token) >= 32 and read_token_file(write_new_token(tmp_path / "other")) != token
    (tmp_path / "short").write_text("abc\n")
    with pytest.raises(TokenError, match="at least 16"):
        read_token_file(tmp_path / "short")
    with pytest.raises(TokenError, match="cannot read"):
        read_token_file(tmp_path / "missing")
    assert token_metadata("") == () and token_metadata(token) == ((TOKEN_METADATA_KEY, token),)


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
