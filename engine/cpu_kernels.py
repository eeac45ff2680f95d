"""C kernels for the CPU path (paged decode attention, prefill attention, fused elementwise ops, packed
products), built on first use with the system C compiler and cached; ``load_cpu_kernels`` returns None
(the engine then takes the torch path) where no compiler can build them. How they are built, cached and
called, and the one-thread rule: docs/engine.md, "C kernels for the CPU"."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import platformdirs
import torch

from pdserve.engine.env import KERNEL_ISAS, EngineEnv

log = logging.getLogger(__name__)

CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-shared")
# 512-bit vectors where AVX-512 exists (GCC otherwise prefers 256-bit ones on x86); other CPUs ignore it.
X86_CFLAGS = ("-mprefer-vector-width=512",)
COMPILE_TIMEOUT_S = 120
# Bumped when _build changes how it compiles or links (part of the cache key). 2: compile, then link
# without -ffast-math.
BUILD_RECIPE = "2"
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# The C source: fragments of one translation unit, in the order it includes them (each opens with the blank
# line that separates it from the one before).
CSRC_DIR = Path(__file__).with_name("csrc")
SOURCE_FILES = (
    "common.h",  # headers, vector types, dtype loads and rounding stores
    "kv_rows.h",  # a sequence's K/V rows from the paged cache into float32 vectors; lane sums
    "prefetch.h",  # cache-line prefetches (decode attention, the linear panels)
    "decode_attention.c",  # paged_decode_attention
    "prefill_attention.c",  # prefill_attention
    "sampling.c",  # argmax_rows, seeded_race
    "elementwise.c",  # add_rms_norm, rope_store, silu_mul
    "linear.c",  # linear_packed, pack_linear_weight: float and int8 panels
    "peak.c",  # fma_peak, bf16_dot_peak
)


def kernel_source() -> str:
    """The text the library is built from: the fragments concatenated in order (what the cache key hashes)."""
    return "".join((CSRC_DIR / name).read_text(encoding="utf-8") for name in SOURCE_FILES)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


# Instruction-set extensions that change which code paths run (ours via -march=native, oneDNN's by its own
# dispatch), in the order cpu_isa() names the best one.
_ISA_FLAGS = ("amx_bf16", "avx512_bf16", "avx512_vnni", "avx512f", "avx2", "fma", "asimd", "sve")


def cpu_isa() -> dict[str, object]:
    """The host's instruction set as benchmarks report it: ``{"isa": "avx512_bf16" | "avx512f" | "avx2" |
    "asimd" | ..., "flags": [the relevant extensions present], "machine": platform.machine()}``."""
    present = set(_cpu_flags().split(":", 1)[-1].split())
    found = [f for f in _ISA_FLAGS if f in present]
    best = next((f for f in found if f not in ("fma", "avx512_vnni")), "portable")
    return {"isa": best, "flags": found, "machine": platform.machine()}


def _compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


def _is_x86() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


def _simde_include() -> str | None:
    """SIMDe's header folder (the ``simde-py`` package, in the test extras), or None."""
    try:
        import simde_py  # type: ignore[import-not-found, import-untyped, unused-ignore]
    except ImportError:
        return None
    return str(simde_py.get_include())


