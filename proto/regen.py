"""Regenerate the committed *_pb2*.py modules from the .proto sources."""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> int:
    from grpc_tools import protoc

    root = Path(__file__).resolve().parent.parent
    sources = sorted(str(p.relative_to(root)) for p in (root / "proto").glob("*.proto"))
    args = ["protoc", f"-I{root}", f"--python_out={root}", f"--pyi_out={root}", f"--grpc_python_out={root}"]
    return protoc.main([*args, *sources])


if __name__ == "__main__":
    sys.exit(main())
