"""`specdec demo`: start draft, target and orchestrator locally, stream one generation, print stats."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TextIO

from specdec.tools.client import build_request, format_stats, stream_generate
from specdec.embedded import DEFAULT_DRAFT, DEFAULT_TARGET

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PAIR_CONFIG = ROOT / "configs" / "embedded-pair-cpu.toml"
DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a short docstring."


class Service:
    def __init__(self, name: str, argv: list[str], workdir: Path, cpus: str | None = None) -> None:
        """cpus: a taskset CPU list ("0", "1-3") to pin the process to, emulating its own device."""
        self.name = name
        self.port_file = workdir / f"{name}.port"
        self.port_file.unlink(missing_ok=True)  # a logs dir used before holds the last run's ports
        self.log_path = workdir / f"{name}.log"
        self._log = open(self.log_path, "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        pin = ["taskset", "-c", cpus] if cpus else []
        self.proc = subprocess.Popen([*pin, sys.executable, "-m", *argv, "--port", "0", "--port-file",
                                      str(self.port_file)], stdout=self._log, stderr=subprocess.STDOUT, env=env)

    @property
    def port(self) -> int | None:
        return int(self.port_file.read_text()) if self.port_file.exists() else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


def wait_ready(services: list[Service], timeout_s: float, out: TextIO | None = None) -> None:
    """Show loading progress until every service has written its port file. On a terminal one line
    is redrawn every 0.5 s; into a file or a pipe (CI logs, `make demo | tee`) a line is written only
    when a service's state changes (redrawing with carriage returns there piles up one line of
    hundreds of states)."""
    out = out or sys.stdout
    redraw = out.isatty()
    start = time.monotonic()
    last_line = ""
    while True:
        states = []
        ports = [svc.port for svc in services]  # read once: the line shows what the exit test sees
        for svc, port in zip(services, ports):
            if svc.proc.poll() is not None:
                tail = svc.log_path.read_text()[-3000:]
                raise SystemExit(f"\n{svc.name} exited with code {svc.proc.returncode}:\n{tail}")
            states.append(f"{svc.name}: {'ready :' + str(port) if port else 'loading'}")
        elapsed = time.monotonic() - start
        line = " | ".join(states)
        if redraw:
            print(f"\r[{elapsed:5.1f}s] {line}   ", end="", file=out, flush=True)
        elif line != last_line:
            print(f"[{elapsed:5.1f}s] {line}", file=out, flush=True)
        last_line = line
        if all(ports):
            if redraw:
                print(file=out)
            return
        if elapsed > timeout_s:
            raise SystemExit(f"\nservices not ready after {timeout_s:.0f}s; logs in {services[0].log_path.parent}")
        time.sleep(0.5)


def cpu_list(spec: str) -> set[int]:
    """CPUs of a taskset list such as "0", "0-3", "0,2-3" or "0-6:2"."""
    cpus: set[int] = set()
    for part in spec.split(","):
        if part.strip():
            span, _, stride = part.partition(":")
            lo, _, hi = span.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1, int(stride or 1)))
    return cpus


def shares_compute(cpu_sets: dict[str, str]) -> bool:
    """Whether the two local workers run on the same cores: unless both are pinned to disjoint CPU lists."""
    target, draft = cpu_sets.get("target"), cpu_sets.get("draft")
    return not (target and draft and not cpu_list(target) & cpu_list(draft))


def worker_flags(threads: int, worker_args: Sequence[str], cpu_sets: dict[str, str],
                 shared_compute: bool | None) -> list[str]:
    """Both local workers' extra flags: threads, the caller's, and --shared-compute where they share
    cores (or as shared_compute says)."""
    flags = (["--threads", str(threads)] if threads else []) + [a for a in worker_args if a != "--shared-compute"]
    shared = shares_compute(cpu_sets) if shared_compute is None else shared_compute
    if shared or (shared_compute is None and "--shared-compute" in worker_args):
        flags.append("--shared-compute")
    return flags


def exited_early(return_codes: dict[str, int | None]) -> list[str]:
    """The services that exited on their own, not cleanly (None: still running, 0: a clean exit)."""
    return [name for name, code in return_codes.items() if code not in (None, 0)]


@contextlib.contextmanager
def local_services(target: str, draft: str, threads: int, orch_args: list[str],
                   timeout_s: float = 900.0, worker_args: Sequence[str] = (),
                   cpu_sets: dict[str, str] | None = None, shared_compute: bool | None = None,
                   logs_dir: Path | None = None) -> Iterator[str]:
    """Start the three services as subprocesses on free ports; yields the orchestrator address.
    cpu_sets pins roles ("target", "draft", "orchestrator") to CPU lists. Workers that are not pinned
    apart share the machine's cores: they get --shared-compute (docs/batching.md); shared_compute
    True / False overrides that. The services' logs go to logs_dir, kept; without one, to a temporary
    directory that is removed when all went well and kept (its path printed) when not."""
    cpu_sets = cpu_sets or {}
    if logs_dir is not None:
        logs_dir.mkdir(parents=True, exist_ok=True)
    workdir = logs_dir or Path(tempfile.mkdtemp(prefix="specdec-demo-"))
    services: list[Service] = []
    failed = True
    try:
        thread_args = worker_flags(threads, worker_args, cpu_sets, shared_compute)
        # One after the other: each worker calibrates at startup, and two calibrating at once on the
        # same cores would measure each other.
        services.append(Service("target", ["target_worker", "--model", target, *thread_args], workdir,
                                cpu_sets.get("target")))
        wait_ready(services, timeout_s)
        services.append(Service("draft", ["draft_worker", "--model", draft, *thread_args], workdir,
                                cpu_sets.get("draft")))
        wait_ready(services, timeout_s)
        services.append(Service("orchestrator", [
            "orchestrator", "--draft", f"127.0.0.1:{services[1].port}", "--target", f"127.0.0.1:{services[0].port}",
            "--tokenizer", target, *orch_args], workdir, cpu_sets.get("orchestrator")))
        wait_ready(services, timeout_s)
        if logs_dir is not None:
            print(f"logs: {workdir}")
        yield f"127.0.0.1:{services[2].port}"
        failed = False
    finally:
        crashed = exited_early({svc.name: svc.proc.poll() for svc in services})  # before we stop them
        failed = failed or bool(crashed)
        for svc in reversed(services):
            svc.stop()
        if crashed:
            print(f"exited on their own during the run: {', '.join(crashed)}", file=sys.stderr)
        if logs_dir is None and not failed:
            shutil.rmtree(workdir, ignore_errors=True)
        elif logs_dir is None:
            print(f"logs kept: {workdir}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specdec demo", description=__doc__)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--raw", action="store_true", help="send the prompt as plain text, not a chat message")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--policy", default=None, help="k policy for this request (default: server's)")
    parser.add_argument("--fixed-k", type=int)
    parser.add_argument("--threads", type=int, default=0, help="torch threads per worker (0: default)")
    parser.add_argument("--no-compare", action="store_true", help="skip the target-only (k=0) comparison run")
    parser.add_argument("--config", help="orchestrator [speculation] TOML (default for the embedded pair: "
                        "configs/embedded-pair-cpu.toml)")
    parser.add_argument("--logs-dir", type=Path, help="keep the three services' logs here (default: a temporary "
                        "directory, removed unless something failed)")
    args = parser.parse_args(argv)

    config = args.config
    if config is None and (args.target, args.draft) == (DEFAULT_TARGET, DEFAULT_DRAFT) and DEFAULT_PAIR_CONFIG.exists():
        config = str(DEFAULT_PAIR_CONFIG)
    orch_args = ["--log-level", "WARNING"] + (["--config", config] if config else [])
    if config:
        print(f"speculation config: {config}")
    with local_services(args.target, args.draft, args.threads, orch_args, logs_dir=args.logs_dir) as address:
        common = dict(prompt=args.prompt, chat=not args.raw, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, seed=args.seed)
        print(f"\n=== speculative ({args.policy or 'server default policy'}"
              f"{'' if args.fixed_k is None else f', k={args.fixed_k}'}) ===")
        spec = asyncio.run(stream_generate(address, build_request(**common, policy=args.policy, fixed_k=args.fixed_k)))
        print(format_stats(spec))
        if not args.no_compare:
            print("\n=== target only (k=0), same prompt ===")
            base = asyncio.run(stream_generate(address, build_request(**common, fixed_k=0)))
            print(format_stats(base))
            if base.tokens_per_second > 0:
                print(f"\nspeedup vs target-only: {spec.tokens_per_second / base.tokens_per_second:.2f}x "
                      f"({spec.tokens_per_second:.2f} vs {base.tokens_per_second:.2f} tok/s)")


if __name__ == "__main__":
    main()