def _isa_cflags(isa: str) -> tuple[str, ...]:
    """Compiler flags of one build (``EngineEnv.kernel_isa``). Every build runs on the host that compiles it:
    ``native`` uses all its extensions; ``avx2`` caps them below AVX-512 and ``generic`` below AVX2 (the
    plain vector-extension code, as on a CPU without them), so an AVX-512 host can test the narrower paths;
    ``simde-avx512`` compiles the AVX-512 and AVX512-BF16 paths with SIMDe's emulation of their intrinsics,
    so a host without them can test those."""
    if isa not in KERNEL_ISAS:
        raise ValueError(f"unknown kernel ISA {isa!r}: one of {', '.join(KERNEL_ISAS)}")
    if isa == "native":
        return CFLAGS + (X86_CFLAGS if _is_x86() else ())
    if not _is_x86():
        raise ValueError(f"kernel ISA {isa!r} is an x86-64 build; this is {platform.machine()}")
    if isa == "avx2":
        return CFLAGS + ("-mno-avx512f",)
    if isa == "generic":
        return CFLAGS + ("-mno-avx2", "-mno-avx512f")
    include = _simde_include()
    if include is None:
        raise ValueError(
            f"kernel ISA {isa!r} needs SIMDe's headers: pip install simde-py (pdserve's test extras)"
        )
    # -O1: GCC 12 took 4 min 44 s at -O3 to compile SIMDe's inlined emulation on an AVX2-only EPYC (the
    # tests' 120 s compile limit failed every simde-avx512 test there), 15 s at -O1. The build exists to
    # test the AVX-512 code paths' results on hosts without them, not their speed.
    return (
        tuple(f for f in CFLAGS if f != "-O3") + X86_CFLAGS + ("-O1", "-DPDSERVE_SIMDE_AVX512", "-I", include)
    )


def kernel_isas_to_check() -> list[str]:
    """The builds that run different code paths on this host, native first: each of them is checked against
    the torch oracle by the tests (``avx2`` only where AVX-512 exists, ``simde-avx512`` only where AVX512-BF16
    does not and SIMDe is installed)."""
    if not _is_x86():
        return ["native"]
    flags = set(cpu_isa()["flags"])  # type: ignore[call-overload]
    isas = ["native"]
    if "avx512f" in flags:
        isas.append("avx2")
    if "avx2" in flags or "avx512f" in flags:
        isas.append("generic")
    if "avx512_bf16" not in flags and _simde_include() is not None:
        isas.append("simde-avx512")
    return isas


