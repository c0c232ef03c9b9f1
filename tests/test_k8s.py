"""The k8s manifests: every overlay renders and passes `kubernetes-validate --strict`, offline; every
container's args parse with the real `specdec` CLI; every speculation TOML passes `SpeculationConfig`;
the orchestrator's `dns:///` addresses name a headless Service and the port its worker serves on;
probes (startup probes included), security context, budgets; the config ConfigMap is generated with a
hash suffix, so an edit rolls the orchestrators.

The args, TOML and wiring checks also run on the raw files (base resources, overlay patches, the
generators' TOML files) and need no kubectl. Rendering an overlay needs `kubectl` (or `kustomize`):
without it those tests fail, with a message saying so, rather than skip."""
from __future__ import annotations

import argparse
import contextlib
import functools
import io
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable
from unittest import mock

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
BASE = K8S / "base"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
ROLES = {"serve-orchestrator": "orchestrator", "serve-draft": "draft", "serve-target": "target"}
CONFIG = "specdec-config"


# ----------------------------------------------------------------------------- rendering

def kustomize_command() -> list[str]:
    kubectl = shutil.which("kubectl")
    if kubectl:
        return [kubectl, "kustomize"]
    kustomize = shutil.which("kustomize")
    if kustomize:
        return [kustomize, "build"]
    pytest.fail("rendering the k8s/ overlays needs `kubectl` (kubectl kustomize) or `kustomize` on PATH, and "
                "neither is there (the CI machine has kubectl; docs/python-versions.md). The checks on the raw "
                "files (test_raw_*) do not need it.", pytrace=False)


def render_dir(path: Path) -> str:
    result = subprocess.run([*kustomize_command(), str(path)], capture_output=True, text=True, timeout=60)
    if result.returncode:
        pytest.fail(f"kustomize could not render {path}:\n{result.stderr}", pytrace=False)
    return result.stdout


@functools.lru_cache(maxsize=None)
def render(overlay: str) -> str:
    return render_dir(K8S / "overlays" / overlay)


def rendered_docs(overlay: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(render(overlay)) if d]


# ----------------------------------------------------------------------------- raw files

def load_yaml(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def kustomization(directory: Path) -> dict[str, Any]:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())


def raw_base_docs() -> list[dict[str, Any]]:
    return [d for name in kustomization(BASE)["resources"] for d in load_yaml(BASE / name)]


def raw_manifests() -> list[tuple[Path, dict[str, Any]]]:
    """Every object or patch in a YAML file under k8s/ (kustomization files aside)."""
    return [(path, d) for path in sorted(K8S.rglob("*.yaml")) if path.name != "kustomization.yaml"
            for d in load_yaml(path)]


def generated_configs(directory: Path) -> dict[str, dict[str, str]]:
    """The configMapGenerator entries of one kustomization: name -> {key: file content}."""
    out: dict[str, dict[str, str]] = {}
    for gen in kustomization(directory).get("configMapGenerator", []):
        data = out.setdefault(gen["name"], {})
        for entry in gen.get("files", []):
            key, _, rel = entry.rpartition("=")
            data[key or Path(rel).name] = (directory / rel).read_text()
    return out


def speculation_tomls() -> list[tuple[str, str]]:
    """(where, text) of every speculation TOML in k8s/: generator files and any ConfigMap's .toml keys."""
    found = [(f"{d.relative_to(ROOT)}: configMapGenerator {name}/{key}", text)
             for d in sorted({p.parent for p in K8S.rglob("kustomization.yaml")})
             for name, data in generated_configs(d).items() for key, text in data.items() if key.endswith(".toml")]
    found += [(f"{path.relative_to(ROOT)}: ConfigMap {d['metadata']['name']}/{key}", text)
              for path, d in raw_manifests() if d.get("kind") == "ConfigMap"
              for key, text in (d.get("data") or {}).items() if key.endswith(".toml")]
    return found


# ----------------------------------------------------------------------------- the real CLI

