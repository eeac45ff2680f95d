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
    # The cores are shared by the test processes and everything they start: each of N pytest-xdist
    # processes gets cores / N threads (oversubscribed torch threads spin against each other).
    import torch

    processes = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    default = max(1, min(2, len(os.sched_getaffinity(0)) // processes))
    torch.set_num_threads(int(os.environ.get("PDSERVE_TEST_THREADS", default)))


@pytest.fixture(scope="session", params=KINDS)
def tiny_model_dir(request, tmp_path_factory):
    """An HF directory with a tiny random-weight model, one per kind (llama, qwen2, llama3)."""
    return make_tiny_model(request.param, tmp_path_factory.mktemp(f"tiny-{request.param}"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama-single"))


@pytest.fixture(scope="session")
def tiny_served_model(tmp_path_factory):
    """A tiny random Llama that `pdserve up --model` serves like the default model (its vocabulary and
    tokenizer files; ``tests.tiny_models.make_tiny_served_model``): for tests of serving mechanics, where
    the real model's every forward costs ~100x more. Its context is 2,048 tokens."""
    from tests.tiny_models import make_tiny_served_model

    return make_tiny_served_model("llama", tmp_path_factory.mktemp("tiny-served"))


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory):
    """A model cache holding the packaged SmolLM2 GGUF converted (seconds), made once for the tests that
    check the conversion and the tokenizer against transformers."""
    from pdserve.engine.registry import DEFAULT_MODEL, resolve_model

    cache = tmp_path_factory.mktemp("smollm2-cache")
    resolve_model(DEFAULT_MODEL, cache, progress=False)
    return cache


@pytest.fixture(scope="session")
def gguf_parsed_once():
    """transformers parses a GGUF file's metadata (seconds of Python for a 49k vocabulary) and rebuilds
    gguf's tensor name map per layer each time it reads from the file: in this process its config,
    tokenizer and weights share one parse and one map."""
    import functools

    import gguf

    readers: dict[tuple[str, str], object] = {}
    parse = gguf.GGUFReader

    def reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = parse(path, mode)
        return readers[key]

    patch = pytest.MonkeyPatch()
    patch.setattr(gguf, "GGUFReader", reader)
    patch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
    yield
    patch.undo()


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(gguf_parsed_once):
    """transformers' tokenizer read from the packaged SmolLM2 GGUF (seconds: it parses the file), the
    reference of the tokenizer and real-model parity tests; read once."""
    from transformers import AutoTokenizer

    from pdserve.engine.registry import DEFAULT_MODEL, KNOWN_MODELS, packaged_gguf_path

    gguf = packaged_gguf_path(DEFAULT_MODEL, KNOWN_MODELS[DEFAULT_MODEL])
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


# Which C kernel builds the kernel-vs-torch unit tests check (``kernels_every_isa``): a comma-separated list
# of engine.env.KERNEL_ISAS, e.g. ``native`` alone for a quick run; unset or ``all``: every build whose code
# paths differ on this host.
TEST_KERNEL_ISAS_VAR = "PDSERVE_TEST_KERNEL_ISAS"


def _kernel_isas() -> list[str]:
    from pdserve.engine.cpu_kernels import kernel_isas_to_check
    from pdserve.engine.env import KERNEL_ISAS as builds

    raw = os.environ.get(TEST_KERNEL_ISAS_VAR, "").strip().lower()
    if raw in ("", "all"):
        return kernel_isas_to_check()
    isas = list(dict.fromkeys(i.strip() for i in raw.split(",") if i.strip()))
    unknown = [i for i in isas if i not in builds]
    if unknown or not isas:
        raise ValueError(f"{TEST_KERNEL_ISAS_VAR}={raw!r}: name builds of {', '.join(builds)}, or all")
    return isas


KERNEL_ISAS = _kernel_isas()


def _load_kernels(isa: str):
    from pdserve.engine.cpu_kernels import kernel_cache_dir, load_cpu_kernels

    k = load_cpu_kernels(kernel_cache_dir(), isa)
    if k is None:
        pytest.skip("no C compiler here: the engine runs its torch path and oneDNN or F.linear")
    return k


@pytest.fixture(scope="session", params=KERNEL_ISAS)
def kernels_every_isa(request):
    """The C kernel library once per build whose code paths differ on this host
    (``engine.cpu_kernels.kernel_isas_to_check``: native, then e.g. the generic build and SIMDe's AVX-512 on
    an AVX2 CPU, or the AVX2 and generic builds on an AVX-512 one; ``PDSERVE_TEST_KERNEL_ISAS`` narrows it),
    so every ISA path meets the torch oracle on every host. For kernel-vs-torch unit tests; skips where none
    can be built."""
    return _load_kernels(request.param)


@pytest.fixture(scope="session")
def native_kernels():
    """The native C kernel build, the one the engine serves with: for tests that run a whole model through
    the kernels (parity with transformers), whose other builds are checked op by op (``kernels_every_isa``);
    skips where it cannot be built."""
    return _load_kernels("native")


def pytest_report_header(config):
    """Say on which CPU the suite runs and which kernel builds it checks there (the log of a CI run)."""
    from pdserve.engine.cpu_kernels import cpu_isa

    info = cpu_isa()
    flags = ", ".join(info["flags"]) or "none"  # type: ignore[arg-type]
    return f"pdserve: CPU ISA {info['isa']} ({flags}); C kernel builds checked: {', '.join(KERNEL_ISAS)}"


def pytest_collection_modifyitems(config, items):
    """Files with slow tests run first, the e2e ones first among them: pytest-xdist hands out files in this
    order, so the longest start early and the many short files fill the processes' ends (file order is
    kept otherwise, and a file's tests stay in theirs). ``gpu`` tests skip cleanly where torch sees no CUDA
    device (CI, this project's CPU hosts)."""
    import torch

    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: (item.path not in slow_files, "e2e" not in item.path.parts))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine: pytest -m gpu)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
