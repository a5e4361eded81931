"""Regenerate the Python code of every contract: `python proto/generate.py` (or `--check` to diff only).

Output sits next to the .proto files (proto/dgrpo/v1/*_pb2*.py), installed as `dgrpo.v1`, so the
generated `from dgrpo.v1 import ...` imports work without rewriting. grpcio-tools is pinned in
pyproject.toml so the output is reproducible; tests/test_protos.py fails when it is stale.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
PACKAGE = ROOT / "dgrpo" / "v1"


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc

    protos = sorted(PACKAGE.glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", *[str(p.relative_to(ROOT)) for p in protos]]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    return sorted((out / "dgrpo" / "v1").glob("*_pb2*.py*"))


def stale_files() -> list[str]:
    """Generated files that differ from a fresh generation (missing or extra ones included)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name: p for p in generate(Path(tmp))}
        current = {p.name: p for p in PACKAGE.glob("*_pb2*.py*")}
        names = set(fresh) | set(current)
        return sorted(n for n in names if n not in fresh or n not in current
                      or not filecmp.cmp(fresh[n], current[n], shallow=False))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed code is stale")
    args = parser.parse_args()
    if args.check:
        stale = stale_files()
        if stale:
            print("stale generated code: " + ", ".join(stale) + " (run python proto/generate.py)")
            return 1
        return 0
    for old in PACKAGE.glob("*_pb2*.py*"):
        old.unlink()
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            (PACKAGE / path.name).write_bytes(path.read_bytes())
            print(f"wrote {PACKAGE / path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
