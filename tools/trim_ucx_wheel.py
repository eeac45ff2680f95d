"""Trim the UCX wheel the GPU machine gets, so that the tree plus ``.whl/`` fits the device tool's 64 MiB.

    ../shared/device/fetch-wheels.sh all && python tools/trim_ucx_wheel.py [.whl]

Static libraries, UCX's perftest plug-ins and C headers, which nothing of pdserve loads, are dropped with
their RECORD lines, so pip installs the rest unchanged; a wheel trimmed before is left as it is.
"""

from __future__ import annotations

import os
import sys
import zipfile
from pathlib import Path


def _dropped(name: str) -> bool:
    return name.endswith(".a") or "perftest" in name or "/include/" in name


def trim(wheel: Path) -> int:
    """Rewrite ``wheel`` without the files nothing loads; the bytes saved (0: nothing to drop)."""
    with zipfile.ZipFile(wheel) as src:
        infos = src.infolist()
        if not any(_dropped(i.filename) for i in infos):
            return 0
        before = wheel.stat().st_size
        tmp = wheel.with_suffix(".tmp")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
            for info in infos:
                if _dropped(info.filename):
                    continue
                data = src.read(info)
                if info.filename.endswith(".dist-info/RECORD"):
                    rows = [r for r in data.decode().splitlines() if not _dropped(r.split(",", 1)[0])]
                    data = ("\n".join(rows) + "\n").encode()
                out.writestr(info, data)
    os.replace(tmp, wheel)
    return before - wheel.stat().st_size


def main(argv: list[str]) -> int:
    folder = Path(argv[0] if argv else ".whl")
    wheels = sorted(folder.glob("libucx_cu*.whl"))
    if not wheels:
        print(
            f"no libucx wheel in {folder}/ (run ../shared/device/fetch-wheels.sh all first)", file=sys.stderr
        )
        return 1
    for wheel in wheels:
        saved = trim(wheel)
        print(f"{wheel.name}: {'trimmed by %.1f MB' % (saved / 1e6) if saved else 'already trimmed'}")
    total = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    print(f"{folder}/: {total / 2**20:.1f} MiB in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