class _Parsed(Exception):
    pass


def parse_cli(argv: list[str]) -> tuple[str, argparse.Namespace]:
    """Parse a container's args with the `specdec` command's own dispatch and parsers
    (specdec.cli.main -> the role's main -> its ArgumentParser); stops before anything is served."""
    from specdec import cli
    original = argparse.ArgumentParser.parse_args

    def capture(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> argparse.Namespace:
        raise _Parsed(self.prog, original(self, args, namespace))
    out = io.StringIO()
    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture), contextlib.redirect_stderr(out), \
            contextlib.redirect_stdout(out):
        try:
            cli.main(list(argv))
        except _Parsed as parsed:
            prog, namespace = parsed.args
            return prog, namespace
        except SystemExit:
            pass
    pytest.fail(f"`specdec {' '.join(argv)}` does not parse:\n{out.getvalue()}", pytrace=False)


def parse_container(container: dict[str, Any], where: str) -> tuple[str, argparse.Namespace]:
    args = [str(a) for a in container.get("args", [])]
    assert args and args[0] in ROLES, f"{where}: container {container['name']} args {args[:1]} name no server role"
    prog, namespace = parse_cli(args)
    assert prog == f"specdec {args[0]}", f"{where}: parsed by {prog!r}"
    return args[0], namespace


def orchestrator_config(namespace: argparse.Namespace, toml_text: str, tmp_path: Path) -> Any:
    """The orchestrator's startup config from its parsed flags and this TOML as --config
    (SpeculationConfig.from_toml and its validate(), then the flags over it)."""
    from orchestrator.app import config_from_args
    path = tmp_path / "speculation.toml"
    path.write_text(toml_text)
    return config_from_args(argparse.Namespace(**{**vars(namespace), "config": str(path)}))


# ----------------------------------------------------------------------------- wiring

def startup_budget_s(container: dict[str, Any]) -> float:
    probe = container["startupProbe"]
    return probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)


