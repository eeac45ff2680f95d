"""The engine's environment variables, read in this one place.

Everything else takes an :class:`EngineEnv` (or the values in it) as an argument,
so tests and embedding programs can pass their own without touching ``os.environ``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

CACHE_DIR_VAR = "PDSERVE_CACHE_DIR"
PACK_LINEAR_VAR = "PDSERVE_PACK_LINEAR"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class EngineEnv:
    """Settings taken from the environment. ``None`` means "not set: use the default"."""

    cache_dir: Path | None = None
    # PDSERVE_PACK_LINEAR=1/0: force oneDNN weight pre-packing on or off (benchmarks compare both).
    pack_linear: bool | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> EngineEnv:
        env = os.environ if environ is None else environ
        raw = env.get(CACHE_DIR_VAR, "").strip()
        # An empty value counts as unset, so `PDSERVE_CACHE_DIR= cmd` falls back to the default.
        pack = env.get(PACK_LINEAR_VAR, "").strip().lower()
        if pack and pack not in _TRUE + _FALSE:
            raise ValueError(f"{PACK_LINEAR_VAR} must be 1 or 0 (or unset), got {pack!r}")
        return cls(
            cache_dir=Path(raw).expanduser() if raw else None,
            pack_linear=None if not pack else pack in _TRUE,
        )
