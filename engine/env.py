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
LINEAR_VAR = "PDSERVE_LINEAR"
LINEAR_KINDS = ("auto", "plain", "onednn", "panels")
KERNEL_ISA_VAR = "PDSERVE_KERNEL_ISA"
# Builds of the C kernels (engine.cpu_kernels._isa_cflags says what each compiles with).
KERNEL_ISAS = ("native", "avx2", "generic", "simde-avx512")
TP_COLLECTIVES_VAR = "PDSERVE_TP_COLLECTIVES"
# How a CPU tensor-parallel group's ranks exchange activations (engine.tp_host).
TP_COLLECTIVES = ("shared", "gloo")


@dataclass(frozen=True)
class EngineEnv:
    """Settings taken from the environment. ``None`` means "not set: use the default"."""

    cache_dir: Path | None = None
    # PDSERVE_LINEAR=auto|plain|onednn|panels: the matmul path (engine.weights.choose_linear); benchmarks
    # compare them.
    linear: str | None = None
    # PDSERVE_KERNEL_ISA=native|avx2|generic|simde-avx512: which build of the C kernels to load (the
    # default, native, is the only one for serving; the others let the tests run every ISA path here).
    kernel_isa: str | None = None
    # PDSERVE_TP_COLLECTIVES=shared|gloo: a CPU tensor-parallel group's collectives through shared memory
    # (the default) or all through gloo's loopback (benchmarks compare them).
    tp_collectives: str | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> EngineEnv:
        env = os.environ if environ is None else environ
        raw = env.get(CACHE_DIR_VAR, "").strip()
        # An empty value counts as unset, so `PDSERVE_CACHE_DIR= cmd` falls back to the default.
        linear = env.get(LINEAR_VAR, "").strip().lower()
        if linear and linear not in LINEAR_KINDS:
            kinds = ", ".join(LINEAR_KINDS)
            raise ValueError(f"{LINEAR_VAR} must be one of {kinds} (or unset), got {linear!r}")
        isa = env.get(KERNEL_ISA_VAR, "").strip().lower()
        if isa and isa not in KERNEL_ISAS:
            raise ValueError(
                f"{KERNEL_ISA_VAR} must be one of {', '.join(KERNEL_ISAS)} (or unset), got {isa!r}"
            )
        collectives = env.get(TP_COLLECTIVES_VAR, "").strip().lower()
        if collectives and collectives not in TP_COLLECTIVES:
            known = ", ".join(TP_COLLECTIVES)
            raise ValueError(f"{TP_COLLECTIVES_VAR} must be one of {known} (or unset), got {collectives!r}")
        return cls(
            cache_dir=Path(raw).expanduser() if raw else None,
            linear=linear or None,
            kernel_isa=isa or None,
            tp_collectives=collectives or None,
        )
