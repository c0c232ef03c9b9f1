"""Every kustomize overlay renders and passes `kubernetes-validate --strict`, offline."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
OVERLAYS = sorted(p.name for p in (ROOT / "k8s" / "overlays").iterdir() if p.is_dir())


def render(overlay: str) -> str:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is required to validate k8s/ (it is on the CI machine)"
    return subprocess.run([kubectl, "kustomize", str(ROOT / "k8s" / "overlays" / overlay)], check=True,
                          capture_output=True, text=True, timeout=60).stdout


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_strict(overlay: str, tmp_path: Path) -> None:
    rendered = tmp_path / f"{overlay}.yaml"
    rendered.write_text(render(overlay))
    validator = Path(sys.executable).parent / "kubernetes-validate"
    result = subprocess.run([str(validator), "--strict", "--quiet", str(rendered)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_has_probes_security_and_budgets(overlay: str) -> None:
    docs = [d for d in yaml.safe_load_all(render(overlay)) if d]
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for role in ("target", "draft", "orchestrator"):
        assert ("PodDisruptionBudget", f"specdec-{role}") in kinds
        assert ("HorizontalPodAutoscaler", f"specdec-{role}") in kinds
    assert ("Service", "specdec-target-headless") in kinds and ("Service", "specdec-draft-headless") in kinds
    assert ("ConfigMap", "specdec-config") in kinds
    for dep in (d for d in docs if d["kind"] == "Deployment"):
        pod = dep["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for container in pod["containers"]:
            assert "grpc" in container["readinessProbe"] and "grpc" in container["livenessProbe"]
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            assert "memory" in container["resources"]["limits"]
    if overlay == "gpu":
        by_name = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
        target = by_name["specdec-target"]["spec"]["template"]["spec"]
        draft = by_name["specdec-draft"]["spec"]["template"]["spec"]
        assert target["nodeSelector"] != draft["nodeSelector"]  # separate GPU pools
        assert target["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
