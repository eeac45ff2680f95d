"""The router's control plane: ``pdserve.internal.v1.Registry`` for workers and the CLI (register,
heartbeat, drain, promote, cluster status). Every change that may free capacity wakes the requests
waiting in admission."""

from __future__ import annotations

import logging
import time

import grpc

from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.router.registry import State, Worker
from pdserve.router.service import Router
from pdserve.worker.role import Role

_ROLES = {
    worker_pb2.ROLE_PREFILL: Role.PREFILL,
    worker_pb2.ROLE_DECODE: Role.DECODE,
    worker_pb2.ROLE_BOTH: Role.BOTH,
}
_STATES = {
    worker_pb2.WORKER_STATE_LOADING: State.LOADING,
    worker_pb2.WORKER_STATE_READY: State.READY,
    worker_pb2.WORKER_STATE_DRAINING: State.DRAINING,
    worker_pb2.WORKER_STATE_STOPPED: State.STOPPED,
    worker_pb2.WORKER_STATE_STANDBY: State.STANDBY,
}
_STATE_TO_PROTO = {v: k for k, v in _STATES.items()}

log = logging.getLogger(__name__)


def _check_info(info: worker_pb2.WorkerInfo) -> str | None:
    """Why a registration is unusable, or None."""
    if not info.worker_id:
        return "worker_id is empty"
    if not info.address:
        return "address is empty"
    role = _ROLES.get(info.role)
    if role is None:
        return "role is unspecified"
    if role.decodes:
        for name in ("kv_blocks_total", "block_size", "max_running"):
            if getattr(info, name) < 1:
                return f"{name} must be >= 1 for a worker that decodes"
    return None


def _incompatible(info: worker_pb2.WorkerInfo, router: Router) -> str | None:
    """Why a registration's KV cache cannot join this cluster's, or None.

    Every worker registers its KV compatibility record (``WorkerInfo.kv_layout``); one that differs from
    a registered worker's is refused at registration, so that a worker started with another --dtype or
    --quantization fails at start-up instead of failing every transfer (or, colocated, answering with
    another model's tokens). A worker that registers no record (older, or a test double) is not checked.
    """
    if not info.kv_layout:
        return None
    for w in router.registry:
        other = router.membership.infos.get(w.worker_id)
        if w.worker_id == info.worker_id or other is None or not other.kv_layout:
            continue
        if other.kv_layout != info.kv_layout:
            return (
                f"{info.worker_id}'s KV cache is [{info.kv_layout}] but {w.worker_id}'s is "
                f"[{other.kv_layout}]: every worker of a cluster needs the same --model, --dtype, "
                "--quantization and --block-size"
            )
    return None


def _other_vocabulary(info: worker_pb2.WorkerInfo, router: Router) -> str | None:
    """Why a worker's token ids would not mean what the router's tokenizer says they mean, or None.

    The router turns every worker's token ids into text with its own tokenizer (``--model``), so a worker
    of another model (one whose vocabulary digest differs: ``Tokenizer.vocab_digest``) would stream
    another model's tokens as this one's text, with no error anywhere. The KV record does not catch it: it
    names the model directory, not its contents. Not checked when either side has no digest.
    """
    mine = getattr(router.tokenizer, "vocab_digest", "")
    if not info.tokenizer_digest or not mine or info.tokenizer_digest == mine:
        return None
    return (
        f"{info.worker_id} runs model {info.model!r}, whose vocabulary (digest {info.tokenizer_digest}) is "
        f"not the router's (--model {router.config.model!r}, digest {mine}): the router would turn its "
        "tokens into another model's text; start the worker with the router's --model"
    )


