"""The layering the README and docs/architecture.md describe, checked on the code itself."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from orchestrator.config import markdown_table

ROOT = Path(__file__).resolve().parent.parent
TORCH_SIDE = {"specdec.sampling", "specdec.worker_core", "specdec.models", "specdec.worker_server",
              "specdec.calibration", "specdec.linear_path"}


def modules(package: str) -> list[Path]:
    return [p for p in (ROOT / package).rglob("*.py") if "/v1/" not in str(p)]


def imports_of(path: Path) -> set[str]:
    """Every module name an import statement in the file names (top-level or inside functions)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def offenders(package: str, forbidden: tuple[str, ...], skip: tuple[str, ...] = ()) -> list[str]:
    bad = []
    for path in modules(package):
        rel = str(path.relative_to(ROOT))
        if rel.startswith(skip):
            continue
        hits = [n for n in imports_of(path) if n in forbidden or n.startswith(tuple(f + "." for f in forbidden))]
        bad += [f"{rel} imports {n}" for n in sorted(hits)]
    return bad


def test_importing_the_orchestrator_loads_no_torch_or_transformers() -> None:
    code = ("import sys, orchestrator.app, orchestrator.__main__; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_orchestrator_imports_no_model_side_module() -> None:
    assert offenders("orchestrator", ("torch", "transformers", "draft_worker", "target_worker", *TORCH_SIDE)) == []


def test_core_modules_never_import_upper_layers() -> None:
    assert offenders("specdec", ("orchestrator", "draft_worker", "target_worker", "specdec.tools"),
                     skip=("specdec/tools/", "specdec/cli.py")) == []


def test_workers_never_import_the_orchestrator() -> None:
    assert offenders("draft_worker", ("orchestrator",)) == []
    assert offenders("target_worker", ("orchestrator",)) == []


def test_long_modules_say_why() -> None:
    for package in ("specdec", "orchestrator", "draft_worker", "target_worker"):
        for path in modules(package):
            text = path.read_text()
            if text.count("\n") > 300:
                assert "Over 300 lines:" in (ast.get_docstring(ast.parse(text)) or ""), path


def test_speculation_table_in_the_docs_is_generated_from_the_config() -> None:
    doc = (ROOT / "docs" / "adaptive-k.md").read_text()
    table = doc.split("<!-- speculation-table:start -->\n", 1)[1].split("<!-- speculation-table:end -->", 1)[0]
    assert table == markdown_table()


async def test_the_orchestrator_serves_with_torch_and_transformers_blocked(tmp_path: Path) -> None:
    """The orchestrator process runs a real generation with torch and transformers made unimportable."""
    import asyncio

    from tests.procs import spawn, stop
    from tests.stack import start_worker
    draft, draft_servicer = await start_worker("draft", "tiny:seed=0,noise=0.04")
    target, target_servicer = await start_worker("target", "tiny:seed=0")
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text("import sys\nsys.modules['torch'] = None\nsys.modules['transformers'] = None\n")
    import os
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env_path}" if env_path else str(tmp_path)
    try:
        proc, port = await asyncio.to_thread(spawn, "orchestrator", [
            "--draft", f"127.0.0.1:{draft.port}", "--target", f"127.0.0.1:{target.port}",
            "--tokenizer", "tiny:seed=0"], tmp_path)
    finally:
        os.environ["PYTHONPATH"] = env_path
        if not env_path:
            del os.environ["PYTHONPATH"]
    try:
        import grpc

        from specdec.v1 import orchestrator_pb2_grpc
        from tests.stack import request
        from tests.test_e2e_generate import reference_greedy
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = await orchestrator_pb2_grpc.OrchestratorStub(channel).Generate(
                request(prompt_ids=[1, 2, 3], max_new_tokens=12, speculation={"fixed_k": 3}), timeout=60)
        assert list(reply.token_ids) == reference_greedy([1, 2, 3], 12)
        assert reply.stats.draft_tokens > 0
    finally:
        stop(proc)
        for handle, servicer in ((draft, draft_servicer), (target, target_servicer)):
            await handle.stop(0)
            servicer.close()
