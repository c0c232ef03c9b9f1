"""The images' build steps, run without a container engine (scripts/image_check.py, docs/images.md).

The fast tests check the build plan that scripts/image_check.py reads from the real Dockerfile. The
`slow` ones run that plan: a fresh venv per image (the worker one installs torch, ~1.2 GB), `specdec
--help`, each role started on 127.0.0.1 with a grpc health check, and for the orchestrator a torch-free
venv and one Generate against two tiny workers.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "scripts" / "image_check.py"
TARGETS = ("orchestrator", "worker", "worker-cuda", "worker-cpu")


def load_check():
    spec = importlib.util.spec_from_file_location("image_check", CHECK)
    module = importlib.util.module_from_spec(spec)
    sys.modules["image_check"] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


image_check = load_check()


def plan(target: str, *extra: str) -> dict:
    """What `image_check.py --target TARGET --plan ...` prints."""
    build_args = dict(kv.split("=", 1) for kv in extra[1::2] if "=" in kv) if extra and extra[0] == "--build-arg" else {}
    skip = "--skip-models" in extra
    if skip:
        build_args["EMBED_MODELS"] = "0"
    df = image_check.parse((ROOT / "Dockerfile").read_text(), build_args)
    return image_check.plan(df, target, build_args, skip)


def test_the_plan_command_line() -> None:
    out = subprocess.run([sys.executable, str(CHECK), "--target", "worker-cpu", "--plan", "--local-torch"],
                         check=True, capture_output=True, text=True, timeout=60).stdout
    p = json.loads(out)
    assert p["build_args"] == {"TORCH_INDEX_URL": "", "TORCH_CPU_INDEX_URL": ""}
    assert p["global_args"]["TORCH_CPU_INDEX_URL"] == ""  # pip's own configuration: the local CPU wheel here
    assert {k: p[k] for k in ("copies", "steps", "not_run")} == {k: plan("worker-cpu")[k] for k in ("copies", "steps", "not_run")}


def steps(p: dict) -> str:
    return "\n".join(step for chain in p["steps"].values() for step in chain)


@pytest.mark.parametrize("target", TARGETS)
def test_every_image_has_a_build_plan_on_python_slim(target: str) -> None:
    p = plan(target)
    assert p["base_image"] == "python:3.11-slim"
    assert any(c.startswith(f"--from={p['venv_from']} /opt/venv ") for c in p["copies"])
    p312 = plan(target, "--build-arg", "PYTHON_VERSION=3.12")  # the Python version is one build arg
    assert p312["base_image"] == "python:3.12-slim" and p312["global_args"]["PYTHON_VERSION"] == "3.12"


def test_the_orchestrator_venv_is_built_without_torch() -> None:
    p = plan("orchestrator", "--skip-models")
    venv_chain = steps({"steps": {p["venv_from"]: p["steps"][p["venv_from"]]}})
    assert "pip install ." in venv_chain and "gen_protos.py" in venv_chain
    assert "torch" not in venv_chain and "[worker]" not in venv_chain
    assert p["skipped_stages"] == ["models"]  # tokenizer files only; built with torch, never in this image
    full = plan("orchestrator")
    assert "specdec.embedded" in steps(full) and "/opt/specdec/models" in " ".join(full["copies"])


@pytest.mark.parametrize("target", ["worker-cuda", "worker-cpu"])
def test_both_worker_variants_pin_torch_and_carry_the_models(target: str) -> None:
    p = plan(target)
    venv_steps = "\n".join(p["steps"][next(o for o, c in p["build_chains"].items() if p["venv_from"] in c)])
    assert '"torch==2.13.0"' in venv_steps and '".[worker]"' in venv_steps and "gen_protos.py" in venv_steps
    assert venv_steps.index("torch==2.13.0") < venv_steps.index(".[worker]")  # pinned torch first
    assert "specdec.embedded" in steps(p) and "chmod -R a+rX /opt/specdec" in steps(p)
    assert any(c.endswith("/opt/specdec/models /opt/specdec/models") for c in p["copies"])
    cpu = "TORCH_CPU_INDEX_URL" in venv_steps
    assert cpu == (target == "worker-cpu")


def test_worker_is_the_cuda_image() -> None:
    assert plan("worker")["copies"] == plan("worker-cuda")["copies"]


def run_check(tmp_path: Path, *args: str) -> dict:
    report = tmp_path / "report.json"
    cmd = [sys.executable, str(CHECK), *args, "--report", str(report),
           "--pip-cache", os.path.expanduser("~/.cache/pip"), "--workdir", str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    data = json.loads(report.read_text())
    assert data["ok"]
    print(f"\n{args[1]}: {data['seconds']}s, venv {data['sizes']['venv_bytes'] / 1e6:.0f} MB")
    return data


@pytest.mark.slow
def test_orchestrator_image_steps_build_and_serve(tmp_path: Path) -> None:
    data = run_check(tmp_path, "--target", "orchestrator", "--skip-models")
    assert data["torch"] is None
    assert data["sizes"]["venv_bytes"] < 600e6  # torch-free: a few hundred MB, not GBs


@pytest.mark.slow
def test_cpu_worker_image_steps_build_and_serve(tmp_path: Path) -> None:
    data = run_check(tmp_path, "--target", "worker-cpu", "--skip-models", "--local-torch")
    assert data["torch"].startswith("2.13.0")
