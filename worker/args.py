"""What ``pdserve worker`` hands a pool: one frozen, self-checking ``WorkerArgs``.

The CLI builds it from the command line (and the environment, read there once); a pool's ``serve`` takes
it and derives the rest (shell, transfer and registration settings) from it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.engine.device import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    check_device,
    check_dtype,
    check_gpu_memory_utilization,
    device_index,
)
from pdserve.engine.quant import check_quantization
from pdserve.engine.speculative import SpeculativeConfig
from pdserve.kv_transfer.config import FaultConfig, TransferConfig
from pdserve.kv_transfer.netif import interfaces_for_host
from pdserve.proto import worker_pb2
from pdserve.worker.agent import AgentConfig
from pdserve.worker.convert import ROLE_TO_PROTO
from pdserve.worker.role import Role
from pdserve.worker.router_set import RouterSetConfig, split_routers
from pdserve.worker.shell import ShellConfig
from pdserve.worker.tls import NO_TLS, TLSConfig

# --kv-puts: when KV moves by one-sided writes (UCX puts, or cross-memory writes on one host) rather than
# tagged messages.
KV_PUTS = ("auto", "always", "never")
INSTANCE = uuid.uuid4().hex  # this process's, registered as WorkerInfo.instance


@dataclass(frozen=True)
class WorkerArgs:
    """What ``pdserve worker`` passes to ``prefill_pool.app.serve`` / ``decode_pool.app.serve``.

    The CLI has already set torch's thread count to ``threads`` before calling ``serve``.
    """

    role: Role
    router: str  # the routers: host:port[,host:port...] (``worker.router_set``)
    worker_id: str
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port (the address registered with the router is the bound one)
    model: str = "smollm2-135m-instruct"  # a registry name or a model directory
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: resolved by the engine, engine.device)
    quantization: str = "none"  # none | int8: weight-only int8 (engine.quant)
    device: str = "cpu"  # cpu | cuda | cuda:N
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION  # the GPU's share this worker may use
    threads: int = 1
    block_size: int = 16  # tokens per KV block
    kv_blocks: int = 0  # KV cache size in blocks; 0: from kv_cache_bytes, or the engine's default
    kv_cache_bytes: int = 0
    max_running: int = 64  # decode batch bound (EngineConfig.max_num_seqs)
    # Requests a decode worker holds beyond max_running (waiting in its engine) before it refuses more:
    # several routers admit into one worker, each counting only its own requests.
    max_queued: int = 64
    max_batched_tokens: int = 2048  # token budget per step (EngineConfig.max_num_batched_tokens)
    mixed_steps: bool = False  # decode and prefill in one step (EngineConfig.mixed_steps)
    enable_prefix_caching: bool = (
        True  # reuse cached prompt prefixes' KV (EngineConfig.enable_prefix_caching)
    )
    cache_dir: Path | None = None  # where model names resolve (None: the engine's default)
    drain_timeout_s: float = 300.0
    # A model that fails to load: keep /metrics up this long before exiting, so the failure is scraped.
    load_failure_linger_s: float = 0.0
    # Prometheus /metrics on host:metrics_port (0: a free port; the URL is registered as metrics_url).
    metrics_port: int = 0
    # The cluster token the router requires of registering workers (``worker.auth``); "": none.
    cluster_token: str = field(default="", repr=False)
    # UCX network devices for the KV transfer (``TransferConfig.interface``): "" derives them from ``host``.
    kv_interface: str = ""
    # write a decode worker of this host by process_vm_writev (host memory: kv_transfer/writers/cma.py)
    # or CUDA IPC (device memory: kv_transfer/writers/cuda_ipc.py) rather than through UCX
    kv_cross_memory: bool = True
    # Decode worker on CPU: the KV cache in shared memory (a memfd), which prefill workers of this host map
    # and write with plain copies (kv_transfer/writers/shm.py) instead of cross-memory attach.
    kv_shared_memory: bool = False
    # One-sided UCX puts for KV (KV_PUTS): auto where they are one-sided (RDMA, CUDA IPC) and over tcp with
    # 64 KB segments (pdserve's default UCX_TCP_TX_SEG_SIZE), tagged messages on tcp with smaller ones
    # (TransferConfig.rma_over_tcp); always: puts over tcp whatever the segments; never: tagged always.
    kv_puts: str = "auto"
    # The writer's digest of every KV layer it wrote, checked by the receiver (TransferConfig.digest).
    kv_digest: bool = True
    # TLS on the worker's gRPC port and on its calls to the router (``worker.tls``); NO_TLS: plain.
    tls: TLSConfig = NO_TLS
    # Decode side: a KV transfer that has started (its Open arrived) and shows no progress this long fails,
    # freeing its blocks (progress: a layer landed, or one-sided writes the sender reports: wire.Progress).
    # A reservation whose prompt still queues for prefill lives as long as its request.
    kv_stall_timeout_s: float = 30.0
    # Failure injection for tests: every KV layer is sent this much later (the transfer outlives token 0).
    kv_fault_delay_s: float = 0.0
    # Failure injection for tests: the first this many transfers this worker sends get a byte flipped.
    kv_fault_corrupt_transfers: int = 0
    # Failure injection for tests: the engine waits this long after every step (streams outlast what a
    # test does to them mid-stream on however fast a host).
    fault_step_delay_s: float = 0.0
    # Speculative decoding on a decode or colocated worker (``engine.speculative``): "" off, "ngram" or
    # "draft" (the model's first draft_layers layers; 0: a quarter of them), proposing up to
    # num_speculative_tokens tokens per stream per step.
    speculative: str = ""
    num_speculative_tokens: int = 4
    draft_layers: int = 0
    # A warm-pool worker: loads, registers and heartbeats, but the router routes to it only once promoted.
    standby: bool = False
    # The model split over this many processes (``engine.tensor_parallel``); CPU workers only.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.role, Role):
            raise ValueError(f"role must be a Role, got {self.role!r}")
        if not self.router or not self.worker_id:
            raise ValueError("router and worker_id must not be empty")
        split_routers(self.router)
        check_dtype(self.dtype)
        check_quantization(self.quantization)
        check_device(self.device)
        check_gpu_memory_utilization(self.gpu_memory_utilization)
        for name in ("threads", "block_size", "max_running", "max_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {self.max_queued}")
        if self.kv_blocks < 0 or self.kv_cache_bytes < 0:
            raise ValueError("kv_blocks and kv_cache_bytes must be >= 0")
        if self.kv_shared_memory and device_index(self.device) is not None:
            raise ValueError("kv_shared_memory keeps the KV cache in host memory: it needs device cpu")
        if self.kv_puts not in KV_PUTS:
            raise ValueError(f"kv_puts must be one of {', '.join(KV_PUTS)}, got {self.kv_puts!r}")
        if self.fault_step_delay_s < 0:
            raise ValueError(f"fault_step_delay_s must be >= 0, got {self.fault_step_delay_s}")
        if self.kv_stall_timeout_s <= 0 or self.kv_fault_delay_s < 0 or self.kv_fault_corrupt_transfers < 0:
            raise ValueError(
                "kv_stall_timeout_s must be > 0, kv_fault_delay_s and kv_fault_corrupt_transfers >= 0"
            )
        if self.load_failure_linger_s < 0:
            raise ValueError(f"load_failure_linger_s must be >= 0, got {self.load_failure_linger_s}")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if not self.kv_interface:
            interfaces_for_host(self.host)  # no interface carries --host: say so now, not at a transfer
        self.transfer_config()  # checks kv_interface
        self.speculative_config()  # checks speculative and num_speculative_tokens
        self._check_tensor_parallel()
        self.tls.check_server()

    def _check_tensor_parallel(self) -> None:
        tp = self.tensor_parallel_size
        if tp < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {tp}")
        if tp == 1:
            return
        if device_index(self.device) is not None:
            raise ValueError(
                f"--tensor-parallel-size {tp} runs on CPUs only in a worker, not on --device {self.device}: "
                "the KV transfer between CUDA groups is not built (the engine, LLM, runs a group on CUDA)"
            )
        if self.kv_shared_memory:
            raise ValueError(f"--tensor-parallel-size {tp} and --kv-shared-memory do not go together")

    def speculative_config(self) -> SpeculativeConfig | None:
        """The engine's speculative decoding settings (None: off); ValueError naming a bad flag."""
        if not self.speculative:
            return None
        try:
            return SpeculativeConfig(
                method=self.speculative,
                num_speculative_tokens=self.num_speculative_tokens,
                draft_layers=self.draft_layers,
            )
        except ValueError as e:
            raise ValueError(f"--speculative / --num-speculative-tokens / --draft-layers: {e}") from None

    def kv_cache_bytes_or(self, default: int) -> int | None:
        """The KV cache size a pool asks its engine for: ``kv_cache_bytes`` when given; None when
        ``kv_blocks`` is (blocks win), or on a GPU (the engine sizes the cache from
        ``gpu_memory_utilization``); else the pool's ``default``."""
        if self.kv_cache_bytes:
            return self.kv_cache_bytes
        if self.kv_blocks or device_index(self.device) is not None:
            return None
        return default

    def shell_config(self) -> ShellConfig:
        return ShellConfig(
            host=self.host,
            port=self.port,
            drain_timeout_s=self.drain_timeout_s,
            cluster_token=self.cluster_token,
            tls=self.tls,
        )

    def agent_config(self) -> AgentConfig:
        """One router's agent (``router_address`` is the whole --router value until ``RouterSet``
        gives each router its own)."""
        return AgentConfig(router_address=self.router, cluster_token=self.cluster_token, tls=self.tls)

    def router_set_config(self) -> RouterSetConfig:
        return RouterSetConfig(routers=self.router, agent=self.agent_config())

    def transfer_config(self) -> TransferConfig:
        """KV transfer settings: UCX on the network devices of this worker's host (or ``kv_interface``);
        a decode worker on this host is written by cross-memory attach unless ``kv_cross_memory`` is off;
        ``kv_puts`` picks between one-sided puts and tagged messages elsewhere."""
        return TransferConfig(
            host=self.host,
            interface=self.kv_interface,
            same_host=self.kv_cross_memory,
            rma=self.kv_puts != "never",
            rma_over_tcp={"auto": None, "always": True, "never": False}[self.kv_puts],
            digest=self.kv_digest,
            cluster_token=self.cluster_token,
            faults=FaultConfig(
                delay_s=self.kv_fault_delay_s, corrupt_transfers=self.kv_fault_corrupt_transfers
            ),
        )

    def worker_info(
        self,
        address: str,
        *,
        kv_blocks_total: int,
        context_length: int,
        pid: int,
        dtype: str,
        device: str,
        metrics_url: str = "",
        kv_layout: str = "",
        tokenizer_digest: str = "",
    ) -> worker_pb2.WorkerInfo:
        """The registration message for this worker once its server is bound and its model loaded:
        ``dtype`` and ``device`` are what the engine runs on (``--dtype auto`` resolved); ``kv_layout``
        its KV cache's compatibility record (``KVCompat.describe``) and ``tokenizer_digest`` its model's
        vocabulary (``Tokenizer.vocab_digest``), both of which the router checks."""
        return worker_pb2.WorkerInfo(
            worker_id=self.worker_id,
            role=ROLE_TO_PROTO[self.role],
            address=address,
            model=self.model,
            dtype=dtype,
            device=device,
            kv_blocks_total=kv_blocks_total,
            block_size=self.block_size,
            pid=pid,
            metrics_url=metrics_url,
            max_running=self.max_running,
            context_length=context_length,
            standby=self.standby,
            quantization=self.quantization,
            kv_layout=kv_layout,
            tokenizer_digest=tokenizer_digest,
            instance=INSTANCE,
            tensor_parallel_size=self.tensor_parallel_size,
        )
