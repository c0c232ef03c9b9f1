"""Real worker / orchestrator processes for crash and shutdown tests (127.0.0.1 only)."""
from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def spawn(module: str, args: list[str], tmp_path: Path, timeout_s: float = 90.0,
          log_level: str = "WARNING") -> tuple[subprocess.Popen, int]:
    port_file = tmp_path / f"{module}-{uuid.uuid4().hex[:8]}.port"
    log = open(tmp_path / f"{module}.log", "a")
    proc = subprocess.Popen([sys.executable, "-m", module, *args, "--port-file", str(port_file),
                             "--log-level", log_level], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while not port_file.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"{module} exited with {proc.returncode}: {(tmp_path / f'{module}.log').read_text()[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"{module} did not start in {timeout_s}s")
        time.sleep(0.05)
    return proc, int(port_file.read_text())


def spawn_worker(role: str, model: str, tmp_path: Path, port: int = 0) -> tuple[subprocess.Popen, int]:
    return spawn(f"{role}_worker", ["--model", model, "--port", str(port), "--threads", "1", "--dtype", "float32"],
                 tmp_path)


async def aspawn(module: str, args: list[str], tmp_path: Path, log_level: str = "WARNING") -> tuple[subprocess.Popen, int]:
    """spawn() without blocking the event loop (in-process servers must keep answering meanwhile)."""
    import asyncio
    return await asyncio.to_thread(spawn, module, args, tmp_path, 90.0, log_level)


async def aspawn_worker(role: str, model: str, tmp_path: Path, port: int = 0) -> tuple[subprocess.Popen, int]:
    import asyncio
    return await asyncio.to_thread(spawn_worker, role, model, tmp_path, port)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
