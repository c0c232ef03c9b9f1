"""Run the Dockerfile's build steps for one image target in a fresh venv, then smoke-test the result.

No container engine is needed: the Dockerfile itself is parsed (so this follows the real file), and for
the chosen target (`orchestrator`, `worker` = `worker-cuda`, `worker-cpu`) the build stages it copies
from are executed on this machine:

* every build stage's `ARG`s (defaults, overridden by --build-arg), `ENV`s, `WORKDIR`, `COPY` (from a
  copy of the build context: tracked and untracked-but-not-ignored files, minus .dockerignore) and `RUN`
  steps, with `sh -c`, in a temporary root where `/opt/...` and `/src` are mapped below it;
* `python` in the base image `python:${PYTHON_VERSION}-slim` is this machine's `python${PYTHON_VERSION}`
  (or --python); the `RUN`s of the runtime stages (user creation) are listed, not run;
* the final stage's `COPY --from=...` are materialised into an image directory (the venv stays where it
  was built: venvs are not relocatable), and the roles run with the final stage's `ENV`.

Checks: `specdec --help`, the role subcommands' `--help`, each role started for real on 127.0.0.1 port 0
(`--port-file`) and answering grpc.health.v1 SERVING, a clean exit on SIGTERM. The orchestrator venv must
not have torch (`import torch` fails); it is started against two tiny random-weight workers run by
--worker-python (default: this interpreter) and serves one Generate. Sizes: `du` of the venv and of the
other image files (base image excluded).

  python scripts/image_check.py --target orchestrator --skip-models
  python scripts/image_check.py --target worker-cpu --skip-models --local-torch
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROLE_COMMANDS = {"orchestrator": ["serve-orchestrator"], "worker": ["serve-draft", "serve-target"]}
START_TIMEOUT_S = 180.0


# --------------------------------------------------------------------------------------------- parsing

@dataclass
class Instruction:
    op: str
    args: str
    line: int


@dataclass
class Stage:
    name: str
    base: str                        # after global-ARG substitution: a stage name or an external image
    instructions: list[Instruction] = field(default_factory=list)


@dataclass
class Dockerfile:
    global_args: dict[str, str | None]
    stages: dict[str, Stage]


def logical_lines(text: str) -> list[tuple[int, str]]:
    """Instructions with their continuation lines joined (comments and blank lines dropped)."""
    out, buf, start = [], "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):
            continue  # comment lines inside a continued instruction are removed by Docker too
        if not buf:
            start = number
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        out.append((start, buf))
        buf = ""
    if buf:
        out.append((start, buf))
    return out


def substitute(text: str, env: dict[str, str | None]) -> str:
    """$VAR / ${VAR} / ${VAR:-default} as Docker expands them in FROM, ENV, WORKDIR and COPY."""
    def repl(match: re.Match) -> str:
        name = match.group(1) or match.group(3)
        default = match.group(2)
        value = env.get(name)
        if value is None or (default is not None and value == ""):
            return default or ""
        return value
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)", repl, text)


def parse_kv(args: str) -> list[tuple[str, str | None]]:
    """`ARG A=1` / `ENV A=1 B="x y"` / legacy `ENV A value`."""
    words = shlex.split(args, posix=True)
    if len(words) >= 2 and "=" not in words[0]:
        return [(words[0], " ".join(words[1:]))]
    pairs: list[tuple[str, str | None]] = []
    for word in words:
        key, eq, value = word.partition("=")
        pairs.append((key, value if eq else None))
    return pairs


def parse(text: str, overrides: dict[str, str] | None = None) -> Dockerfile:
    """Stages and global ARGs; build-arg overrides apply to the global ARGs used in FROM."""
    overrides = overrides or {}
    global_args: dict[str, str | None] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for number, line in logical_lines(text):
        op, _, args = line.partition(" ")
        op, args = op.upper(), args.strip()
        if op == "FROM":
            words = args.split()
            words = [w for w in words if not w.startswith("--")]
            base = substitute(words[0], global_args)
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else f"stage{len(stages)}"
            current = stages[name] = Stage(name, base)
        elif current is None:
            if op == "ARG":
                global_args.update((k, overrides.get(k, v)) for k, v in parse_kv(args))
            # other instructions before FROM (parser directives are comments) are not allowed by Docker
        else:
            current.instructions.append(Instruction(op, args, number))
    return Dockerfile(global_args, stages)


def chain(df: Dockerfile, name: str) -> list[Stage]:
    """The stage and its FROM ancestors, base first."""
    out = []
    while name in df.stages:
        out.append(df.stages[name])
        name = df.stages[name].base
    return out[::-1]


def external_base(df: Dockerfile, name: str) -> str:
    return chain(df, name)[0].base


# --------------------------------------------------------------------------------------- build context

def dockerignore_patterns() -> list[str]:
    path = ROOT / ".dockerignore"
    if not path.exists():
        return []
    return [l.strip() for l in path.read_text().splitlines() if l.strip() and not l.startswith("#")]


def ignored(rel: str, patterns: list[str]) -> bool:
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.strip("/")
        parts = rel.split("/")
        hit = any(fnmatch.fnmatch("/".join(parts[:i]), pat) or fnmatch.fnmatch("/".join(parts[:i]), pat.replace("**/", ""))
                  or (pat.startswith("**/") and fnmatch.fnmatch(parts[i - 1], pat[3:]))
                  for i in range(1, len(parts) + 1))
        if hit:
            result = not negate
    return result


def make_context(dest: Path) -> int:
    """Copy what `docker build .` would send: the working tree's tracked and untracked, not git-ignored
    files (git-ignored ones are build outputs such as .venv), minus .dockerignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode().split("\0")
    patterns = dockerignore_patterns()
    count = 0
    for rel in filter(None, listed):
        src = ROOT / rel
        if not src.is_file() or ignored(rel, patterns):
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)
        count += 1
    return count


