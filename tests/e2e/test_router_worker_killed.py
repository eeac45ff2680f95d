"""A worker process killed mid-stream fails its request and leaves the router's registry."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from tests.fake_workers import make_model_dir
from tests.unit.test_router_server import (  # the in-process router harness
    cluster,
    expect_error,
    request,
    run,
    until,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("router-model"))


def test_worker_killed_mid_stream_fails_the_request_and_leaves_the_registry(model_dir):
    async def main():
        async with cluster(model_dir, []) as (server, stub):
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "pdserve.cli",
                    "worker",
                    "--role",
                    "both",
                    "--router",
                    server.address,
                    "--worker-id",
                    "k1",
                    "--threads",
                    "1",
                    "--worker-module",
                    "tests.fake_workers",
                ],
                cwd=Path(__file__).resolve().parents[2],
                start_new_session=True,
            )
            try:
                reg = server.router.registry
                await until(lambda: reg.get("k1") is not None and reg.ready(), 30, "the worker to register")
                hold = request(max_tokens=4)
                hold.request_id = "hold-1"  # the fake stops after output 0 until it drains
                call = stub.Generate(hold)
                assert (await call.read()).text == " hello"
                os.kill(proc.pid, signal.SIGKILL)
                details = await expect_error(call, grpc.StatusCode.UNAVAILABLE)
                assert "k1" in details
                assert reg.get("k1") is None  # marked dead at once, not at heartbeat expiry
                await expect_error(stub.Generate(request()), grpc.StatusCode.UNAVAILABLE)
            finally:
                proc.kill()
                proc.wait(timeout=10)

    run(main())
