"""Regenerate the committed *_pb2*.py modules from the .proto sources: ``python -m pdserve.proto.regen``.

The sources are compiled under the import path ``pdserve/proto/`` (``-Ipdserve/proto=proto``), so the
generated code imports ``pdserve.proto`` and the descriptors are named ``pdserve/proto/*.proto``.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path


def main() -> int:
    from grpc_tools import protoc

    here = Path(__file__).resolve().parent
    sources = sorted(f"pdserve/proto/{p.name}" for p in here.glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        args = [
            "protoc",
            f"-Ipdserve/proto={here}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
        ]
        rc = protoc.main([*args, *sources])
        if rc == 0:
            for f in sorted((out / "pdserve" / "proto").iterdir()):
                shutil.copyfile(f, here / f.name)
    return rc


if __name__ == "__main__":
    sys.exit(main())