class RegistryService(worker_pb2_grpc.RegistryServicer):
    def __init__(self, router: Router) -> None:
        self._router = router

    async def Register(self, info: worker_pb2.WorkerInfo, context: grpc.aio.ServicerContext):
        problem = _check_info(info)
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        router = self._router
        if router.closing:  # (the worker's agent retries: a router started at this address takes it)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the router is shutting down")
        if info.tokenizer_digest and router.tokenizer is None:
            # Checked against the router's tokenizer, which loads at start-up: the worker's agent retries.
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the router is still loading its tokenizer")
        mismatch = _incompatible(info, router) or _other_vocabulary(info, router)
        if mismatch is not None:
            log.error("refused registration: %s", mismatch)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, mismatch)
        w = Worker(
            worker_id=info.worker_id,
            role=_ROLES[info.role],
            address=info.address,
            kv_blocks_total=info.kv_blocks_total,
            block_size=info.block_size,
            max_running=info.max_running,
            metrics_url=info.metrics_url,
            pid=info.pid,
            instance=info.instance,
            standby=info.standby,
            prefix_cache_salt=info.prefix_cache_salt,
            tensor_parallel_size=max(info.tensor_parallel_size, 1),
        )
        now = time.monotonic()
        holder = router.registry.held_by_another(w, now)
        if holder is not None:
            # The agent retries (a restarted process waits out its predecessor's heartbeat timeout), then
            # exits saying this.
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS,
                f"worker id {w.worker_id} is registered at {holder.address} (pid {holder.pid}), which still "
                "heartbeats: give each worker its own --worker-id",
            )
        again = router.registry.get(w.worker_id) is not None
        router.registry.register(w, now)
        router.ledger.sync(w)
        info.standby = w.standby  # (promoted before it registered: it serves)
        router.membership.infos[info.worker_id] = info
        log.info(
            "worker %s %s: %s at %s (pid %d)%s",
            w.worker_id,
            "registered again" if again else "registered",
            w.role.value,
            w.address,
            w.pid,
            ", standby" if w.standby else "",
        )
        await router.admission.notify()
        return worker_pb2.RegisterResponse(heartbeat_interval_s=router.config.heartbeat_interval_s)

    async def Heartbeat(self, load: worker_pb2.WorkerLoad, context: grpc.aio.ServicerContext):
        router = self._router
        w = router.registry.heartbeat(
            load.worker_id,
            time.monotonic(),
            state=_STATES.get(load.state, State.LOADING),
            running=load.running,
            queued=load.queued,
            queued_prefill_tokens=load.queued_prefill_tokens,
            kv_blocks_used=load.kv_blocks_used,
            standby=load.standby,
        )
        if w is None:
            return worker_pb2.HeartbeatResponse(known=False)
        info = router.membership.infos.get(w.worker_id)
        if info is not None and info.standby and not w.standby:
            info.standby = False  # promoted, here or through another router
        if load.kv_blocks_total:
            w.kv_blocks_total = load.kv_blocks_total
        w.kv_blocks_cached = load.kv_blocks_cached
        w.prefill_tokens_per_s = load.prefill_tokens_per_s
        snapshot = False
        if load.HasField("kv_events"):
            if not router.kv_index.apply(w.worker_id, load.kv_events):
                router.metrics.kv_index_gaps.inc()
                snapshot = True
            router.metrics.kv_index_size(w.worker_id, router.kv_index.num_blocks(w.worker_id))
        if router.registry.get(load.worker_id) is None:
            router.membership.infos.pop(load.worker_id, None)  # it reported STOPPED
            router.kv_index.drop(load.worker_id)
            router.metrics.kv_index_size(load.worker_id, None)
            log.info("worker %s stopped", load.worker_id)
        await router.admission.notify()
        return worker_pb2.HeartbeatResponse(
            known=True,
            drain=w.drain_requested,
            standby=w.standby,
            kv_snapshot=snapshot,
            leaving=router.closing,
        )

    async def Deregister(self, info: worker_pb2.WorkerInfo, context: grpc.aio.ServicerContext):
        router = self._router
        w = router.registry.get(info.worker_id)
        # A stale deregistration (the id re-registered at another address) must not remove the new one.
        if w is not None and (not info.address or w.address == info.address):
            router.registry.remove(info.worker_id)
            # Its calls are not failed here: a worker deregisters after its in-flight calls ended.
            router.membership.infos.pop(info.worker_id, None)
            router.kv_index.drop(info.worker_id)
            router.metrics.kv_index_size(info.worker_id, None)
            log.info("worker %s left (deregistered)", info.worker_id)
        return worker_pb2.Empty()

    async def GetClusterStatus(self, request: worker_pb2.Empty, context: grpc.aio.ServicerContext):
        router = self._router
        now_mono, now_unix = time.monotonic(), time.time()
        entries = []
        for w in sorted(router.registry, key=lambda w: (w.role.value, w.worker_id)):
            info = router.membership.infos.get(w.worker_id) or worker_pb2.WorkerInfo(
                worker_id=w.worker_id, address=w.address
            )
            load = worker_pb2.WorkerLoad(
                worker_id=w.worker_id,
                state=_STATE_TO_PROTO[w.state],
                running=w.running,
                queued=w.queued,
                queued_prefill_tokens=w.queued_prefill_tokens,
                kv_blocks_used=w.kv_blocks_used,
                kv_blocks_total=w.kv_blocks_total,
                kv_blocks_cached=w.kv_blocks_cached,
                prefill_tokens_per_s=w.prefill_tokens_per_s,
            )
            last = now_unix - (now_mono - w.last_heartbeat)
            entries.append(worker_pb2.WorkerEntry(info=info, load=load, last_heartbeat_unix=last))
        return worker_pb2.ClusterStatus(
            router_address=router.address,
            workers=entries,
            requests_running=len(router.ledger.jobs),
            requests_waiting=router.admission.waiting,
            metrics_url=router.metrics_url,
            http_url=router.http_url,
            streams_moving=router.relay.streams_moving if router.relay is not None else 0,
        )

    async def PromoteWorker(
        self, request: worker_pb2.PromoteWorkerRequest, context: grpc.aio.ServicerContext
    ):
        router = self._router
        w = router.registry.promote(request.worker_id, time.monotonic())
        if w is None:
            return worker_pb2.PromoteWorkerResponse(found=False)
        if request.worker_id in router.membership.infos:
            router.membership.infos[request.worker_id].standby = False
        log.info("worker %s promoted from the warm pool", request.worker_id)
        await router.admission.notify()  # requests waiting for room may take it now
        return worker_pb2.PromoteWorkerResponse(found=True, serving=w.state is State.READY)

    async def DrainWorker(self, request: worker_pb2.DrainWorkerRequest, context: grpc.aio.ServicerContext):
        found = self._router.registry.drain(request.worker_id)
        if found:
            log.info("worker %s: drain requested", request.worker_id)
        return worker_pb2.DrainWorkerResponse(found=found)
