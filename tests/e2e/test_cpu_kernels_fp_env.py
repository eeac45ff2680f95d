"""Loading the C kernel library leaves a fresh process's floating-point environment alone."""

from __future__ import annotations


def test_loading_the_library_leaves_the_process_floating_point_alone(kernels_every_isa) -> None:
    """A shared object linked with -ffast-math carries GCC's crtfastmath.o, which turns on flush-to-zero and
    denormals-are-zero for the whole process at load: torch and numpy there would lose every subnormal. The
    build links without it. Checked in a fresh process (this one may have loaded other libraries)."""
    import subprocess
    import sys

    code = (
        "import ctypes, torch; t = torch.tensor([1e-39]);"
        f"ctypes.CDLL({str(kernels_every_isa.path)!r});"
        "print((t * 0.5).item() > 0, (torch.tensor([1e-39]) * 1.0).item() > 0)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["True", "True"], (kernels_every_isa.isa, out.stdout, out.stderr[-1000:])
