"""The CLI entry points as a user runs them: real subprocesses, real ports, SIGTERM on exit."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_demo_runs_three_services_on_tiny_models(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "demo", "--target", "tiny:seed=0", "--draft", "tiny:seed=0,noise=0.01",
         "--prompt", "hello", "--raw", "--max-new-tokens", "24", "--threads", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=240, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert list(tmp_path.glob("specdec-demo-*")) == []  # the services' logs go when all went well
    out = result.stdout
    assert "=== speculative" in out and "=== target only (k=0)" in out
    assert out.count("tokens: 24 new") == 2
    assert "speedup vs target-only" in out
    assert "acceptance" in out


def test_cli_help_lists_commands() -> None:
    result = subprocess.run([sys.executable, "-m", "specdec.cli", "--help"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0
    for command in ("serve-draft", "serve-target", "serve-orchestrator", "generate", "demo"):
        assert command in result.stdout


def test_a_service_that_died_during_the_run_keeps_the_logs() -> None:
    """local_services removes its temporary logs only when all went well: a service that exited on
    its own (a crash, an OOM kill) while the caller's work still finished counts as a failure."""
    from specdec.tools.demo import exited_early
    assert exited_early({"target": None, "draft": None, "orchestrator": None}) == []
    assert exited_early({"target": None, "draft": 0}) == []
    assert exited_early({"target": None, "draft": -9, "orchestrator": 1}) == ["draft", "orchestrator"]


def test_each_command_help_names_its_command(capsys) -> None:
    """`specdec X --help` shows `usage: specdec X`, the line a user copies (fetch-models printed
    `usage: specdec [-h] ...`, which does not run)."""

    from specdec.cli import COMMANDS, main
    for command in COMMANDS:
        with pytest.raises(SystemExit) as exited:
            main([command, "--help"])
        assert exited.value.code == 0, command
        assert capsys.readouterr().out.startswith(f"usage: specdec {command}"), command


def test_startup_progress_into_a_file_is_a_line_per_change_of_state() -> None:
    """Into a pipe or a file (CI logs, `make demo | tee`) the progress is not redrawn with carriage
    returns every 0.5 s: one line per change of state. On a terminal it is redrawn in place."""
    import io
    from types import SimpleNamespace

    from specdec.tools.demo import wait_ready

    class SlowService:
        """A service that writes its port on the third look."""
        def __init__(self) -> None:
            self.name, self.looks = "target", 0
            self.proc = SimpleNamespace(poll=lambda: None)

        @property
        def port(self) -> int | None:
            self.looks += 1
            return 4242 if self.looks >= 3 else None

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    into_file = io.StringIO()
    wait_ready([SlowService()], timeout_s=30, out=into_file)
    lines = into_file.getvalue().splitlines()
    assert "\r" not in into_file.getvalue()
    assert [line.split("] ", 1)[1] for line in lines] == ["target: loading", "target: ready :4242"]

    terminal = Terminal()
    wait_ready([SlowService()], timeout_s=30, out=terminal)
    assert terminal.getvalue().count("\r") == 3 and terminal.getvalue().endswith("\n")


def test_generate_reports_a_failed_call_by_its_status_not_a_traceback(tmp_path: Path) -> None:
    from specdec.cli import generate_main
    with pytest.raises(SystemExit, match="UNAVAILABLE"):  # nothing listens on port 1
        generate_main(["hi", "--address", "127.0.0.1:1", "--timeout-s", "5"])
    with pytest.raises(SystemExit, match="no tokens"):
        (tmp_path / "empty").write_text("# none\n")
        generate_main(["hi", "--auth-token-file", str(tmp_path / "empty")])


def test_generate_refuses_a_server_name_without_tls_and_warns_of_a_plaintext_token(caplog) -> None:
    from specdec.tools.client import connection
    with pytest.raises(ValueError, match="--tls-server-name needs"):
        connection(tls_server_name="specdec", environ={})
    with caplog.at_level("WARNING"):
        assert connection(environ={"SPECDEC_AUTH_TOKEN": "t"}).metadata == (("authorization", "Bearer t"),)
    assert "plaintext" in caplog.text
