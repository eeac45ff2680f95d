"""The worker's command-line flags, each defined once beside ``WorkerArgs`` (whose fields give the defaults):
``pdserve worker`` adds them, ``pdserve up`` takes ``UP_FLAGS`` for every worker and hands them on."""

from __future__ import annotations

import argparse

from pdserve.engine.device import DEVICE_HELP, DTYPE_CHOICES
from pdserve.engine.quant import QUANTIZATIONS
from pdserve.engine.speculative import SpeculativeMethod
from pdserve.worker.args import KV_PUTS, WorkerArgs
from pdserve.worker.flagspec import Flag, Switch, device, fraction, int_in, nonneg, positive, seconds
from pdserve.worker.role import Role


def _mib_to_bytes(mib: int) -> int:
    return mib << 20


# -- which worker, where ------------------------------------------------------------------------------------
ROLE = Flag(
    "--role",
    "the worker's pool",
    choices=tuple(r.value for r in Role),
    required=True,
    field="role",
    to_field=Role,
)
ROUTER = Flag(
    "--router",
    "the routers, host:port[,host:port...]: the worker registers with every one; a name that resolves to "
    "several addresses (a Kubernetes headless Service) is one router per address, looked up again every 10 s",
    required=True,
    field="router",
)
HOST = Flag("--host", "the address to bind and register (a pod IP)", default=WorkerArgs.host, field="host")
PORT = Flag("--port", "0: pick a free port", default=WorkerArgs.port, type=int_in(0, 65535), field="port")
IDENTITY = (ROLE, ROUTER, HOST, PORT)

# -- what it runs, on what ----------------------------------------------------------------------------------
DTYPE = Flag(
    "--dtype",
    "auto (default): bfloat16 on CUDA and on CPUs with native bf16 dot products (AVX512-BF16, AMX), float32 "
    "elsewhere",
    default=WorkerArgs.dtype,
    choices=DTYPE_CHOICES,
    field="dtype",
)
QUANTIZATION = Flag(
    "--quantization",
    "int8: weight-only int8 with a scale per row and 64 inputs (about a quarter of float32's weight bytes; "
    "activations and the KV cache keep --dtype); none (default): weights in --dtype",
    default=WorkerArgs.quantization,
    choices=QUANTIZATIONS,
    field="quantization",
)
DEVICE = Flag(
    "--device",
    f"where the worker runs: {DEVICE_HELP} (default: cpu)",
    default=WorkerArgs.device,
    type=device,
    field="device",
)
GPU_MEMORY_UTILIZATION = Flag(
    "--gpu-memory-utilization",
    "the share of the GPU's memory this worker may use, its weights and KV cache included, as vLLM means it; "
    "the KV cache gets what is left unless --kv-blocks or --kv-cache-mib is given; ignored on CPU "
    "(default: %(default)s)",
    default=WorkerArgs.gpu_memory_utilization,
    type=fraction,
    metavar="FRACTION",
    field="gpu_memory_utilization",
)
# (its default, all the cores this process may run on, is resolved at start)
THREADS = Flag("--threads", "torch threads (default: all cores)", type=positive)
TENSOR_PARALLEL_SIZE = Flag(
    "--tensor-parallel-size",
    "split the model over this many processes on this host (attention heads, MLP columns, the vocabulary "
    "and the KV cache's heads; gloo on loopback), each with --threads torch threads; a colocated (--role "
    "both) CPU worker only; its streams re-prefill rather than move live (default %(default)s)",
    default=WorkerArgs.tensor_parallel_size,
    type=positive,
    field="tensor_parallel_size",
)
ENGINE = (DTYPE, QUANTIZATION, DEVICE, GPU_MEMORY_UTILIZATION, THREADS, TENSOR_PARALLEL_SIZE)

