"""The cluster token (``worker.auth``): without it no process joins the pools or reads the cluster.

In-process router with a token and fake workers, then a local cluster from ``pdserve up`` (which makes a
token per cluster) where a worker started by hand without the token cannot join. Every test that starts
workers ends with a leak check.
"""

from __future__ import annotations

import contextlib
import stat
from pathlib import Path

import grpc
import pytest

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
from tests.fake_workers import FakeWorker, ids, make_model_dir
from tests.unit.test_router_server import collect, request, run, until

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