# --------------------------------------------------------------------------------------------- running

class Mapper:
    """Absolute image paths (/opt/..., /src/...) to paths below a temporary root."""

    PATTERN = re.compile(r"(?<![\w.:/-])/(opt|src)(?=/|\b|$)")

    def __init__(self, root: Path, venv_root: Path | None = None) -> None:
        self.root, self.venv_root = root, venv_root

    def __call__(self, text: str) -> str:
        def repl(match: re.Match) -> str:
            rest = text[match.end():]
            if self.venv_root is not None and match.group(1) == "opt" and re.match(r"/venv(?=/|\b|$)", rest):
                return f"{self.venv_root}/opt"
            return f"{self.root}/{match.group(1)}"
        return self.PATTERN.sub(repl, text)


@dataclass
class Log:
    steps: list[dict] = field(default_factory=list)

    def step(self, what: str, seconds: float, **extra) -> None:
        self.steps.append({"step": what, "seconds": round(seconds, 1), **extra})
        print(f"[{seconds:7.1f}s] {what}" + (f"  {extra}" if extra else ""), flush=True)


def base_env(shim: Path) -> dict[str, str]:
    # This machine's pip configuration (PIP_*, pip.conf) stays: it is where packages come from here.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "SPECDEC_", "CONDA"))}
    env["PATH"] = f"{shim}:{env.get('PATH', '/usr/bin:/bin')}"
    return env