def check_wiring(docs: list[dict[str, Any]], config_data: Callable[[str], dict[str, str]], tmp_path: Path) -> None:
    """Each role's Deployment, its args (real CLI), ports and probes, the orchestrator's --config (its
    ConfigMap volume, the TOML validated) and its --draft/--target (a headless Service whose port leads
    to the worker's --port)."""
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    roles: dict[str, tuple[dict[str, Any], dict[str, Any], argparse.Namespace]] = {}
    for dep in (d for d in docs if d["kind"] == "Deployment"):
        name = dep["metadata"]["name"]
        for container in dep["spec"]["template"]["spec"]["containers"]:
            command, ns = parse_container(container, name)
            assert ROLES[command] not in roles, f"two {ROLES[command]} containers"
            roles[ROLES[command]] = (dep, container, ns)
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            assert ports.get("grpc") == ns.port and ns.host == "0.0.0.0", (name, ports, ns.port, ns.host)
            assert ports.get("metrics") == ns.metrics_port, (name, ports, ns.metrics_port)
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                assert container[probe]["grpc"]["port"] == ns.port, (name, probe)
    assert set(roles) == {"orchestrator", "draft", "target"}, sorted(roles)

    dep, container, ns = roles["orchestrator"]
    pod = dep["spec"]["template"]["spec"]
    assert ns.config, "the orchestrator gets no --config"
    config_path = Path(ns.config)
    mounts = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == config_path.parent]
    assert mounts, f"--config {ns.config}: no volume mounted at {config_path.parent}"
    volume = next(v for v in pod["volumes"] if v["name"] == mounts[0]["name"])
    data = config_data(volume["configMap"]["name"])
    assert config_path.name in data, f"ConfigMap {volume['configMap']['name']} has no key {config_path.name}"
    cfg = orchestrator_config(ns, data[config_path.name], tmp_path)
    for role in ("draft", "target"):  # each worker calibrates up to the k the orchestrator may ask for
        assert cfg.speculation.max_k <= roles[role][2].max_k, (role, cfg.speculation.max_k, roles[role][2].max_k)
    # Port 50051 opens once both workers answer: the orchestrator outwaits the workers' startup, and
    # its own startup probe outwaits that (its timeout, with a log line, comes before the kubelet's kill).
    worker_startup = max(startup_budget_s(roles[r][1]) for r in ("draft", "target"))
    assert worker_startup <= ns.connect_timeout_s < startup_budget_s(container), (
        worker_startup, ns.connect_timeout_s, startup_budget_s(container))

    def selects(service: dict[str, Any], role: str) -> bool:
        labels = roles[role][0]["spec"]["template"]["metadata"]["labels"]
        selector = service["spec"].get("selector") or {}
        return bool(selector) and all(labels.get(k) == v for k, v in selector.items())

    def service_port_to(service: dict[str, Any], port: int, role: str) -> int:
        """The port of `role`'s container that `service`:`port` reaches; the Service selects `role`'s pods only."""
        worker = roles[role][1]
        selected = [r for r in roles if selects(service, r)]
        assert selected == [role], f"Service {service['metadata']['name']} selects {selected}, not [{role!r}]"
        entry = next((p for p in service["spec"]["ports"] if p["port"] == port), None)
        assert entry, f"Service {service['metadata']['name']} has no port {port}"
        target = entry.get("targetPort", port)
        if isinstance(target, str):
            named = {p["name"]: p["containerPort"] for p in worker["ports"]}
            assert target in named, f"targetPort {target!r} is no named port of {role}"
            return named[target]
        return int(target)

    for role, address in (("draft", ns.draft), ("target", ns.target)):
        match = re.fullmatch(r"dns:///([a-z0-9.-]+):(\d+)", address)
        assert match, f"--{role} {address}: not dns:///SERVICE:PORT"
        service = services.get(match[1])
        assert service, f"--{role} {address}: no Service {match[1]}"
        assert service["spec"].get("clusterIP") == "None", f"Service {match[1]} is not headless"
        assert service_port_to(service, int(match[2]), role) == roles[role][2].port, (role, address)
    public = [s for s in services.values() if s["spec"].get("clusterIP") != "None" and selects(s, "orchestrator")]
    assert any(service_port_to(s, p["port"], "orchestrator") == ns.port for s in public for p in s["spec"]["ports"]), \
        "no Service reaches the orchestrator's --port"


# ----------------------------------------------------------------------------- raw-file tests (no kubectl)

def test_raw_container_args_parse_with_the_cli() -> None:
    """Base resources and overlay patches alike: args of every container parse, ports agree."""
    checked = 0
    for path, doc in raw_manifests():
        if doc.get("kind") != "Deployment":
            continue
        for container in doc["spec"]["template"]["spec"].get("containers", []):
            if "args" not in container:
                continue
            _, ns = parse_container(container, str(path.relative_to(ROOT)))
            named = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
            assert named.get("grpc", ns.port) == ns.port, (path, named, ns.port)
            checked += 1
    assert checked >= 5  # base: three roles; gpu overlay: both workers' args


def test_raw_speculation_tomls_validate(tmp_path: Path) -> None:
    from orchestrator.config import SpeculationConfig
    tomls = speculation_tomls()
    assert len(tomls) >= 2, tomls  # base and the gpu overlay
    for where, text in tomls:
        path = tmp_path / "speculation.toml"
        path.write_text(text)
        try:
            SpeculationConfig.from_toml(str(path))
        except ValueError as exc:
            pytest.fail(f"{where}: {exc}", pytrace=False)


def test_raw_base_is_wired(tmp_path: Path) -> None:
    """The base's own files: roles, args, ports, probes, --config and its generated ConfigMap, DNS names."""
    docs = raw_base_docs()
    assert not [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == CONFIG], \
        f"{CONFIG} must come from the configMapGenerator (a hash-suffixed name rolls the orchestrators)"
    configs = generated_configs(BASE)
    assert CONFIG in configs
    check_wiring(docs, lambda name: configs[name], tmp_path)


