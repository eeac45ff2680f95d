from __future__ import annotations

import os

import pytest

# Without a GPU, Triton kernels (engine/triton_kernels.py) run in Triton's interpreter; the switch is read
# when a kernel is defined, so it is set before any test imports them.
if not os.environ.get("TRITON_INTERPRET"):
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

from tests.tiny_models import KINDS, make_tiny_model

# Every router, worker and autoscaler a test starts (directly or through `pdserve up`) inherits this and
# stops once this pytest process is gone, so a killed run leaves no cluster behind (cli.lifeline).
os.environ["PDSERVE_EXIT_WITH_PID"] = str(os.getpid())


@pytest.fixture(scope="session", autouse=True)
def _torch_threads():
    # Two cores are shared by everything a test starts; be explicit.
    import torch

    torch.set_num_threads(int(os.environ.get("PDSERVE_TEST_THREADS", "2")))


@pytest.fixture(scope="session", params=KINDS)
def tiny_model_dir(request, tmp_path_factory):
    """An HF directory with a tiny random-weight model, one per kind (llama, qwen2, llama3)."""
    return make_tiny_model(request.param, tmp_path_factory.mktemp(f"tiny-{request.param}"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama-single"))


def _kernel_isas() -> list[str]:
    from pdserve.engine.cpu_kernels import kernel_isas_to_check

    return kernel_isas_to_check()


KERNEL_ISAS = _kernel_isas()


@pytest.fixture(scope="session", params=KERNEL_ISAS)
def kernels(request):
    """The C kernel library, once per build whose code paths differ on this host
    (``engine.cpu_kernels.kernel_isas_to_check``: native, then e.g. the generic build and SIMDe's AVX-512 on
    an AVX2 CPU, or the AVX2 and generic builds on an AVX-512 one), so every ISA path meets the torch oracle
    on every host; skips where none can be built."""
    from pdserve.engine.cpu_kernels import kernel_cache_dir, load_cpu_kernels

    k = load_cpu_kernels(kernel_cache_dir(), request.param)
    if k is None:
        pytest.skip("no C compiler here: the engine runs its torch path and oneDNN or F.linear")
    return k


def pytest_report_header(config):
    """Say on which CPU the suite runs and which kernel builds it checks there (the log of a CI run)."""
    from pdserve.engine.cpu_kernels import cpu_isa

    info = cpu_isa()
    flags = ", ".join(info["flags"]) or "none"  # type: ignore[arg-type]
    return f"pdserve: CPU ISA {info['isa']} ({flags}); C kernel builds checked: {', '.join(KERNEL_ISAS)}"


def pytest_collection_modifyitems(config, items):
    """``gpu`` tests skip cleanly where torch sees no CUDA device (CI, this project's CPU hosts)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine: pytest -m gpu)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
