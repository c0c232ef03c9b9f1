"""The committed generated code matches protos/ (regenerate with `make protos`)."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))


def test_generated_code_is_in_sync(tmp_path: Path) -> None:
    import gen_protos
    gen_protos.generate(tmp_path)
    generated = sorted(p.relative_to(tmp_path) for p in (tmp_path / "specdec" / "v1").glob("*.py*"))
    assert generated, "protoc produced nothing"
    committed_set = sorted(p.relative_to(ROOT) for p in (ROOT / "specdec" / "v1").glob("*_pb2*.py*"))
    assert committed_set == [rel for rel in generated if "_pb2" in rel.name], \
        "generated files without a .proto: run `make protos`"
    for rel in generated:
        committed = ROOT / rel
        assert committed.exists(), f"{rel} is missing: run `make protos`"
        assert committed.read_text() == (tmp_path / rel).read_text(), f"{rel} is stale: run `make protos`"


def test_proto_conventions() -> None:
    from specdec.v1 import orchestrator_pb2
    assert orchestrator_pb2.DESCRIPTOR.package == "specdec.v1"
    assert orchestrator_pb2.FinishReason.Name(0) == "FINISH_REASON_UNSPECIFIED"
