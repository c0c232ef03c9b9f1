"""Static checks of the Dockerfile (no Docker engine on this machine; .ci/run exercises the same
install steps: pinned torch, `pip install .`, proto generation, the `specdec` entry point)."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "")
            for line in (l.strip() for l in text.splitlines()) if line and not line.startswith("#")]


def test_copy_sources_exist_and_cover_the_packages() -> None:
    copied = set()
    for op, args in instructions():
        if op == "COPY" and "--from" not in args:
            for src in args.split()[:-1]:
                assert (ROOT / src).exists(), f"COPY source {src} missing"
                copied.add(src)
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    for pkg in {p.rstrip("*") for p in packages}:
        assert pkg in copied, f"package {pkg} is not copied into the image"
    assert "protos" in copied and "scripts" in copied  # proto generation runs in the build


def test_pins_and_runtime_settings() -> None:
    ops = instructions()
    runs = " ".join(args for op, args in ops if op == "RUN")
    assert '"torch==2.13.0"' in runs  # same pin as pyproject / setup, never an unpinned CUDA pull
    assert "scripts/gen_protos.py" in runs and "specdec.embedded" in runs
    users = [args for op, args in ops if op == "USER"]
    assert users and not users[-1].startswith("0") and "root" not in users[-1]
    assert ("ENTRYPOINT", '["specdec"]') in ops
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "specdec" in scripts
    stages = [args.split()[-1] for op, args in ops if op == "FROM"]
    assert {"orchestrator", "worker"} <= set(stages)  # two images, each from its own build stage
    k8s_user = re.search(r"runAsUser: (\d+)", (ROOT / "k8s" / "base" / "target.yaml").read_text()).group(1)
    assert all(u.split(":")[0] == k8s_user for u in users)  # the images' user is the one the manifests require


def stage(name: str) -> list[tuple[str, str]]:
    """The instructions of one build stage."""
    out, current = [], None
    for op, args in instructions():
        if op == "FROM":
            current = args.split()[-1]
        elif current == name:
            out.append((op, args))
    return out


def test_the_orchestrator_image_is_built_without_torch() -> None:
    runs = " ".join(args for op, args in stage("orchestrator-build") if op == "RUN")
    assert "torch" not in runs and "pip install ." in runs and "[worker]" not in runs
    assert all("worker-build" not in args for op, args in stage("orchestrator") if op == "COPY")
    base = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in base if d.startswith(("torch", "accelerate", "gguf"))], base
    assert "torch==2.13.0" in " ".join(args for op, args in stage("worker-build") if op == "RUN")
