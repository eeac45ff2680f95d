"""Model registry: processes converting one GGUF file at once convert it once and agree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pdserve.engine.registry import MANIFEST, cache_key
from tests.tiny_gguf import write_tiny_gguf
from tests.tiny_models import make_tiny_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("registry")
    return write_tiny_gguf(make_tiny_model("llama", root / "hf"), root / "tiny.gguf")


_CHILD = textwrap.dedent(
    """
    import logging, sys, torch
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    from pdserve.engine.registry import resolve_model
    print(resolve_model(sys.argv[1], sys.argv[2], progress=False), flush=True)
    """
)


def _spawn(gguf_file: Path, cache: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(gguf_file), str(cache)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_parallel_processes_convert_once_and_agree(gguf_file, tmp_path):
    from filelock import FileLock

    cache = tmp_path / "cache"
    cache.mkdir()
    entry = cache / cache_key(gguf_file)
    # Hold the entry's lock so both children queue on it, then let them race.
    lock = FileLock(str(cache / f".{entry.name}.lock"))
    lock.acquire()
    procs = [_spawn(gguf_file, cache) for _ in range(3)]
    try:
        time.sleep(1.0)
        assert not entry.exists()
        lock.release()
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        if lock.is_locked:
            lock.release()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    for p, (out, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err
        assert out.strip() == str(entry)
    # exactly one child converted; the others found its finished entry after the lock
    assert sum(err.count("engine.registry converted") for _, err in outputs) == 1
    manifest = json.loads((entry / MANIFEST).read_text())
    assert manifest["source_bytes"] == gguf_file.stat().st_size
    assert not list(cache.glob(".tmp-*"))
    from safetensors.numpy import load_file

    assert len(load_file(str(entry / "model.safetensors"))) == 30
