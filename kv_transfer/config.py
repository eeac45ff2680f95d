"""Transfer configuration, built once at startup. Pure: no torch, no ucxx.

This is also the one place the kv_transfer package touches the environment:
:func:`apply_ucx_env_defaults` fills UCX defaults before ucxx is imported.
Transport choice otherwise follows UCX's own variables (``UCX_TLS`` and
friends), which UCX reads itself.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from enum import StrEnum


class Backend(StrEnum):
    UCX = "ucx"  # ucxx over TCP, shared memory, RDMA or CUDA transports
    INPROC = "inproc"  # same-process fake for unit tests


@dataclass(frozen=True)
class FaultConfig:
    """Failure injection on the sending side, for tests (as SGLang's fake backend does).

    ``drop_layers``: layers that are never sent (the receiver sees a missing layer).
    ``delay_s``: extra delay before sending ``delay_layers`` (every layer when None).
    """

    drop_layers: frozenset[int] = frozenset()
    delay_s: float = 0.0
    delay_layers: frozenset[int] | None = None

    def __post_init__(self) -> None:
        if self.delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {self.delay_s}")
        if any(layer < 0 for layer in self.drop_layers):
            raise ValueError("drop_layers must be non-negative layer indices")

    @property
    def active(self) -> bool:
        return bool(self.drop_layers) or self.delay_s > 0

    def delay_for(self, layer: int) -> float:
        if self.delay_s == 0.0:
            return 0.0
        if self.delay_layers is None or layer in self.delay_layers:
            return self.delay_s
        return 0.0


@dataclass(frozen=True)
class TransferConfig:
    """How a worker moves KV.

    ``host``: the address this worker advertises in tickets. ucxx's listener
    takes only a port and listens on every interface, so restricting the bind
    address is left to the host firewall.
    ``port``: listener port; 0 picks a free one.
    ``deadline_s``: default lifetime of a reservation; the receiver frees the
    blocks when it passes.
    ``settle_timeout_s``: how long a failing side waits for in-flight messages
    to finish before it force-closes the connection (bounds every cleanup).
    ``ucx_shared_memory``: move data on a second UCX endpoint created from the
    receiver's worker address without peer-failure handling. UCX only picks
    shared-memory transports (posix, cma) on such endpoints; peer death is
    still detected on the control endpoint, which keeps error handling.
    """

    backend: Backend = Backend.UCX
    host: str = "127.0.0.1"
    port: int = 0
    deadline_s: float = 30.0
    connect_timeout_s: float = 5.0
    settle_timeout_s: float = 2.0
    ucx_shared_memory: bool = False
    faults: FaultConfig = field(default_factory=FaultConfig)
    # The cluster token both ends prove in the handshake (auth.py); "": neither proves nor checks.
    cluster_token: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.backend, Backend):
            object.__setattr__(self, "backend", Backend(self.backend))
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("deadline_s", "connect_timeout_s", "settle_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.host:
            raise ValueError("host must not be empty")


# UCX 1.21 no longer knows UCX_MEMTYPE_CACHE, which ucxx sets on import, and
# warns about it on every context creation.
_UCX_ENV_DEFAULTS = {"UCX_WARN_UNUSED_ENV_VARS": "n"}


def apply_ucx_env_defaults(environ: MutableMapping[str, str] | None = None) -> None:
    """Fill UCX environment defaults that the user has not set (call before importing ucxx)."""
    env = os.environ if environ is None else environ
    for key, value in _UCX_ENV_DEFAULTS.items():
        env.setdefault(key, value)