# -- the process: its id, its pool standing, its stop -------------------------------------------------------
WORKER_ID = Flag("--worker-id", "default: ROLE-HOST-PID")  # (resolved at start)
STANDBY = Flag(
    "--standby",
    "join the warm pool: load and register, but take requests only once promoted (the autoscaler)",
    default=WorkerArgs.standby,
    switch=Switch.ON,
    field="standby",
)
DRAIN_TIMEOUT = Flag(
    "--drain-timeout",
    "seconds a drain waits for requests in flight",
    default=WorkerArgs.drain_timeout_s,
    type=float,
    field="drain_timeout_s",
)
LOAD_FAILURE_LINGER = Flag(
    "--load-failure-linger",
    "when the model fails to load, keep /metrics up this many seconds before exiting, so Prometheus sees "
    "pdserve_model_load_failed (default: exit at once)",
    default=WorkerArgs.load_failure_linger_s,
    type=float,
    field="load_failure_linger_s",
)
METRICS_PORT = Flag(
    "--metrics-port",
    "the worker's /metrics port (0: any free)",
    default=WorkerArgs.metrics_port,
    type=nonneg,
    field="metrics_port",
)
PROCESS = (WORKER_ID, STANDBY, DRAIN_TIMEOUT, LOAD_FAILURE_LINGER, METRICS_PORT)