def test_rendering_without_kubectl_fails_with_a_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(pytest.fail.Exception, match="needs `kubectl`"):
        kustomize_command()


# ----------------------------------------------------------------------------- rendered overlays

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
    docs = rendered_docs(overlay)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for role in ("target", "draft", "orchestrator"):
        assert ("PodDisruptionBudget", f"specdec-{role}") in kinds
        assert ("HorizontalPodAutoscaler", f"specdec-{role}") in kinds
    assert ("Service", "specdec-target-headless") in kinds and ("Service", "specdec-draft-headless") in kinds
    configs = [name for kind, name in kinds if kind == "ConfigMap"]
    assert len(configs) == 1 and re.fullmatch(CONFIG + r"-[a-z0-9]{10}", configs[0]), configs  # hash-suffixed
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    assert len(deployments) == 3
    for dep in deployments:
        pod = dep["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for container in pod["containers"]:
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                assert "grpc" in container.get(probe, {}), (dep["metadata"]["name"], probe)
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            assert "memory" in container["resources"]["limits"]
    if overlay == "gpu":
        by_name = {d["metadata"]["name"]: d for d in deployments}
        target = by_name["specdec-target"]["spec"]["template"]["spec"]
        draft = by_name["specdec-draft"]["spec"]["template"]["spec"]
        assert target["nodeSelector"] != draft["nodeSelector"]  # separate GPU pools
        assert target["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_is_wired(overlay: str, tmp_path: Path) -> None:
    docs = rendered_docs(overlay)
    configs = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    check_wiring(docs, lambda name: configs[name], tmp_path)


def test_cpu_demo_fits_a_small_kind_node() -> None:
    """What its kustomization.yaml claims: the pods' requests fit 4 CPUs (less about one for kind's
    control plane) and 16 Gi (less about 2 for the system), with every memory limit at least its request."""
    def cpu(value: str) -> float:
        return float(value[:-1]) / 1000 if value.endswith("m") else float(value)

    def gib(value: str) -> float:
        units = {"Mi": 1 / 1024, "Gi": 1.0}
        return float(value[:-2]) * units[value[-2:]]
    total_cpu = total_mem = 0.0
    for dep in (d for d in rendered_docs("cpu-demo") if d["kind"] == "Deployment"):
        for container in dep["spec"]["template"]["spec"]["containers"]:
            requests, limits = container["resources"]["requests"], container["resources"]["limits"]
            total_cpu += cpu(str(requests["cpu"])) * dep["spec"]["replicas"]
            total_mem += gib(requests["memory"]) * dep["spec"]["replicas"]
            assert gib(limits["memory"]) >= gib(requests["memory"])
    assert total_cpu <= 3.0 and total_mem <= 14.0, (total_cpu, total_mem)


def test_a_config_edit_renames_the_configmap_and_so_rolls_the_orchestrators(tmp_path: Path) -> None:
    """`kubectl apply -k` after an edit of a speculation.toml changes the orchestrator's pod template
    (its config volume names the new ConfigMap), so the orchestrators restart and read it."""
    def config_volume(tree: Path, overlay: str) -> tuple[str, str]:
        docs = [d for d in yaml.safe_load_all(render_dir(tree / "overlays" / overlay)) if d]
        dep = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "specdec-orchestrator")
        (name,) = [v["configMap"]["name"] for v in dep["spec"]["template"]["spec"]["volumes"] if "configMap" in v]
        (data,) = [d["data"] for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == name]
        return name, data["speculation.toml"]
    tree = tmp_path / "k8s"
    shutil.copytree(K8S, tree)
    before = {overlay: config_volume(tree, overlay) for overlay in OVERLAYS}
    for toml in tree.rglob("speculation.toml"):  # the base's and any overlay's own
        toml.write_text(toml.read_text().replace("fixed_k = 4", "fixed_k = 3"))
    for overlay in OVERLAYS:
        name, text = config_volume(tree, overlay)
        assert name != before[overlay][0] and "fixed_k = 3" in text, (overlay, name, before[overlay][0])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_leave_the_ring_before_they_refuse_calls_and_exit_within_their_grace(overlay: str) -> None:
    """A terminating worker keeps serving for --drain-delay-s while the orchestrators' DNS refresh
    (--discovery-refresh-s) and the DNS TTL (5 s, CoreDNS's default) take it out of the ring: at 5 s
    it refused calls the orchestrators still sent it. And every pod's drain (delay + --grace-s, plus
    the orchestrator's settle of up to 5 s) ends before the kubelet's SIGKILL."""
    docs = rendered_docs(overlay)
    parsed = {}
    for dep in (d for d in docs if d["kind"] == "Deployment"):
        container = dep["spec"]["template"]["spec"]["containers"][0]
        role, ns = parse_container(container, dep["metadata"]["name"])
        parsed[ROLES[role]] = (dep, ns)
    refresh = parsed["orchestrator"][1].discovery_refresh_s
    for role, (dep, ns) in parsed.items():
        if role != "orchestrator":
            assert ns.drain_delay_s >= refresh + 5 + 2, (role, ns.drain_delay_s, refresh)
        settle = 5 if role == "orchestrator" else 0
        grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= ns.drain_delay_s + ns.grace_s + settle + 2, (role, grace)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_drain_never_takes_the_only_target(overlay: str) -> None:
    """The service cannot run without a target (a lost draft costs speed only): production keeps two,
    its PDB at least one. The one-node demo keeps one, which a drain may take."""
    docs = {(d["kind"], d["metadata"]["name"]): d for d in rendered_docs(overlay)}
    replicas = docs[("Deployment", "specdec-target")]["spec"]["replicas"]
    hpa = docs[("HorizontalPodAutoscaler", "specdec-target")]["spec"]
    pdb = docs[("PodDisruptionBudget", "specdec-target")]["spec"]
    if overlay == "cpu-demo":
        assert replicas == hpa["minReplicas"] == 1 and pdb == {**pdb, "maxUnavailable": 1}
    else:
        assert replicas >= 2 and hpa["minReplicas"] >= 2 and pdb.get("minAvailable") == 1


def test_gpu_workers_scale_on_a_metric_the_workers_export() -> None:
    """On a GPU the model thread keeps about one core busy at any load: a CPU-utilisation HPA never
    scaled the target. The gpu overlay's worker HPAs read the model's busy fraction, a gauge each
    worker exports (a rename there must rename it here)."""
    metrics_source = (ROOT / "specdec" / "metrics.py").read_text()
    for doc in rendered_docs("gpu"):
        if doc["kind"] != "HorizontalPodAutoscaler" or doc["metadata"]["name"] == "specdec-orchestrator":
            continue
        (metric,) = doc["spec"]["metrics"]
        assert metric["type"] == "Pods", doc["metadata"]["name"]
        name = metric["pods"]["metric"]["name"]
        assert f'("{name}",' in metrics_source, name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_run_as_many_torch_threads_as_they_request_cpus(overlay: str) -> None:
    """Unset, torch takes every core of the node: replicas on one node contend, and a CPU-based HPA
    measures the node's size rather than the load. An env var, so overlays that replace the args keep it."""
    import math
    for dep in (d for d in rendered_docs(overlay) if d["kind"] == "Deployment"):
        container = dep["spec"]["template"]["spec"]["containers"][0]
        if dep["metadata"]["name"] == "specdec-orchestrator":
            continue
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        cpu = str(container["resources"]["requests"]["cpu"])
        cpus = float(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)
        assert 1 <= int(env["SPECDEC_TORCH_THREADS"]) <= math.ceil(cpus), (dep["metadata"]["name"], env, cpu)
