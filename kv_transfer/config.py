"""Transfer configuration, built once at startup. Pure: no torch, no ucxx. Also the one place the package
touches the environment: :func:`apply_ucx_env` sets UCX's network devices and defaults before ucxx starts.
"""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from enum import StrEnum

from pdserve.kv_transfer.netif import interfaces_for_host


class Backend(StrEnum):
    UCX = "ucx"  # ucxx over TCP, shared memory, RDMA or CUDA transports
    INPROC = "inproc"  # same-process fake for unit tests


@dataclass(frozen=True)
class FaultConfig:
    """Failure injection on the sending side, for tests (as SGLang's fake backend does).

    ``drop_layers``: layers that are never sent (the receiver sees a missing layer).
    ``delay_s``: extra delay before sending ``delay_layers`` (every layer when None).
    ``open_delay_s``: the ``Open`` goes out this much later than usual, while eager RMA puts go
    out at once (a slow control path: the receiver may end the reservation before Open comes).
    ``ignore_revokes``: never answer the receiver's revoke of an un-opened reservation (a sender
    frozen in its event loop), so the receiver's forced path runs.
    ``corrupt_transfers``: the first this many transfers get one byte flipped in flight (in the first
    run of their last layer), after the sender took its digest: the receiver's check must catch it.
    """

    drop_layers: frozenset[int] = frozenset()
    delay_s: float = 0.0
    delay_layers: frozenset[int] | None = None
    open_delay_s: float = 0.0
    ignore_revokes: bool = False
    corrupt_transfers: int = 0

    def __post_init__(self) -> None:
        if self.delay_s < 0 or self.open_delay_s < 0:
            raise ValueError(f"delays must be >= 0, got {self.delay_s}, {self.open_delay_s}")
        if self.corrupt_transfers < 0:
            raise ValueError(f"corrupt_transfers must be >= 0, got {self.corrupt_transfers}")
        if any(layer < 0 for layer in self.drop_layers):
            raise ValueError("drop_layers must be non-negative layer indices")

    @property
    def active(self) -> bool:
        return (
            bool(self.drop_layers)
            or self.delay_s > 0
            or self.open_delay_s > 0
            or self.ignore_revokes
            or self.corrupt_transfers > 0
        )

    def delay_for(self, layer: int) -> float:
        if self.delay_s == 0.0:
            return 0.0
        if self.delay_layers is None or layer in self.delay_layers:
            return self.delay_s
        return 0.0


