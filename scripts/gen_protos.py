"""Regenerate Python code from protos/ into specdec/v1/ (run: python scripts/gen_protos.py)."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def generate(out_dir: Path = ROOT) -> None:
    from grpc_tools import protoc
    import grpc_tools

    proto_root = ROOT / "protos"
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    protos = sorted(str(p.relative_to(proto_root)) for p in (proto_root / "specdec" / "v1").glob("*.proto"))
    # Generated files of a removed or renamed .proto would stay importable: start from none.
    for stale in (out_dir / "specdec" / "v1").glob("*_pb2*.py*"):
        stale.unlink()
    args = ["protoc", f"-I{proto_root}", f"-I{well_known}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    (out_dir / "specdec" / "v1" / "__init__.py").touch()


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