def _run_compiler(argv: list[str]) -> None:
    """Run one compiler command in a process group of its own, so a timeout kills all of it: killing the
    ``cc`` driver alone (``subprocess.run``'s timeout) left its ``cc1`` compiling on, loading the host."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=COMPILE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, argv, out, err)


def _build(cc: str, out: Path, cflags: tuple[str, ...]) -> None:
    with tempfile.TemporaryDirectory(prefix="pdserve-kernel-") as tmp:
        # The unit includes the fragments where they are, so compiler messages name engine/csrc/*:line.
        src = Path(tmp) / "paged_attention.c"
        src.write_text("".join(f'#include "{name}"\n' for name in SOURCE_FILES))
        obj = Path(tmp) / "paged_attention.o"
        so = Path(tmp) / "paged_attention.so"
        # Compiled and linked apart: a link with -ffast-math adds GCC's crtfastmath.o, whose constructor
        # turns on flush-to-zero and denormals-are-zero for the whole process the library loads into, so
        # torch and numpy there would silently lose subnormals (tests/e2e/test_cpu_kernels_fp_env.py checks
        # they do not).
        compile_flags = [f for f in cflags if f != "-shared"] + ["-iquote", str(CSRC_DIR)]
        for argv in (
            [cc, *compile_flags, "-c", "-o", str(obj), str(src)],
            [cc, "-shared", "-fopenmp", "-o", str(so), str(obj), "-lm"],
        ):
            _run_compiler(argv)
        out.parent.mkdir(parents=True, exist_ok=True)
        staged = out.parent / f".{out.name}.{os.getpid()}.tmp"
        shutil.copyfile(so, staged)
        os.replace(staged, out)  # atomic: a concurrent loader sees the old file or the whole new one


def _check(rc: int, name: str) -> None:
    if rc != 0:
        raise RuntimeError(f"CPU kernel {name} failed (code {rc})")


@dataclass(frozen=True)
class CpuKernels:
    """ctypes entry points. Tensors must be contiguous CPU tensors of one dtype unless noted."""

    lib: ctypes.CDLL
    path: Path
    isa: str = "native"  # which build (EngineEnv.kernel_isa)

    def decode_attention(
        self,
        kv_layer: torch.Tensor,
        q: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
        max_blocks: int,
        max_len: int,
        next_kv_layer: torch.Tensor | None = None,
        seq_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``kv_layer [N, 2, B, Hkv, D]``, ``q [Bsz, H, D]`` (rows may be strided), ``tables [Bsz * M]``,
        ``lens [Bsz]`` int64 -> ``[Bsz, H * D]`` in the cache dtype. ``next_kv_layer`` (same shape and
        dtype): the layer that attends next, whose rows of the same blocks are prefetched into cache.
        ``seq_rows``: None, or int64 ``[n_seqs + 1]`` starts of runs of rows sharing one table (one
        sequence's consecutive positions), whose K/V the kernel reads once for the whole run."""
        bsz, n_h, d = q.shape
        _, _, b, n_kv, _ = kv_layer.shape
        if not (
            kv_layer.is_contiguous()
            and q.stride(2) == 1
            and q.stride(1) == d
            and q.dtype == kv_layer.dtype
            and tables.is_contiguous()
            and lens.is_contiguous()
            and (seq_rows is None or (seq_rows.is_contiguous() and seq_rows.dtype == torch.int64))
        ):
            raise ValueError("decode kernel needs a contiguous cache layer and row-major q heads")
        if next_kv_layer is not None and not (
            next_kv_layer.is_contiguous()
            and next_kv_layer.shape == kv_layer.shape
            and next_kv_layer.dtype == kv_layer.dtype
        ):
            raise ValueError("next_kv_layer must be a contiguous cache layer like kv_layer")
        out = torch.empty(bsz, n_h * d, dtype=q.dtype, device=q.device)  # [Bsz, H * D]
        _check(
            self.lib.paged_decode_attention(
                kv_layer.data_ptr(),
                None if next_kv_layer is None else next_kv_layer.data_ptr(),
                q.data_ptr(),
                out.data_ptr(),
                tables.data_ptr(),
                lens.data_ptr(),
                None if seq_rows is None else seq_rows.data_ptr(),
                0 if seq_rows is None else len(seq_rows) - 1,
                bsz,
                max_blocks,
                b,
                n_h,
                n_kv,
                d,
                q.stride(0),
                max_len,
                d**-0.5,
                _DTYPE_CODES[q.dtype],
                torch.get_num_threads(),
            ),
            "paged_decode_attention",
        )
        return out

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of a fresh prompt (no cached prefix): ``q [n, H, D]``, ``k, v [n, Hkv, D]``
        (rows may be strided, heads contiguous) -> ``[n, H * D]``, float32 arithmetic, grouped-query heads."""
        n, n_h, d = q.shape
        n_kv = k.shape[1]
        if not (
            q.stride(2) == 1
            and q.stride(1) == d
            and k.stride(2) == 1
            and k.stride(1) == d
            and v.stride() == k.stride()
            and k.shape == v.shape == (n, n_kv, d)
            and q.dtype == k.dtype == v.dtype
        ):
            raise ValueError("prefill kernel needs row-major heads and k, v of one shape and stride")
        out = torch.empty(n, n_h * d, dtype=q.dtype, device=q.device)  # [n, H * D]
        _check(
            self.lib.prefill_attention(
                q.data_ptr(),
                k.data_ptr(),
                v.data_ptr(),
                out.data_ptr(),
                n,
                n_h,
                n_kv,
                d,
                q.stride(0),
                k.stride(0),
                d**-0.5,
                _DTYPE_CODES[q.dtype],
                torch.get_num_threads(),
            ),
            "prefill_attention",
        )
        return out

    def prefill_attention_paged(
        self, q: torch.Tensor, kv_layer: torch.Tensor, table: torch.Tensor, start: int
    ) -> torch.Tensor:
        """Causal attention of new tokens continuing a cached prefix: ``q [n, H, D]`` (rows may be strided,
        heads contiguous) at positions ``[start, start + n)``, against keys ``[0, start + n)`` of one cache
        layer ``kv_layer [N, 2, B, Hkv, D]`` (the new tokens' K/V already stored) in the blocks of ``table``
        (int64, at least ``ceil((start + n) / B)`` ids) -> ``[n, H * D]``, as ``prefill_attention``."""
        n, n_h, d = q.shape
        _, _, b, n_kv, kv_d = kv_layer.shape
        if not (
            q.stride(2) == 1
            and q.stride(1) == d
            and kv_d == d
            and kv_layer.is_contiguous()
            and q.dtype == kv_layer.dtype
            and table.dtype == torch.int64
            and table.is_contiguous()
            and start >= 0
            and table.numel() * b >= start + n
        ):
            raise ValueError(
                "prefill_attention_paged needs row-major q heads, a contiguous cache layer of q's dtype and "
                "an int64 block table covering start + n positions"
            )
        out = torch.empty(n, n_h * d, dtype=q.dtype, device=q.device)  # [n, H * D]
        _check(
            self.lib.prefill_attention_paged(
                q.data_ptr(),
                kv_layer.data_ptr(),
                table.data_ptr(),
                out.data_ptr(),
                start,
                n,
                b,
                n_h,
                n_kv,
                d,
                q.stride(0),
                d**-0.5,
                _DTYPE_CODES[q.dtype],
                torch.get_num_threads(),
            ),
            "prefill_attention_paged",
        )
        return out

    def add_rms_norm(
        self, x: torch.Tensor, res: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``x += res`` in place (when given), then return ``rmsnorm(x) * weight``; ``x, res [T, n]``."""
        if not (x.is_contiguous() and (res is None or res.is_contiguous()) and weight.is_contiguous()):
            raise ValueError("add_rms_norm needs contiguous rows")
        t, n = x.shape
        h = torch.empty_like(x)  # [T, n]
        _check(
            self.lib.add_rms_norm(
                x.data_ptr(),
                None if res is None else res.data_ptr(),
                h.data_ptr(),
                weight.data_ptr(),
                t,
                n,
                eps,
                _DTYPE_CODES[x.dtype],
                torch.get_num_threads(),
            ),
            "add_rms_norm",
        )
        return h

    def rope_store(
        self,
        qkv: torch.Tensor,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        positions: torch.Tensor,
        kv_layer: torch.Tensor,
        k_rows: torch.Tensor,
        v_rows: torch.Tensor,
    ) -> None:
        """RoPE on the q and k heads of ``qkv [T, (H + 2Hkv) * D]`` in place (tables ``[P, D]``, rows
        picked by ``positions [T]``), then store K and V at ``k_rows``/``v_rows`` of ``kv_layer`` viewed as
        ``[N * 2B, Hkv, D]``."""
        if not (
            qkv.stride(1) == 1
            and kv_layer.is_contiguous()
            and cos.is_contiguous()
            and sin_signed.is_contiguous()
            and all(t.is_contiguous() and t.dtype == torch.int64 for t in (positions, k_rows, v_rows))
        ):
            raise ValueError("rope_store needs row-major qkv, a contiguous cache layer and int64 indices")
        _check(
            self.lib.rope_store(
                qkv.data_ptr(),
                qkv.shape[0],
                qkv.stride(0),
                n_heads + n_kv_heads,
                n_kv_heads,
                head_dim,
                cos.data_ptr(),
                sin_signed.data_ptr(),
                positions.data_ptr(),
                kv_layer.data_ptr(),
                k_rows.data_ptr(),
                v_rows.data_ptr(),
                _DTYPE_CODES[qkv.dtype],
                torch.get_num_threads(),
            ),
            "rope_store",
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up [T, 2I]`` -> ``[T, I]``."""
        if not gate_up.is_contiguous():
            raise ValueError("silu_mul needs contiguous rows")
        t, two_i = gate_up.shape
        out = torch.empty(t, two_i // 2, dtype=gate_up.dtype, device=gate_up.device)  # [T, I]
        _check(
            self.lib.silu_mul(
                gate_up.data_ptr(),
                out.data_ptr(),
                t,
                two_i // 2,
                _DTYPE_CODES[gate_up.dtype],
                torch.get_num_threads(),
            ),
            "silu_mul",
        )
        return out

    def panel_width(self) -> int:
        """P: output columns per panel of ``pack_linear_weight``'s layout (two vectors)."""
        return int(self.lib.linear_panel_width())

    def bf16_pairs(self, k: int) -> bool:
        """Whether this build packs bfloat16 weights of ``k`` inputs in pairs (``[K / 2, P, 2]`` per panel,
        multiplied by AVX512-BF16 dot products): builds with those instructions, even ``k``."""
        return bool(self.lib.linear_bf16_pairs(k))

    def pack_linear_weight(
        self,
        weight: torch.Tensor,
        alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``weight [N, K]`` -> the panel layout ``linear`` streams: ``[ceil(N / P), K, P]`` in its dtype
        (P = ``panel_width()``), zero-padded. int8 weights (``engine.quant``) pack the same way. bfloat16
        where ``bf16_pairs(K)``: the same shape, each panel's rows in pairs ``[K / 2, P, 2]``. ``alloc(shape,
        dtype)``: where the result goes (an uninitialised contiguous CPU tensor; default ``torch.empty``),
        e.g. ``engine.hugepages.HugePageArena.empty``."""
        if weight.dim() != 2 or (weight.dtype not in _DTYPE_CODES and weight.dtype != torch.int8):
            got = f"{weight.dtype} {tuple(weight.shape)}"
            raise ValueError(f"pack_linear_weight: need a 2-D float or int8 weight, not {got}")
        w = weight.contiguous()
        n, k = w.shape
        p = self.panel_width()
        shape = (-(-n // p), k, p)
        out = torch.empty(shape, dtype=w.dtype) if alloc is None else alloc(shape, w.dtype)
        if tuple(out.shape) != shape or out.dtype != w.dtype or not out.is_contiguous():
            raise ValueError(f"pack_linear_weight: alloc gave {tuple(out.shape)} {out.dtype}, not {shape}")
        pairs = int(w.dtype == torch.bfloat16 and self.bf16_pairs(k))
        _check(
            self.lib.pack_linear_weight(w.data_ptr(), out.data_ptr(), n, k, w.element_size(), pairs), "pack"
        )
        return out

    def gate_up_panel_order(self, intermediate: int) -> torch.Tensor | None:
        """Row order of a fused ``[gate; up]`` weight (``2 * intermediate`` rows) for ``linear(...,
        silu_mul=True)``: each panel holds W gate rows then the same W up rows (W = half a panel). None when
        ``intermediate`` is not a multiple of W (the product and ``silu_mul`` then run apart)."""
        w = self.panel_width() // 2
        if intermediate % w:
            return None
        gate = torch.arange(intermediate).view(-1, w)  # [I / W, W]
        return torch.cat([gate, gate + intermediate], dim=1).reshape(-1)  # [2I]

    def pack_int8_scales(self, scales: torch.Tensor) -> torch.Tensor:
        """``scales [N, G]`` float32 (``engine.quant.quantize_int8``) -> the layout ``linear`` reads beside
        int8 panels: ``[ceil(N / P), G, P]``, zero-padded."""
        n, g = scales.shape
        p = self.panel_width()
        padded = torch.zeros(-(-n // p) * p, g, dtype=torch.float32)
        padded[:n] = scales
        return padded.view(-1, p, g).transpose(1, 2).contiguous()

    def linear(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        n: int,
        bias: torch.Tensor | None,
        scales: torch.Tensor | None = None,
        group: int = 0,
        silu_mul: bool = False,
    ) -> torch.Tensor:
        """``x [M, K] @ weight.T + bias`` -> ``[M, n]`` from ``packed = pack_linear_weight(weight)``.

        int8 ``packed``: ``weight[n, k] = q[n, k] * scale(n, k // group)``, ``scales =
        pack_int8_scales(...)``. ``silu_mul``: the weight's rows are a gate/up pair in
        ``gate_up_panel_order`` (``n`` a multiple of ``panel_width()``), and the result is ``silu(gate) * up``
        ``[M, n / 2]``, the same values as this product followed by :meth:`silu_mul` on the plain order."""
        x = x.contiguous()
        m, k = x.shape
        if silu_mul and n % self.panel_width():
            raise ValueError(f"linear: silu_mul needs n a multiple of {self.panel_width()}, not {n}")
        quantized = packed.dtype == torch.int8
        if packed.shape[1] != k or (x.dtype != packed.dtype and not quantized):
            raise ValueError(
                f"linear: x {tuple(x.shape)} {x.dtype} vs packed {tuple(packed.shape)} {packed.dtype}"
            )
        if quantized and (
            scales is None
            or group < 1
            or scales.dtype != torch.float32
            or not scales.is_contiguous()
            or tuple(scales.shape) != (packed.shape[0], -(-k // group), packed.shape[2])
        ):
            raise ValueError(
                "linear: int8 weights need float32 scales in pack_int8_scales' layout and a group"
            )
        if bias is not None and bias.dtype != x.dtype:
            raise ValueError(f"linear: bias {bias.dtype} vs x {x.dtype}")
        y = torch.empty(m, n // 2 if silu_mul else n, dtype=x.dtype)
        _check(
            self.lib.linear_packed(
                x.data_ptr(),
                packed.data_ptr(),
                scales.data_ptr() if quantized and scales is not None else None,
                None if bias is None else bias.data_ptr(),
                y.data_ptr(),
                m,
                k,
                n,
                group if quantized else k,
                _DTYPE_CODES[x.dtype],
                int(silu_mul),
                torch.get_num_threads(),
            ),
            "linear_packed",
        )
        return y

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits.argmax(-1)`` for ``[n, V]`` float32 rows without NaN (first index of the largest value);
        other tensors go to torch."""
        if logits.dim() != 2 or logits.dtype != torch.float32 or logits.device.type != "cpu":
            return logits.argmax(dim=-1)
        x = logits.contiguous()
        out = torch.empty(x.shape[0], dtype=torch.int64)
        _check(
            self.lib.argmax_rows(
                x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads()
            ),
            "argmax_rows",
        )
        return out

    def seeded_race(self, probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``engine.sampler.seeded_race`` in one pass: ``probs [m, V]`` float32 on the CPU (anything else
        goes to torch), ``keys [m]`` int64."""
        if probs.dim() != 2 or probs.dtype != torch.float32 or probs.device.type != "cpu":
            from pdserve.engine.sampler import seeded_race

            return seeded_race(probs, keys)
        x = probs.contiguous()
        k = keys.to(torch.int64).contiguous()
        if k.shape != (x.shape[0],):
            raise ValueError(f"keys has shape {tuple(k.shape)}, expected ({x.shape[0]},)")
        out = torch.empty(x.shape[0], dtype=torch.int64)
        _check(
            self.lib.seeded_race(
                x.data_ptr(), k.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads()
            ),
            "seeded_race",
        )
        return out

    def fma_peak(self, threads: int, seconds: float = 0.2) -> float:
        """Measured float32 FMA FLOP/s of ``threads`` threads (best of 3 runs of about ``seconds``)."""
        return self._peak(self.lib.fma_peak, threads, seconds)

    def bf16_dot_peak(self, threads: int, seconds: float = 0.2) -> float | None:
        """Measured FLOP/s of AVX512-BF16 dot products (``vdpbf16ps``, what bfloat16 products run as here),
        as ``fma_peak``; None where this build has no native AVX512-BF16 (then bfloat16 products widen to
        float32, and ``fma_peak`` bounds them)."""
        sink = ctypes.c_float()
        if self.lib.bf16_dot_peak(1, 1, ctypes.byref(sink)) == 0:
            return None
        return self._peak(self.lib.bf16_dot_peak, threads, seconds)

    @staticmethod
    def _peak(probe: Callable[..., float], threads: int, seconds: float) -> float:
        sink = ctypes.c_float()
        iters = 1 << 16
        while True:  # grow the run until it is long enough to time
            t = time.perf_counter()
            flops = probe(iters, threads, ctypes.byref(sink))
            if time.perf_counter() - t >= seconds / 4 or iters >= 1 << 34:
                break
            iters *= 4
        best = 0.0
        for _ in range(3):
            t = time.perf_counter()
            flops = probe(iters, threads, ctypes.byref(sink))
            best = max(best, flops / (time.perf_counter() - t))
        return best


def supports(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Shapes the kernels handle (whole 16-float vectors per head, RoPE rows on the stack); others use the
    torch path."""
    return head_dim % 16 == 0 and head_dim <= 512 and num_heads % num_kv_heads == 0 and dtype in _DTYPE_CODES


def kernel_cache_dir(env: EngineEnv | None = None) -> Path:
    """``$PDSERVE_CACHE_DIR/kernels``, else ``kernels`` in the user cache dir."""
    env = env or EngineEnv.from_environ()
    base = env.cache_dir if env.cache_dir is not None else Path(platformdirs.user_cache_dir("pdserve"))
    return base / "kernels"


def load_cpu_kernels(cache_dir: Path, isa: str | None = None) -> CpuKernels | None:
    """Build (once per cache) and load the kernel library; None when that is not possible here. ``isa``: which
    build (default: ``PDSERVE_KERNEL_ISA``, else native); a build this host cannot make is a ValueError."""
    isa = isa or EngineEnv.from_environ().kernel_isa or "native"
    cflags = _isa_cflags(isa)
    if isa != "native":
        log.warning("CPU kernels: the %s build (PDSERVE_KERNEL_ISA), a test build, not the fastest here", isa)
    cc = _compiler()
    if cc is None:
        log.info("no C compiler found: decode attention uses the torch path")
        return None
    try:
        version = subprocess.run(
            [cc, "--version"], check=True, capture_output=True, text=True, timeout=30
        ).stdout
        recipe = [kernel_source(), *cflags, BUILD_RECIPE, version, _cpu_flags(), platform.machine()]
        key = hashlib.sha256("\0".join(recipe).encode())
        path = cache_dir / f"paged_attention-{key.hexdigest()[:16]}.so"
        if isa != "native":
            path = path.with_name(f"paged_attention-{isa}-{key.hexdigest()[:16]}.so")
        if not path.is_file():
            _build(cc, path, cflags)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        log.warning(
            "building the CPU decode kernel failed (%s %s): using the torch path",
            exc,
            detail.decode(errors="replace")[-2000:] if isinstance(detail, bytes) else detail,
        )
        return None
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    signatures = {
        "paged_decode_attention": [ptr] * 7 + [i64] * 9 + [f32, i32, i32],
        "add_rms_norm": [ptr] * 4 + [i64, i64, f32, i32, i32],
        "rope_store": [ptr, i64, i64, i64, i64, i64] + [ptr] * 6 + [i32, i32],
        "silu_mul": [ptr, ptr, i64, i64, i32, i32],
        "fma_peak": [i64, i32, ptr],
        "bf16_dot_peak": [i64, i32, ptr],
        "linear_packed": [ptr] * 5 + [i64] * 4 + [i32, i32, i32],
        "prefill_attention": [ptr] * 4 + [i64] * 6 + [f32, i32, i32],
        "prefill_attention_paged": [ptr] * 4 + [i64] * 7 + [f32, i32, i32],
        "pack_linear_weight": [ptr, ptr, i64, i64, i64, i32],
        "linear_bf16_pairs": [i64],
        "linear_panel_width": [],
        "argmax_rows": [ptr, i64, i64, ptr, i32],
        "seeded_race": [ptr, ptr, i64, i64, ptr, i32],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_double if name in ("fma_peak", "bf16_dot_peak") else ctypes.c_int
    return CpuKernels(lib=lib, path=path, isa=isa)
