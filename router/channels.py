"""The router's connection pool: one gRPC channel per worker address, and every worker call's metadata."""

from __future__ import annotations

import secrets

import grpc

from pdserve.proto import worker_pb2_grpc
from pdserve.worker.auth import token_metadata
from pdserve.worker.convert import request_id_metadata
from pdserve.worker.tls import NO_TLS, TLSConfig, aio_channel


class WorkerChannels:
    """One channel per worker address, reused by every request to that worker; and the metadata of
    every call: the request's id and, when configured, the cluster token the workers require."""

    def __init__(self, cluster_token: str = "", tls: TLSConfig = NO_TLS) -> None:
        self._stubs: dict[str, tuple[grpc.aio.Channel, worker_pb2_grpc.WorkerStub]] = {}
        self._token_meta = token_metadata(cluster_token)
        self._tls = tls  # over TLS, presenting the router's certificate (mutual TLS with a CA)
        # A client's request id is unique at one router only, and a worker serves every router: each
        # router names its requests to the workers with its own random tag appended.
        self.router_tag = secrets.token_hex(4)

    def worker_request_id(self, request_id: str) -> str:
        """The id a request has on the workers: ``<client id>@<this router's tag>``."""
        return f"{request_id}@{self.router_tag}"

    def metadata(self, request_id: str) -> tuple[tuple[str, str], ...]:
        return request_id_metadata(request_id) + self._token_meta

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        entry = self._stubs.get(address)
        if entry is None:
            channel = aio_channel(address, self._tls)
            entry = self._stubs[address] = (channel, worker_pb2_grpc.WorkerStub(channel))
        return entry[1]

    async def close_except(self, keep: set[str]) -> None:
        """Close channels to addresses no worker or request uses any more."""
        for address in [a for a in self._stubs if a not in keep]:
            channel, _ = self._stubs.pop(address)
            await channel.close()

    async def close(self) -> None:
        await self.close_except(set())
