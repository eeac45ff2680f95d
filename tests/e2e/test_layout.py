"""The packaging rule of the layout: everything installs as ``pdserve.*`` and nothing else, from a wheel
or editable. (The import contracts of ``[tool.importlinter]`` are checked by ``make lint``.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PACKAGES = (
    "engine",
    "kv_transfer",
    "worker",
    "telemetry",
    "prefill_pool",
    "decode_pool",
    "router",
    "cli",
    "bench",
    "deploy",
    "proto",
)


def test_the_wheel_holds_only_pdserve(tmp_path):
    """`pip install .` puts one top-level name into site-packages: pdserve (plus its dist-info)."""
    # Built from a copy: setuptools' in-tree build/ folder could hold modules deleted since.
    src = tmp_path / "src"
    skip = shutil.ignore_patterns(
        ".venv", ".git", "build", "results", "__pycache__", ".pdserve", "*.egg-info"
    )
    shutil.copytree(ROOT, src, ignore=skip)
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path]
    subprocess.run([*pip, src], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("pdserve-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"pdserve", wheel.name.split("-py3")[0] + ".dist-info"}, tops
    for pkg in PACKAGES:
        assert f"pdserve/{pkg}/__init__.py" in names, f"pdserve.{pkg} is missing from the wheel"
    assert not any("/results/" in n for n in names), "bench results must not be installed"
    assert not any(n.startswith("pdserve/tests") for n in names)
    # Installed from the wheel alone, outside the repository, the bare names do not import.
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    _check_imports(tmp_path, pythonpath=site, expect_prefix=site)


def _check_imports(cwd: Path, pythonpath: Path | None, expect_prefix: Path) -> None:
    import os

    code = (
        "import importlib, sys\n"
        "for bare in ('engine', 'router', 'proto', 'bench', 'kv_transfer', 'prefill_pool', 'decode_pool'):\n"
        "    try:\n"
        "        importlib.import_module(bare)\n"
        "    except ModuleNotFoundError:\n"
        "        continue\n"
        "    sys.exit(f'import {bare} worked')\n"
        "import pdserve.router.service, pdserve.proto.worker_pb2\n"
        "print(pdserve.router.service.__file__)\n"
    )
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().startswith(str(expect_prefix)), r.stdout


def test_the_editable_install_outside_the_repository(tmp_path):
    """`make test`'s editable install: outside the checkout only pdserve.* imports; the CLI runs."""
    _check_imports(tmp_path, pythonpath=None, expect_prefix=ROOT)
    r = subprocess.run(
        [str(BIN / "pdserve"), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert "worker" in r.stdout and "router" in r.stdout
