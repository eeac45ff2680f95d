"""A worker's role: what its process does with a request. Pure (no grpc, no torch).

``prefill`` computes prompts and pushes their KV to a decode worker; ``decode`` adopts pushed KV (and
prefills short prompts itself) and streams tokens; ``both`` is a colocated worker, the baseline that
disaggregation is measured against.
"""

from __future__ import annotations

import enum


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"

    @property
    def decodes(self) -> bool:
        return self is not Role.PREFILL

    @property
    def prefills_remote(self) -> bool:
        return self is Role.PREFILL