# -- tuning: the same for every worker of a cluster (``up`` takes them and hands them to each) --------------
KV_SHARED_MEMORY = Flag(
    "--kv-shared-memory",
    "decode workers on CPU keep the KV cache in shared memory, which prefill workers of this host write with "
    "plain copies (faster where the kernel's cross-memory writes are slow); shared memory has huge pages "
    "only where the kernel allows them for it (transparent_hugepage/shmem_enabled), and decode attention "
    "is a little slower without them (default: off)",
    default=WorkerArgs.kv_shared_memory,
    switch=Switch.ON,
    field="kv_shared_memory",
)
TUNING = (
    Flag(
        "--block-size",
        "tokens per KV block",
        default=WorkerArgs.block_size,
        type=positive,
        field="block_size",
    ),
    Flag(
        "--kv-blocks",
        "KV cache blocks (0: from --kv-cache-mib or default)",
        default=WorkerArgs.kv_blocks,
        type=nonneg,
        field="kv_blocks",
    ),
    Flag(
        "--kv-cache-mib",
        "KV cache size in MiB (0: the engine default)",
        default=WorkerArgs.kv_cache_bytes >> 20,
        type=nonneg,
        field="kv_cache_bytes",
        to_field=_mib_to_bytes,
    ),
    Flag(
        "--max-running",
        "decode batch bound",
        default=WorkerArgs.max_running,
        type=positive,
        field="max_running",
    ),
    Flag(
        "--max-queued",
        "requests a decode worker holds beyond --max-running (waiting) before it refuses more, which "
        "the routers then route elsewhere",
        default=WorkerArgs.max_queued,
        type=nonneg,
        field="max_queued",
    ),
    Flag(
        "--max-batched-tokens",
        "token budget per step (a running stream's decode counts one; longer prompts are chunked)",
        default=WorkerArgs.max_batched_tokens,
        type=positive,
        field="max_batched_tokens",
    ),
    Flag(
        "--mixed-steps",
        "one step decodes the running streams and prefills waiting prompts in the rest of the budget "
        "(default: a step either prefills or decodes, prefill first; mixed steps are no faster on CPU)",
        default=WorkerArgs.mixed_steps,
        switch=Switch.ON,
        field="mixed_steps",
    ),
    Flag(
        "--enable-prefix-caching",
        "reuse the KV of prompt prefixes this worker computed before (full blocks, evicted least recently "
        "used when room is needed); --no-enable-prefix-caching computes every prompt whole (default: on)",
        default=WorkerArgs.enable_prefix_caching,
        switch=Switch.BOTH,
        field="enable_prefix_caching",
    ),
    Flag(
        "--speculative",
        "speculative decoding on a decode or colocated worker: ngram proposes each stream's next tokens "
        "from an earlier occurrence of its last few (prompt lookup), draft from the model's own first "
        "--draft-layers layers (self-speculative, CPU); one forward verifies them and the output is the "
        "same token for token (default: off)",
        default=WorkerArgs.speculative,
        choices=tuple(m.value for m in SpeculativeMethod),
        field="speculative",
    ),
    Flag(
        "--num-speculative-tokens",
        "the most tokens --speculative proposes per stream per step (fewer for a stream whose proposals "
        "miss) (default %(default)s)",
        default=WorkerArgs.num_speculative_tokens,
        type=int_in(1, 16),
        field="num_speculative_tokens",
    ),
    Flag(
        "--draft-layers",
        "--speculative draft: how many of the model's first layers (with its LM head) draft the proposals "
        "(default: a quarter of them)",
        default=WorkerArgs.draft_layers,
        type=nonneg,
        field="draft_layers",
    ),
    Flag(
        "--kv-stall-timeout",
        "seconds a started KV transfer may make no progress before the decode worker fails it: no layer "
        "landed, or with one-sided writes (puts, cross-memory, shared memory) none reported put by the "
        "prefill worker, which reports them at most every half second as its forward goes "
        "(default %(default)s)",
        default=WorkerArgs.kv_stall_timeout_s,
        type=seconds(True),
        field="kv_stall_timeout_s",
    ),
    Flag(
        "--kv-interface",
        "network devices the KV transfer (UCX) uses, in UCX_NET_DEVICES syntax, e.g. eth0 or mlx5_0:1,eth0; "
        "'all': every device (default: $UCX_NET_DEVICES, else the interface carrying --host)",
        default=WorkerArgs.kv_interface,
        field="kv_interface",
    ),
    Flag(
        "--no-kv-cross-memory",
        "never write a decode worker of this host by cross-memory attach (process_vm_writev; host memory) or "
        "CUDA IPC (device memory); all KV goes through UCX (default: those writes where the kernel and the "
        "GPUs permit them)",
        default=WorkerArgs.kv_cross_memory,
        switch=Switch.OFF,
        dest="kv_cross_memory",
        field="kv_cross_memory",
    ),
    KV_SHARED_MEMORY,
    Flag(
        "--kv-puts",
        "how KV reaches a decode worker: auto (one-sided writes: RDMA, CUDA IPC, cross-memory on one host; "
        "UCX puts over tcp while UCX_TCP_TX_SEG_SIZE is at least 64K, pdserve's default, else tagged "
        "messages, faster with UCX's own 8K segments), always (UCX puts over tcp whatever the "
        "segment size), never (tagged messages only, cross-memory writes off as well); both ends must allow "
        "puts for a transfer to use them (default %(default)s)",
        default=WorkerArgs.kv_puts,
        choices=KV_PUTS,
        field="kv_puts",
    ),
    Flag(
        "--no-kv-digest",
        "send no digest of the KV a transfer writes (default: the writer hashes every layer it wrote and "
        "the receiver checks what landed before the request runs, failing the transfer on a mismatch; host "
        "memory only)",
        default=WorkerArgs.kv_digest,
        switch=Switch.OFF,
        dest="kv_digest",
        field="kv_digest",
    ),
    # Failure injection for tests: hidden from --help.
    Flag(
        "--kv-fault-corrupt-transfers",
        argparse.SUPPRESS,
        default=WorkerArgs.kv_fault_corrupt_transfers,
        type=int,
        field="kv_fault_corrupt_transfers",
    ),
    Flag(
        "--kv-fault-delay",
        argparse.SUPPRESS,
        default=WorkerArgs.kv_fault_delay_s,
        type=float,
        field="kv_fault_delay_s",
    ),
    Flag(
        "--fault-step-delay",
        argparse.SUPPRESS,
        default=WorkerArgs.fault_step_delay_s,
        type=float,
        field="fault_step_delay_s",
    ),
    Flag(
        "--worker-module",
        "module whose `async serve(args: WorkerArgs)` runs the worker (default: the role's pool)",
    ),
)

# What ``pdserve worker`` takes (in its --help order; the model, cluster token and TLS flags, shared with
# the router, and --cpus are the CLI's own) and what ``up`` hands every worker it starts. (``up``'s
# --dtype, which the launcher hands on itself, and its cluster-wide --device, --gpu-memory-utilization
# and --threads are ``up``'s own.)
WORKER_FLAGS = (*IDENTITY, *ENGINE, *PROCESS, *TUNING)
UP_FLAGS = (QUANTIZATION, *TUNING)