@dataclass(frozen=True)
class TransferConfig:
    """How a worker moves KV.

    ``host``: where this worker lives (its ``--host``). UCX gets no listener:
    peers connect to the UCX worker address a ticket carries, and UCX's TCP
    transport listens only on the network devices in ``UCX_NET_DEVICES``,
    which :func:`apply_ucx_env` derives from ``host`` (loopback: ``lo``).
    ``interface``: ``UCX_NET_DEVICES`` for cross-machine transfers, UCX's own
    syntax (``eth0``, ``mlx5_0:1,eth0``); "all": every device (UCX's default);
    "": the environment's ``UCX_NET_DEVICES`` if set, else derived from ``host``.
    ``deadline_s``: default lifetime of a reservation; the receiver frees the
    blocks when it passes.
    ``settle_timeout_s``: how long a failing side waits for in-flight messages
    to finish before it force-closes the connection (bounds every cleanup).
    ``same_host``: a sender writes the host memory of a receiver on its own
    host (same boot and pid namespace, told by the handshake) by cross-memory attach (``process_vm_writev``,
    writers/cma.py) when the receiver is on its host and the kernel permits
    it, else through UCX. (UCX's own shared-memory transports are not used:
    UCX offers them only on endpoints without peer-failure handling, where
    a peer's death aborts the process.)
    ``rma``: move KV with one-sided UCX puts into the receiver's registered KV
    tensor when both peers offer it; otherwise, or with False on
    either side, each layer goes as tagged messages. Which one a transfer uses
    is named in its ``Open``: one transfer never mixes them.
    ``rma_over_tcp``: puts also where every lane of the endpoint is tcp (no RDMA device, no CUDA IPC,
    no cross-memory attach), where UCX emulates them. None (auto): when UCX's tcp segments are at
    least 64 KB (``UCX_TCP_TX_SEG_SIZE``, which :func:`apply_ucx_env` sets to 64K unless the
    environment sets it): with such segments puts beat the tagged push, while with UCX's own 8 KB a put
    goes out as many small fragments, sent by both the calling thread and the progress thread, and loses.
    True: puts over tcp whatever the segment size; False: the tagged push there.
    ``digest``: the writer sends a digest of every layer it wrote (``kvbuf.layer_digests``), and the receiver
    checks what landed against it before the request runs; a mismatch fails the transfer (reason
    ``checksum``). Host memory only (a KV cache on a GPU sends none). Both sides' setting counts: the
    writer computes only when asked to, the receiver checks whatever digests come.
    """

    backend: Backend = Backend.UCX
    host: str = "127.0.0.1"
    interface: str = ""
    deadline_s: float = 30.0
    connect_timeout_s: float = 5.0
    settle_timeout_s: float = 2.0
    same_host: bool = True
    rma: bool = True
    rma_over_tcp: bool | None = None
    digest: bool = True
    faults: FaultConfig = field(default_factory=FaultConfig)
    # The cluster token both ends prove in the handshake (auth.py); "": neither proves nor checks.
    cluster_token: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.backend, Backend):
            object.__setattr__(self, "backend", Backend(self.backend))
        if self.interface and not _DEVICES.fullmatch(self.interface):
            raise ValueError(
                f"interface must be UCX device names (e.g. eth0,mlx5_0:1), got {self.interface!r}"
            )
        for name in ("deadline_s", "connect_timeout_s", "settle_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.host:
            raise ValueError("host must not be empty")


_DEVICES = re.compile(r"[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*")

# UCX_WARN_UNUSED_ENV_VARS: UCX 1.21 does not know UCX_MEMTYPE_CACHE, which ucxx sets on import, and
# would warn about it on every context creation.
# UCX_TCP_TX_SEG_SIZE: UCX's tcp transport sends in segments of 8 KB by default, a system call and a
# progress pass each; 64 KB (the size of its receive segments) moves KV markedly faster, by puts and by
# tagged sends alike (benchmarks/results/kv_transfer_tcp_segment.json).
_UCX_ENV_DEFAULTS = {"UCX_WARN_UNUSED_ENV_VARS": "n", "UCX_TCP_TX_SEG_SIZE": "64K"}


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
_MEMUNITS = re.compile(r"\s*(\d+)\s*([bkmg]?)b?\s*", re.IGNORECASE)
# The smallest tcp segment at which UCX's emulated puts beat the tagged push (see rma_over_tcp).
PUTS_OVER_TCP_MIN_SEGMENT = 64 << 10


def tcp_segment_bytes(
    environ: MutableMapping[str, str] | None = None, key: str = "UCX_TCP_TX_SEG_SIZE"
) -> int:
    """UCX's tcp send segment in bytes as ``environ`` sets it (``key``: ``UCX_TCP_TX_SEG_SIZE``, or
    ``UCX_TCP_RX_SEG_SIZE``; UCX's memory units: ``65536``, ``64K``, ``64kb``); UCX's own default (8 KB
    to send, 64 KB to receive) when unset or unreadable."""
    env = os.environ if environ is None else environ
    m = _MEMUNITS.fullmatch(env.get(key, ""))
    if m:
        return int(m[1]) * _UNITS[m[2].lower()]
    return 64 << 10 if key == "UCX_TCP_RX_SEG_SIZE" else 8 << 10


def puts_over_tcp(config: TransferConfig, environ: MutableMapping[str, str] | None = None) -> bool:
    """Whether a connection whose every UCX lane is tcp moves KV by puts (``config.rma_over_tcp``)."""
    if config.rma_over_tcp is not None:
        return config.rma_over_tcp
    return tcp_segment_bytes(environ) >= PUTS_OVER_TCP_MIN_SEGMENT


def ucx_net_devices(config: TransferConfig, environ: MutableMapping[str, str]) -> str | None:
    """The ``UCX_NET_DEVICES`` a worker runs with (None: unset, every device): ``config.interface``
    when given, else the environment's, else the interface(s) carrying ``config.host``."""
    if config.interface:
        return None if config.interface == "all" else config.interface
    if "UCX_NET_DEVICES" in environ:
        return environ["UCX_NET_DEVICES"]
    return interfaces_for_host(config.host)


def apply_ucx_env(config: TransferConfig, environ: MutableMapping[str, str] | None = None) -> None:
    """Set UCX's network devices for ``config`` and fill UCX defaults the user has not set.

    Call before ucxx starts: UCX reads its environment once, when the process's context is made.
    """
    env = os.environ if environ is None else environ
    devices = ucx_net_devices(config, env)
    if devices is None:
        env.pop("UCX_NET_DEVICES", None)
    else:
        env["UCX_NET_DEVICES"] = devices
    for key, value in _UCX_ENV_DEFAULTS.items():
        # UCX refuses a tcp interface whose receive segments are smaller than its send segments: an
        # operator's smaller UCX_TCP_RX_SEG_SIZE keeps UCX's own send segments.
        if key == "UCX_TCP_TX_SEG_SIZE" and tcp_segment_bytes(env, "UCX_TCP_RX_SEG_SIZE") < (64 << 10):
            continue
        env.setdefault(key, value)
