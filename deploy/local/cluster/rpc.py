"""The launcher's calls to its cluster's router (status, drain, promote, health), made with the cluster's
token and TLS files."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.deploy.local.cluster.state import ClusterState
from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.worker.auth import read_token_file, token_metadata
from pdserve.worker.tls import NO_TLS, TLSConfig, channel

GENERATION_SERVICE = "pdserve.v1.Generation"
_RPC_TIMEOUT_S = 2.0


def state_token(state: ClusterState) -> str:
    """The cluster token of a cluster `up` started ("" for one without)."""
    return read_token_file(state.token_file) if state.token_file else ""


def state_tls(state: ClusterState) -> TLSConfig:
    """How to call the router of a cluster `up` started: its TLS files (NO_TLS for one without)."""
    return TLSConfig.load(state.tls_cert, state.tls_key, state.tls_ca)


def cluster_status(
    address: str, timeout_s: float = _RPC_TIMEOUT_S, token: str = "", tls: TLSConfig = NO_TLS
) -> worker_pb2.ClusterStatus:
    with channel(address, tls) as ch:
        stub = worker_pb2_grpc.RegistryStub(ch)
        return stub.GetClusterStatus(worker_pb2.Empty(), timeout=timeout_s, metadata=token_metadata(token))


def drain_worker(address: str, worker_id: str, token: str = "", tls: TLSConfig = NO_TLS) -> bool:
    with channel(address, tls) as ch:
        stub = worker_pb2_grpc.RegistryStub(ch)
        req = worker_pb2.DrainWorkerRequest(worker_id=worker_id)
        return stub.DrainWorker(req, timeout=_RPC_TIMEOUT_S, metadata=token_metadata(token)).found


def promote_worker(
    address: str, worker_id: str, token: str = "", tls: TLSConfig = NO_TLS
) -> worker_pb2.PromoteWorkerResponse:
    """Take a warm-pool worker into routing (the router's PromoteWorker)."""
    with channel(address, tls) as ch:
        stub = worker_pb2_grpc.RegistryStub(ch)
        req = worker_pb2.PromoteWorkerRequest(worker_id=worker_id)
        return stub.PromoteWorker(req, timeout=_RPC_TIMEOUT_S, metadata=token_metadata(token))


def router_serving(address: str, tls: TLSConfig = NO_TLS) -> bool:
    try:
        with channel(address, tls) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=GENERATION_SERVICE), timeout=_RPC_TIMEOUT_S
            )
    except grpc.RpcError:
        return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING
