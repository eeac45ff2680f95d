"""The layout's rules: everything installs as ``pdserve.*`` (and nothing else), and the import contracts of
``[tool.importlinter]`` in pyproject.toml hold, and break when a forbidden import is added."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

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


def lint_imports(pythonpath: Path | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = None
    if pythonpath is not None:
        import os

        env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run(
        [str(BIN / "lint-imports"), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_import_contracts_hold():
    r = lint_imports()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout


@pytest.mark.parametrize(
    ("folder", "module", "line", "broken"),
    [
        # A pool importing the router (the example), and a sibling pool.
        ("prefill_pool", "loop.py", "import pdserve.router.service", "pdserve.prefill_pool is not allowed"),
        (
            "decode_pool",
            "remote.py",
            "import pdserve.prefill_pool.loop",
            "pdserve.decode_pool is not allowed",
        ),
        # Anything importing the CLI.
        ("router", "service.py", "import pdserve.cli.main", "pdserve.router is not allowed"),
        # The worker runtime importing a pool.
        ("worker", "shell.py", "import pdserve.decode_pool.stream", "pdserve.worker is not allowed"),
        # kv_transfer reaching into the engine outside its test harness.
        ("kv_transfer", "receiver.py", "import pdserve.engine.block_manager", "forbidden"),
        # An import circle between two modules of one package (sender already imports handle).
        ("kv_transfer", "handle.py", "import pdserve.kv_transfer.sender", "import circles"),
    ],
)
def test_a_forbidden_import_breaks_the_contracts(tmp_path, folder, module, line, broken):
    """A copy of the tree (symlinks, one folder copied) with one import added: lint-imports must fail."""
    tree = tmp_path / "pdserve"
    tree.mkdir()
    for name in PACKAGES:
        if name == folder:
            shutil.copytree(ROOT / name, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (tree / name).symlink_to(ROOT / name)
    target = tree / folder / module
    target.write_text(target.read_text() + f"\n{line}  # added by the test\n")
    r = lint_imports(pythonpath=tmp_path, cwd=tmp_path)
    assert r.returncode != 0, f"lint-imports passed with `{line}` in {folder}/{module}:\n{r.stdout}"
    assert "BROKEN" in r.stdout
    if broken == "forbidden":
        assert "kv_transfer moves bytes" in r.stdout and "BROKEN" in r.stdout
    elif broken == "import circles":
        assert "No import circles" in r.stdout.split("Broken contracts")[-1]
    else:
        assert broken in r.stdout


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
