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


@dataclass(frozen=True)
class EngineEnv:
    """Settings taken from the environment. ``None`` means "not set: use the default"."""

    cache_dir: Path | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> EngineEnv:
        env = os.environ if environ is None else environ
        raw = env.get(CACHE_DIR_VAR, "").strip()
        # An empty value counts as unset, so `PDSERVE_CACHE_DIR= cmd` falls back to the default.
        return cls(cache_dir=Path(raw).expanduser() if raw else None)