def make_shim(dest: Path, python: str) -> Path:
    """`python`, `python3` and `pip` of the base image: this machine's interpreter."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("python", "python3"):
        (dest / name).symlink_to(python)
    return dest


def copy_into(src: Path, dst: Path, many: bool, dst_is_dir: bool) -> None:
    if src.is_dir():
        shutil.copytree(src, dst, dirs_exist_ok=True, symlinks=True)
    else:
        target = dst / src.name if (many or dst_is_dir) else dst
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


def run_chain(df: Dockerfile, stages: list[Stage], root: Path, context: Path, build_args: dict[str, str],
              shim: Path, log: Log, pip_cache: str | None = None) -> dict[str, str]:
    """Execute a build chain (base first) in root; returns the final environment."""
    mapper = Mapper(root)
    env = base_env(shim)
    workdir = root
    for stage in stages:
        scope: dict[str, str | None] = {}
        for ins in stage.instructions:
            t0 = time.monotonic()
            if ins.op == "ARG":
                for key, default in parse_kv(ins.args):
                    value = build_args.get(key, default if default is not None else df.global_args.get(key))
                    scope[key] = value if value is not None else ""
                    env[key] = mapper(scope[key])
            elif ins.op == "ENV":
                for key, value in parse_kv(ins.args):
                    env[key] = mapper(substitute(value or "", env))
            elif ins.op == "WORKDIR":
                workdir = Path(mapper(substitute(ins.args, env)))
                workdir.mkdir(parents=True, exist_ok=True)
            elif ins.op == "COPY":
                words = shlex.split(ins.args)
                if any(w.startswith("--from") for w in words):
                    raise SystemExit(f"line {ins.line}: COPY --from inside a build chain is not supported here")
                words = [w for w in words if not w.startswith("--")]
                *srcs, dst = words
                dst_path = Path(mapper(dst)) if dst.startswith("/") else workdir / dst
                for src in srcs:
                    copy_into(context / src, dst_path, len(srcs) > 1, dst.endswith("/"))
            elif ins.op == "RUN":
                command = mapper(ins.args)
                run_env = dict(env)
                if pip_cache:
                    run_env.pop("PIP_NO_CACHE_DIR", None)
                    run_env["PIP_CACHE_DIR"] = pip_cache
                result = subprocess.run(["sh", "-c", command], cwd=workdir, env=run_env, capture_output=True, text=True)
                log.step(f"{stage.name}: RUN {ins.args[:90]}", time.monotonic() - t0)
                if result.returncode != 0:
                    sys.stdout.write(result.stdout[-4000:] + result.stderr[-4000:])
                    raise SystemExit(f"{stage.name} (Dockerfile line {ins.line}) failed with {result.returncode}")
            # EXPOSE, LABEL, USER, ENTRYPOINT, CMD: nothing to build
    return env


def layout(df: Dockerfile, target: str, skip_models: bool):
    """The final stage chain's COPY --from sources, the stage that provides /opt/venv, which build chain
    runs each source (a chain that is a prefix of a longer one runs once, as part of it) and which
    sources --skip-models leaves out (those not built by the venv's chain: model and tokenizer files)."""
    copies = []
    for stage in chain(df, target):
        for ins in stage.instructions:
            if ins.op == "COPY" and "--from=" in ins.args:
                words = shlex.split(ins.args)
                source = next(w.split("=", 1)[1] for w in words if w.startswith("--from="))
                src, dst = [w for w in words if not w.startswith("--")]
                copies.append((source, src, dst))
    venv_stage = next((s for s, src, dst in copies if dst.rstrip("/") == "/opt/venv"), None)
    if venv_stage is None:
        raise SystemExit(f"{target}: no COPY --from=... /opt/venv in its stages")
    chains = {s: [st.name for st in chain(df, s)] for s, _, _ in copies}
    roots: dict[str, str] = {}
    for name, names in sorted(chains.items(), key=lambda kv: -len(kv[1])):
        owner = next((o for o, on in chains.items() if roots.get(o) == o and on[:len(names)] == names), None)
        roots[name] = owner or name
    skipped = {n for n, owner in roots.items() if owner != roots[venv_stage]} if skip_models else set()
    return copies, venv_stage, roots, skipped


def plan(df: Dockerfile, target: str, build_args: dict[str, str], skip_models: bool) -> dict:
    copies, venv_stage, roots, skipped = layout(df, target, skip_models)
    runs = {owner: [f"{st.name}: {i.op} {i.args}" for st in chain(df, owner) for i in st.instructions
                    if i.op in ("RUN", "ARG", "ENV")]
            for owner in sorted({roots[n] for n in roots if n not in skipped})}
    return {"target": target, "base_image": chain(df, target)[0].base, "venv_from": venv_stage,
            "build_args": build_args, "global_args": df.global_args,
            "copies": [f"--from={s} {src} {dst}" for s, src, dst in copies], "skipped_stages": sorted(skipped),
            "build_chains": {o: [st.name for st in chain(df, o)] for o in runs}, "steps": runs,
            "not_run": [f"{st.name}: RUN {i.args}" for st in chain(df, target) for i in st.instructions if i.op == "RUN"]}


class Proc:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], workdir: Path) -> None:
        self.name = name
        self.port_file = workdir / f"{name}.port"
        self.log_path = workdir / f"{name}.log"
        self.proc = subprocess.Popen([*argv, "--port", "0", "--port-file", str(self.port_file), "--log-level", "WARNING",
                                      "--grace-s", "2"],
                                     env=env, cwd=workdir, stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT)

    def wait_port(self, timeout_s: float = START_TIMEOUT_S) -> int:
        deadline = time.monotonic() + timeout_s
        while not self.port_file.exists():
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise SystemExit(f"{self.name} did not start in {timeout_s:.0f}s:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.1)
        return int(self.port_file.read_text())

    def terminate(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


HEALTH = """
import sys, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from specdec.v1 import orchestrator_pb2, worker_pb2
names = {"draft": worker_pb2.DESCRIPTOR.services_by_name["DraftWorker"].full_name,
         "target": worker_pb2.DESCRIPTOR.services_by_name["TargetWorker"].full_name,
         "orchestrator": orchestrator_pb2.DESCRIPTOR.services_by_name["Orchestrator"].full_name}
channel = grpc.insecure_channel(sys.argv[1])
grpc.channel_ready_future(channel).result(timeout=30)
stub = health_pb2_grpc.HealthStub(channel)
for service in ("", names[sys.argv[2]]):
    status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
    print(repr(service), health_pb2.HealthCheckResponse.ServingStatus.Name(status))
    assert status == health_pb2.HealthCheckResponse.SERVING, service
"""


def check(cmd: list[str], env: dict[str, str], cwd: Path, expect_ok: bool = True, timeout: float = 300) -> str:
    result = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if (result.returncode == 0) != expect_ok:
        raise SystemExit(f"{' '.join(cmd)}: exit {result.returncode}, expected {'0' if expect_ok else 'non-zero'}\n"
                         f"{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return result.stdout + result.stderr


def du_bytes(path: Path) -> int:
    if not path.exists():
        return 0
    return int(subprocess.run(["du", "-sb", str(path)], check=True, capture_output=True, text=True).stdout.split()[0])


# ------------------------------------------------------------------------------------------------ main

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="final stage: orchestrator | worker | worker-cuda | worker-cpu")
    parser.add_argument("--dockerfile", default=str(ROOT / "Dockerfile"))
    parser.add_argument("--build-arg", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--skip-models", action="store_true",
                        help="EMBED_MODELS=0, and stages copied from only for model or tokenizer files are not run "
                             "(their COPY destinations are created empty)")
    parser.add_argument("--local-torch", action="store_true",
                        help="TORCH_INDEX_URL= and TORCH_CPU_INDEX_URL=: torch==2.13.0 from pip's own configuration "
                             "(here: the CPU wheel in /opt/wheels)")
    parser.add_argument("--python", help="interpreter standing in for the base image's python "
                                         "(default: python${PYTHON_VERSION} on PATH)")
    parser.add_argument("--worker-python", default=sys.executable,
                        help="interpreter with specdec and torch that runs the tiny workers for the orchestrator check")
    parser.add_argument("--workdir", help="parent of the temporary root (default: the system temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary root (venvs, logs) and print its path")
    parser.add_argument("--report", help="write a JSON report (steps, timings, sizes) here")
    parser.add_argument("--pip-cache", metavar="DIR",
                        help="let pip cache downloads in DIR (the Dockerfile sets PIP_NO_CACHE_DIR=1; a cache "
                             "only makes repeated checks faster, the installed venv is the same)")
    parser.add_argument("--plan", action="store_true", help="print the stages and steps that would run, run nothing")
    args = parser.parse_args(argv)

    t_start = time.monotonic()
    build_args = dict(kv.split("=", 1) for kv in args.build_arg)
    if args.skip_models:
        build_args["EMBED_MODELS"] = "0"
    if args.local_torch:
        build_args.setdefault("TORCH_INDEX_URL", "")
        build_args.setdefault("TORCH_CPU_INDEX_URL", "")
    df = parse(Path(args.dockerfile).read_text(), build_args)
    if args.target not in df.stages:
        parser.error(f"no stage {args.target!r}; stages: {', '.join(df.stages)}")
    python_version = df.global_args.get("PYTHON_VERSION") or "3"
    # The base image's interpreter, stood in for by the same version here, else by this one (the
    # package supports 3.11-3.13; the report names the interpreter used).
    python = args.python or shutil.which(f"python{python_version}") or sys.executable
    runtime = chain(df, args.target)
    base = runtime[0].base
    if not re.fullmatch(r"python:[\d.]+-slim(-\w+)?", base):
        raise SystemExit(f"{args.target}: runtime base {base!r} is not python:X.Y-slim")
    role = "orchestrator" if args.target == "orchestrator" else "worker"
    if args.plan:
        print(json.dumps(plan(df, args.target, build_args, args.skip_models), indent=2))
        return 0

    tmp = Path(tempfile.mkdtemp(prefix=f"image-check-{args.target}-", dir=args.workdir))
    log = Log()
    report: dict = {"target": args.target, "base_image": base, "python": python, "build_args": build_args,
                    "root": str(tmp)}
    procs: list[Proc] = []
    try:
        t0 = time.monotonic()
        context = tmp / "context"
        n_files = make_context(context)
        log.step(f"build context: {n_files} files", time.monotonic() - t0)
        shim = make_shim(tmp / "shim", python)

        copies, venv_stage, roots, skipped = layout(df, args.target, args.skip_models)
        report["plan"] = plan(df, args.target, build_args, args.skip_models)
        for owner in sorted({roots[n] for n in roots if n not in skipped}):
            run_chain(df, chain(df, owner), tmp / "build" / owner, context, build_args, shim, log, args.pip_cache)

        # The image: final-stage COPY --from materialised, the venv used where it was built.
        image = tmp / "image"
        venv_root = tmp / "build" / roots[venv_stage]
        mapper = Mapper(image, venv_root)
        for source, src, dst in copies:
            if dst.rstrip("/") == "/opt/venv":
                continue
            target = Path(mapper(dst))
            if source in skipped:
                target.mkdir(parents=True, exist_ok=True)
                continue
            copy_into(tmp / "build" / roots[source] / src.lstrip("/"), target, False, dst.endswith("/"))
        env = base_env(shim)
        for stage in runtime:
            for ins in stage.instructions:
                if ins.op == "ENV":
                    for key, value in parse_kv(ins.args):
                        env[key] = mapper(substitute(value or "", env))
        env["HOME"] = str(tmp / "home")  # the image's HOME=/tmp, kept private to this check
        (tmp / "home").mkdir()
        venv = venv_root / "opt" / "venv"
        specdec = venv / "bin" / "specdec"
        vpython = venv / "bin" / "python"
        run_dir = tmp / "run"
        run_dir.mkdir()

        # Checks.
        t0 = time.monotonic()
        out = check([str(specdec), "--help"], env, run_dir)
        assert "serve-orchestrator" in out and "serve-draft" in out, out
        for command in ROLE_COMMANDS[role]:
            out = check([str(specdec), command, "--help"], env, run_dir)
            assert "--port-file" in out, out
        log.step(f"specdec --help, {' / '.join(ROLE_COMMANDS[role])} --help", time.monotonic() - t0)
        t0 = time.monotonic()
        probe = check([str(vpython), "-c", "import torch; print(torch.__version__, torch.version.cuda)"], env, run_dir,
                      expect_ok=(role == "worker"))
        if role == "orchestrator":
            assert "ModuleNotFoundError" in probe, probe
            for module in ("accelerate", "gguf"):
                check([str(vpython), "-c", f"import {module}"], env, run_dir, expect_ok=False)
            report["torch"] = None
            log.step("import torch / accelerate / gguf fail in the orchestrator venv (torch-free)", time.monotonic() - t0)
        else:
            report["torch"] = probe.strip().splitlines()[-1]
            log.step(f"torch in the worker venv: {report['torch']} (version, CUDA)", time.monotonic() - t0)

        t0 = time.monotonic()
        worker_args = ["--model", "tiny:seed=0", "--calibration-s", "0", "--threads", "1", "--device", "cpu"]
        if role == "worker":
            procs = [Proc(r, [str(specdec), f"serve-{r}", *worker_args], env, run_dir) for r in ("draft", "target")]
            ports = {p.name: p.wait_port() for p in procs}
        else:
            wenv = {k: v for k, v in os.environ.items() if k != "SPECDEC_MODELS_DIR"}
            workers = [Proc(f"tiny-{r}", [args.worker_python, "-m", "specdec.cli", f"serve-{r}", *worker_args],
                            wenv, run_dir) for r in ("draft", "target")]
            procs = list(workers)
            wports = [p.wait_port() for p in workers]
            orch = Proc("orchestrator", [str(specdec), "serve-orchestrator", "--draft", f"127.0.0.1:{wports[0]}",
                                         "--target", f"127.0.0.1:{wports[1]}", "--tokenizer", "tiny:seed=0"],
                        env, run_dir)
            procs.append(orch)
            ports = {"orchestrator": orch.wait_port()}
        log.step(f"started {', '.join(ports)} on 127.0.0.1 ports {list(ports.values())}", time.monotonic() - t0)
        t0 = time.monotonic()
        for name, port in ports.items():
            out = check([str(vpython), "-c", HEALTH, f"127.0.0.1:{port}", name], env, run_dir, timeout=60)
            assert out.count("SERVING") == 2, out
        log.step("grpc.health.v1: SERVING (overall and per service)", time.monotonic() - t0)
        if role == "orchestrator":
            t0 = time.monotonic()
            out = check([str(specdec), "generate", "--address", f"127.0.0.1:{ports['orchestrator']}",
                         "hello", "--max-new-tokens", "8", "--timeout-s", "60"], env, run_dir, timeout=120)
            log.step("Generate through the orchestrator (8 tokens, tiny workers)", time.monotonic() - t0)
        t0 = time.monotonic()
        for proc in reversed(procs):
            code = proc.terminate()
            if code != 0:
                raise SystemExit(f"{proc.name} exited with {code} on SIGTERM:\n{proc.log_path.read_text()[-3000:]}")
        procs = []
        log.step("SIGTERM: every process exited 0", time.monotonic() - t0)

        sizes = {"venv_bytes": du_bytes(venv), "other_image_files_bytes": du_bytes(image)}
        report["sizes"] = sizes
        print(f"venv size (base image excluded): {sizes['venv_bytes'] / 1e6:.0f} MB; other image files: "
              f"{sizes['other_image_files_bytes'] / 1e6:.1f} MB", flush=True)
        report["ok"] = True
        return 0
    finally:
        for proc in procs:
            proc.kill()
        report["steps"] = log.steps
        report["seconds"] = round(time.monotonic() - t_start, 1)
        if args.report:
            Path(args.report).write_text(json.dumps(report, indent=2))
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        print(f"image check {args.target}: {'ok' if report.get('ok') else 'FAILED'} in {report['seconds']:.0f}s", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
