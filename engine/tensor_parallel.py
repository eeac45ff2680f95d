"""Tensor parallelism inside one engine: a group of N processes on ``torch.distributed`` (gloo on CPU, NCCL
on CUDA where each rank has a GPU of its own, gloo through host memory where ranks share one).

Each rank holds 1/N of every layer, Megatron-style: the q heads and the KV heads they read (a KV head is
replicated when N exceeds their count, as vLLM does), the MLP's intermediate columns, and a slice of the LM
head's vocabulary; the embedding and the norms are whole on every rank. The qkv and gate_up products are
column-parallel (no communication), o_proj and down row-parallel: their partial sums are all-reduced before
the residual add. The logits are all-gathered from the vocabulary slices. Each rank's KV cache holds its
own heads only; a follower's is in shared memory, mapped by rank 0 too, which moves every rank's KV for
the KV transfer.

Rank 0 runs the engine (scheduler, sampler, block manager) and every forward; the other ranks follow it
call by call: the runner sends each forward's arguments to them over a pipe (``TensorParallel.send``) and
they make the same call (``tp_follower``), so every rank runs the same collectives in the same order. A
follower exits when its pipe closes (rank 0 gone); a collective that a dead rank never joins fails after
``COLLECTIVE_TIMEOUT_S``, never gloo's 30-minute default. On CPU the collectives go through shared memory
(``engine.tp_host``) where they fit a slot.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import enum
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from pdserve.engine.config import ModelConfig
from pdserve.engine.env import EngineEnv
from pdserve.engine.hugepages import SharedTensor
from pdserve.engine.tp_host import HostChannels, HostCollectives, buffer_shape, close_others, make_channels

# A collective that a rank never joins (it died, or hangs) fails after this long.
COLLECTIVE_TIMEOUT_S = 30.0
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)


@dataclass(frozen=True)
class ShardLayout:
    """What rank ``rank`` of ``size`` holds of a model: q heads, KV heads, intermediate columns and LM-head
    vocabulary rows, each a range of the whole model's."""

    rank: int
    size: int
    q_heads: range
    kv_heads: range
    intermediate: range
    vocab: range
    vocab_chunk: int  # rows every rank's logits are padded to for the all-gather
    vocab_size: int

    @classmethod
    def of(cls, config: ModelConfig, rank: int, size: int) -> ShardLayout:
        """ValueError naming ``tensor_parallel_size`` where the model's heads or MLP do not divide."""
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
        if not 0 <= rank < size:
            raise ValueError(f"rank must be in [0, {size}), got {rank}")
        h, h_kv, inter = config.num_heads, config.num_kv_heads, config.intermediate_size
        if h % size:
            raise ValueError(
                f"tensor_parallel_size {size} does not divide the model's {h} attention heads: "
                f"use one of {_divisors(h)}"
            )
        if h_kv % size and size % h_kv:
            raise ValueError(
                f"tensor_parallel_size {size} neither divides nor is a multiple of the model's {h_kv} "
                "KV heads"
            )
        if inter % size:
            raise ValueError(
                f"tensor_parallel_size {size} does not divide the model's intermediate size {inter}"
            )
        per_q = h // size
        if size <= h_kv:
            per_kv = h_kv // size
            kv = range(rank * per_kv, (rank + 1) * per_kv)
        else:  # each KV head on size / h_kv ranks: those whose q heads read it
            kv = range(rank // (size // h_kv), rank // (size // h_kv) + 1)
        per_i = inter // size
        chunk = -(-config.vocab_size // size)
        return cls(
            rank=rank,
            size=size,
            q_heads=range(rank * per_q, (rank + 1) * per_q),
            kv_heads=kv,
            intermediate=range(rank * per_i, (rank + 1) * per_i),
            vocab=range(min(rank * chunk, config.vocab_size), min((rank + 1) * chunk, config.vocab_size)),
            vocab_chunk=chunk,
            vocab_size=config.vocab_size,
        )

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The config this rank's layers run as: its heads and intermediate size (the vocabulary stays
        whole: the embedding is)."""
        return dataclasses.replace(
            config,
            num_heads=len(self.q_heads),
            num_kv_heads=len(self.kv_heads),
            intermediate_size=len(self.intermediate),
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def shard_state_dict(
    sd: dict[str, torch.Tensor], config: ModelConfig, layout: ShardLayout
) -> dict[str, torch.Tensor]:
    """``sd`` (HF names, whole model) cut to ``layout``'s rank, in place: q/k/v rows of its heads,
    o_proj columns of its q heads, gate/up rows and down columns of its intermediate range, and its
    vocabulary rows as ``lm_head.weight`` (the embedding stays whole)."""
    d = config.head_dim

    def rows(t: torch.Tensor, r: range, per: int = 1) -> torch.Tensor:
        return t[r.start * per : r.stop * per].contiguous()

    def cols(t: torch.Tensor, r: range, per: int = 1) -> torch.Tensor:
        return t[:, r.start * per : r.stop * per].contiguous()

    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        for n in ("weight", "bias"):
            if p + f"self_attn.q_proj.{n}" in sd:
                sd[p + f"self_attn.q_proj.{n}"] = rows(sd[p + f"self_attn.q_proj.{n}"], layout.q_heads, d)
            for kv in "kv":
                name = p + f"self_attn.{kv}_proj.{n}"
                if name in sd:
                    sd[name] = rows(sd[name], layout.kv_heads, d)
        sd[p + "self_attn.o_proj.weight"] = cols(sd[p + "self_attn.o_proj.weight"], layout.q_heads, d)
        for n in ("gate_proj", "up_proj"):
            sd[p + f"mlp.{n}.weight"] = rows(sd[p + f"mlp.{n}.weight"], layout.intermediate)
        sd[p + "mlp.down_proj.weight"] = cols(sd[p + "mlp.down_proj.weight"], layout.intermediate)
    head = sd["model.embed_tokens.weight"] if config.tie_word_embeddings else sd["lm_head.weight"]
    sd["lm_head.weight"] = rows(head, layout.vocab)
    return sd


class GroupBackend(enum.Enum):
    GLOO = "gloo"
    NCCL = "nccl"


@dataclass(frozen=True)
class RankPlacement:
    """Where each rank of a group runs, and which backend joins them."""

    devices: tuple[torch.device, ...]
    backend: GroupBackend

    @property
    def staged(self) -> bool:
        """Whether collectives go through host memory: gloo between ranks on GPUs (its collectives take
        host tensors)."""
        return self.backend is GroupBackend.GLOO and self.devices[0].type == "cuda"

    def share(self, rank: int) -> int:
        """How many ranks run on ``rank``'s device (they split its memory)."""
        return self.devices.count(self.devices[rank])


def place_ranks(device: torch.device, size: int, gpu_count: int, nccl_available: bool) -> RankPlacement:
    """A group of ``size`` ranks whose rank 0 runs on ``device``. CPU: every rank there, on gloo. CUDA:
    rank ``r`` on the GPU ``r`` after rank 0's, wrapping round a host of fewer GPUs than ranks; on NCCL
    where every rank has a GPU of its own (NCCL refuses two ranks on one GPU), else on gloo."""
    if device.type != "cuda":
        return RankPlacement(tuple(device for _ in range(size)), GroupBackend.GLOO)
    if gpu_count < 1:
        raise ValueError(f"tensor parallelism on {device}: this host has no CUDA device")
    first = device.index or 0
    devices = tuple(torch.device("cuda", (first + r) % gpu_count) for r in range(size))
    own = gpu_count >= size and nccl_available
    return RankPlacement(devices, GroupBackend.NCCL if own else GroupBackend.GLOO)


def placement_for(device: str | torch.device, size: int) -> RankPlacement:
    """``place_ranks`` on this host's GPUs (``cuda`` is the current one)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    gpus = torch.cuda.device_count() if dev.type == "cuda" else 0
    return place_ranks(dev, size, gpus, dev.type == "cuda" and dist.is_nccl_available())


class RankLost(RuntimeError):
    """A process of a worker's tensor-parallel group is gone: no forward can run any more."""


class TensorParallel:
    """One rank's membership of its group: the process group for the collectives inside a forward, and,
    on rank 0, the pipes that carry each forward's call to the followers. ``placement``: every rank's
    device and the backend (default: CPU, gloo)."""

    def __init__(
        self,
        layout: ShardLayout,
        group: Any,  # a ProcessGroupGloo or ProcessGroupNCCL
        followers: list[Connection] | None = None,
        processes: list[subprocess.Popen] | None = None,
        placement: RankPlacement | None = None,
        host: HostCollectives | None = None,
    ) -> None:
        self.layout = layout
        self.group = group
        self.placement = placement or place_ranks(torch.device("cpu"), layout.size, 0, False)
        self.host = host  # CPU ranks: collectives through shared memory (``engine.tp_host``)
        self.followers = followers or []
        self.processes = processes or []
        self.store: dist.Store | None = None
        self.closed = False

    @property
    def rank(self) -> int:
        return self.layout.rank

    @property
    def size(self) -> int:
        return self.layout.size

    @property
    def leads(self) -> bool:
        return self.layout.rank == 0

    @property
    def backend(self) -> GroupBackend:
        return self.placement.backend

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place (contiguous); returns it."""
        if self.host is not None and self.host.fits(t):
            return self.host.all_reduce(t)
        if self.placement.staged:
            host = t.cpu()
            self.group.allreduce([host]).wait()
            return t.copy_(host)
        self.group.allreduce([t]).wait()
        return t

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's logits ``[T, its vocab rows]`` -> the whole ``[T, V]`` on each rank."""
        t, chunk = local.shape[0], self.layout.vocab_chunk
        src = local.cpu() if self.placement.staged else local
        padded = src.new_zeros(t, chunk)
        padded[:, : local.shape[1]] = src
        if self.host is not None and self.host.fits(padded):
            parts = self.host.all_gather(padded)
        else:
            parts = [torch.empty_like(padded) for _ in range(self.size)]
            self.group.allgather([parts], [padded]).wait()
        return torch.cat(parts, dim=1)[:, : self.layout.vocab_size].to(local.device)

    def agree_min(self, n: int) -> int:
        """The least of every rank's ``n`` (each rank calls it at the same point): e.g. the KV blocks
        every rank's cache holds, which rank 0's block tables index on all of them."""
        device = self.placement.devices[self.rank] if self.backend is GroupBackend.NCCL else "cpu"
        t = torch.tensor([n], dtype=torch.int64, device=device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(dist.ReduceOp.MIN)
        self.group.allreduce([t], opts).wait()
        return int(t.item())

    def send(self, call: tuple[str, tuple, dict]) -> None:
        """Rank 0: hand a forward's call to every follower before running it."""
        for c in self.followers:
            c.send(call)

    def follower_caches(self, shape: tuple[int, ...], dtype: torch.dtype) -> list[SharedTensor]:
        """Rank 0: every follower's KV cache (``shape``: a rank's), mapped here from the memfd each hands
        over once its runner is up (``hand_over_cache``): rank 0 reads and writes every rank's heads for
        the KV transfer, and nothing of the KV goes through the group. RuntimeError when a follower ends
        first."""
        caches: list[SharedTensor] = []
        for rank, conn in enumerate(self.followers, start=1):
            with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s:
                _, fds, _, _ = socket.recv_fds(s, 1, 1)
            if not fds:
                raise RuntimeError(f"tensor-parallel rank {rank} ended before handing over its KV cache")
            caches.append(SharedTensor(*shape, dtype=dtype, fd=fds[0]))
        return caches

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """Rank 0: call ``on_lost(why)`` once, from a thread of its own, when a follower dies while the group
        is open. A follower never writes to its pipe, so the pipe turning readable is its end (EOF): no
        polling, and the worker hears of it at once rather than at its next collective's timeout."""

        def run() -> None:
            try:
                ended = wait(self.followers)
            except OSError:  # (the pipes were closed under the wait: close() ran)
                return
            if self.closed or not ended:
                return
            rank = self.followers.index(ended[0]) + 1  # type: ignore[arg-type]
            pid = self.processes[rank - 1].pid if rank <= len(self.processes) else "?"
            on_lost(f"tensor-parallel rank {rank} (pid {pid}) of {self.size} is gone")

        if self.followers:
            threading.Thread(target=run, name="tp-watch", daemon=True).start()

    def close(self) -> None:
        """Rank 0: close the pipes (each follower exits) and wait for the processes."""
        if self.closed:
            return
        self.closed = True
        for c in self.followers:
            # Shut down, not just closed: the watch thread's poll holds the socket open past a close, and
            # the follower would not see its end of file.
            with (
                contextlib.suppress(OSError),
                socket.fromfd(c.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s,
            ):
                s.shutdown(socket.SHUT_RDWR)
            c.close()
        for p in self.processes:
            try:
                p.wait(timeout=COLLECTIVE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.host is not None:
            self.host.close()


class ReducingStepOps:
    """A rank's ``StepOps``: its own products, with the row-parallel ones (o_proj, down) all-reduced over
    the group before anything adds them to the residual stream."""

    def __init__(self, inner: Any, tp: TensorParallel) -> None:
        self.inner, self.tp = inner, tp

    def linear(self, lin: Any, x: torch.Tensor) -> torch.Tensor:
        return self.inner.linear(lin, x)

    def norm_linear(
        self, lin: Any, x: torch.Tensor, res: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        return self.inner.norm_linear(lin, x, res, weight, eps)

    def residual(self, lin: Any, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        return self._reduced(self.inner.residual(lin, a, x))

    def down(self, lin: Any, gate_up: torch.Tensor, applied: bool, x: torch.Tensor) -> torch.Tensor | None:
        return self._reduced(self.inner.down(lin, gate_up, applied, x))

    def add_rms_norm(
        self, x: torch.Tensor, res: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        return self.inner.add_rms_norm(x, res, weight, eps)

    def rope_store(
        self, kv_layer: torch.Tensor, qkv: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.inner.rope_store(kv_layer, qkv)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.inner.silu_mul(gate_up)

    def _reduced(self, partial: torch.Tensor | None) -> torch.Tensor:
        if partial is None:  # a product that added itself into x: its partial sum would be lost
            raise RuntimeError("tensor parallelism needs the row-parallel products' residuals unfused")
        return self.tp.all_reduce(partial.contiguous())


def hand_over_cache(pipe: Connection, fd: int) -> None:
    """A follower: pass rank 0 its KV cache's memfd over the pipe (SCM_RIGHTS): the one message a follower
    ever writes to it, before rank 0 starts watching the pipe for its end."""
    with socket.fromfd(pipe.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s:
        socket.send_fds(s, [b"k"], [fd])


def gloo_group(store: dist.Store, rank: int, size: int) -> Any:  # a ProcessGroupGloo (its stubs lack the ops)
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch keeps it private
    opts._timeout = COLLECTIVE_TIMEOUT
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]  # one host: loopback
    return dist.ProcessGroupGloo(dist.PrefixStore("tp", store), rank, size, opts)


def nccl_group(store: dist.Store, rank: int, size: int, device: torch.device) -> Any:
    """A ProcessGroupNCCL of one rank per GPU, whose collectives fail after ``COLLECTIVE_TIMEOUT``."""
    torch.cuda.set_device(device)
    nccl = dist.ProcessGroupNCCL  # type: ignore[attr-defined]  # absent from CPU builds' stubs
    opts = nccl.Options()
    opts._timeout = COLLECTIVE_TIMEOUT
    return nccl(dist.PrefixStore("tp", store), rank, size, opts)


def host_collectives(rank: int, size: int, channels: str) -> HostCollectives:
    """A follower's ``HostCollectives`` from the channels its command line names (``HostChannels``)."""
    ends = HostChannels.decode(channels)
    buffer = SharedTensor(*buffer_shape(size), dtype=torch.uint8, fd=ends.buffer_fd)
    return HostCollectives(rank, size, buffer, ends, COLLECTIVE_TIMEOUT_S)


def make_group(store: dist.Store, rank: int, placement: RankPlacement) -> Any:
    size = len(placement.devices)
    if placement.backend is GroupBackend.NCCL:
        return nccl_group(store, rank, size, placement.devices[rank])
    return gloo_group(store, rank, size)


def start_group(
    config: ModelConfig, size: int, runner_kwargs: Mapping[str, Any], threads: int
) -> TensorParallel:
    """Rank 0's side: start ranks 1..size-1 as processes that load their shards of the model with
    ``runner_kwargs`` (JSON-able ``ModelRunner`` arguments; each its rank's ``device``, ``placement_for``)
    and ``threads`` torch threads each, and join them in a group. ValueError when the model does not
    divide."""
    layout = ShardLayout.of(config, 0, size)
    placement = placement_for(runner_kwargs.get("device", "cpu"), size)
    store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
    conns: list[Connection] = []
    procs: list[subprocess.Popen] = []
    shared = placement.devices[0].type == "cpu" and EngineEnv.from_environ().tp_collectives != "gloo"
    buffer, ends = make_channels(size) if shared else (None, [])
    try:
        for rank in range(1, size):
            spec = json.dumps({**runner_kwargs, "device": str(placement.devices[rank])})
            host = ["--host-channels", ends[rank].encode()] if ends else []
            ours, theirs = socket.socketpair()
            argv = [
                sys.executable, "-m", "pdserve.engine.tp_follower",
                "--rank", str(rank), "--size", str(size), "--store-port", str(store.port),
                "--pipe-fd", str(theirs.fileno()), "--threads", str(threads), "--runner", spec,
                "--backend", placement.backend.value,
                "--devices", ",".join(str(d) for d in placement.devices), *host,
            ]  # fmt: skip
            fds = [theirs.fileno(), *(ends[rank].fds() if ends else [])]
            procs.append(subprocess.Popen(argv, pass_fds=fds))
            theirs.close()
            conns.append(Connection(ours.detach()))
        group = make_group(store, 0, placement)
    except BaseException:
        for p in procs:
            p.kill()
            p.wait()
        raise
    finally:
        if ends:
            close_others(ends, 0)  # the followers hold theirs now: a dead one's pipes read end of file
    collectives = None
    if buffer is not None:
        collectives = HostCollectives(0, size, buffer, ends[0], COLLECTIVE_TIMEOUT_S)
    tp = TensorParallel(layout, group, conns, procs, placement, collectives)
    tp.store = store  # the group's rendezvous lives as long as it does
    return tp
