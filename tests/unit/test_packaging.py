"""What the wheel holds, as setuptools' own build_py lists it from pyproject.toml: no benchmark, development
tool or C source embedded in Python, and of pdserve.bench only what `pdserve bench` runs."""

from __future__ import annotations

import ast
import os
import re
import warnings
from pathlib import Path

import grimp
import pytest
from setuptools.config.pyprojecttoml import apply_configuration
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parents[2]

# Moved out of pdserve.bench: the reproducible benchmarks (benchmarks/) and the development tools (tools/).
NOT_INSTALLED_BENCH = {
    "engine",
    "engine_steps",
    "engine_cuda",
    "engine_cuda_report",
    "hf_baselines",
    "kv_transfer",
    "serving",
    "scale_up",
    "vllm_cpu",
    "tool_compare",
}
DEV_TOOLS = {"trim_ucx_wheel", "gpu_checks", "gpu_cluster", "gpu_micro", "gpu_profile", "cma_direction"}
DEV_TOOLS |= {"kv_shared_steps"}
C_INCLUDE = re.compile(r"^\s*#\s*include\s*[<\"]", re.MULTILINE)


@pytest.fixture(scope="module")
def wheel_files() -> dict[str, Path]:
    """Each file's path in the wheel -> its source in the checkout (build_py's modules and package data)."""
    cwd = Path.cwd()
    os.chdir(ROOT)  # build_py resolves package-dir and package-data globs against the working directory
    try:
        with warnings.catch_warnings():
            # setuptools' notices: deprecated pyproject fields, data folders that are not packages
            warnings.simplefilter("ignore")
            dist = Distribution({"script_name": "setup.py"})
            apply_configuration(dist, ROOT / "pyproject.toml")
            build_py = dist.get_command_obj("build_py")
            build_py.ensure_finalized()
            modules, data = build_py.find_all_modules(), build_py.data_files
    finally:
        os.chdir(cwd)
    files = {"/".join([*pkg.split("."), Path(src).name]): ROOT / src for pkg, _, src in modules}
    for pkg, src_dir, _, names in data:
        files.update({"/".join([*pkg.split("."), name]): ROOT / src_dir / name for name in names})
    assert files, "build_py found nothing to install"
    return files


def test_only_pdserve_packages_are_installed(wheel_files: dict[str, Path]) -> None:
    assert {name.split("/")[0] for name in wheel_files} == {"pdserve"}
    sources = {path.relative_to(ROOT).parts[0] for path in wheel_files.values()}
    assert not sources & {"benchmarks", "tools", "tests", "docs", "build"}, sources
    assert not any("/results/" in name for name in wheel_files)


def test_no_benchmark_or_development_tool_ships(wheel_files: dict[str, Path]) -> None:
    stems = {name: Path(name).stem for name in wheel_files}
    bench = {stem for name, stem in stems.items() if name.startswith("pdserve/bench/")}
    assert not bench & NOT_INSTALLED_BENCH, "a benchmark is back in pdserve.bench: it belongs in benchmarks/"
    assert not set(stems.values()) & DEV_TOOLS, "development tooling belongs in tools/"
    assert not any(name.endswith(".sh") and "/deploy/" not in name for name in wheel_files)


def test_pdserve_bench_holds_only_what_the_cli_runs() -> None:
    """Every module of pdserve.bench is imported, directly or not, by the `pdserve` command."""
    graph = grimp.build_graph("pdserve.cli", "pdserve.bench", "pdserve.deploy", cache_dir=None)
    unused = [
        module
        for module in sorted(graph.find_children("pdserve.bench"))
        if not any(m.startswith("pdserve.cli") for m in graph.find_downstream_modules(module))
    ]
    assert not unused, f"not used by `pdserve bench` (a benchmark? move it to benchmarks/): {unused}"


def _imported_roots(tree: ast.AST) -> set[str]:
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_installed_modules_hold_no_c_source_and_import_no_checkout_folders(
    wheel_files: dict[str, Path],
) -> None:
    """C source lives in .c/.h files (package data), not in Python strings; benchmarks/ and tools/ are
    not installed, so nothing that is may import them."""
    for name, source in wheel_files.items():
        if not name.endswith(".py"):
            continue
        tree = ast.parse(source.read_text(), filename=str(source))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.count("\n") > 2:
                assert not C_INCLUDE.search(node.value), f"{name}:{node.lineno} holds C source in a string"
        bad = _imported_roots(tree) & {"benchmarks", "tools", "tests"}
        assert not bad, f"{name} imports {bad}, which the wheel does not hold"
