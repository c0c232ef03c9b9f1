"""`specdec bench --smoke` (tiny models) produces a complete, internally consistent report.
This checks the report, never a speed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.tools.bench import FIXED_KS, systems

ROOT = Path(__file__).resolve().parent.parent


def test_bench_smoke_report(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "specdec.cli", "bench", "--smoke", "--out", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    md = (tmp_path / "report.md").read_text()
    assert [s["mode"] for s in report["summaries"]] == ["greedy", "sampled"]
    assert {p.name for p in (tmp_path / "logs").glob("*.log")} == {"target.log", "draft.log", "orchestrator.log"}
    # Device- and dtype-true: the anchors run where and as the workers do, and the header says so.
    assert report["device"] == "cpu" and report["target_dtype"] == "torch.float32"
    assert "HF anchors on the same device in the same dtypes" in md and "Machine:" in md
    # Which GEMM path each worker took, from its GetInfo while it ran (never "unknown": both answered).
    assert set(report["gemm_paths"]) == {"target", "draft"}
    assert not any(path.startswith("unknown") for path in report["gemm_paths"].values()), report["gemm_paths"]
    assert "GEMM path the workers took (GetInfo): target: " in md
    n_prompts = len(report["prompts"])
    runs = report["runs"]
    for summary in report["summaries"]:
        mode = summary["mode"]
        expected = {s.name for s in systems() if mode in s.modes}
        rows = {r["system"]: r for r in summary["rows"]}
        assert set(rows) == expected
        for name, row in rows.items():
            assert row["prompts"] == n_prompts and row["tok_s_median"] > 0
            assert row["tok_s_min"] <= row["tok_s_median"] <= row["tok_s_max"]
            mine = [r for r in runs if r["system"] == name and r["mode"] == mode]
            assert sum(r["accepted"] for r in mine) <= sum(r["drafted"] for r in mine)
            if row["acceptance"] is not None:
                assert 0.0 <= row["acceptance"] <= 1.0
            if name.startswith("HF") or "in-process" in name:
                assert row["bytes_per_token"] == 0  # in-process: nothing on the wire
            else:
                assert row["bytes_per_round_to_target"] > 0
            assert f"| {name} |" in md
        assert rows["target-only (service, k=0)"]["speedup_vs_target_only"] == 1.0
        assert rows["HF assisted (default)"]["ratio_vs_hf_assisted"] == 1.0
        for k in FIXED_KS:
            name = f"service fixed k={k}"
            if name in rows:
                assert 0 < rows[name]["target_forwards_per_token"] <= 1.0
                assert all(max(r["k_per_round"]) <= k for r in runs if r["system"] == name)
        if mode == "greedy":  # every greedy system reproduces target-only exactly (the reference: no verdict)
            assert all(row["identical_to_target_only"] is True for name, row in rows.items()
                       if name != "target-only (HF in-process)")
            assert rows["target-only (HF in-process)"]["identical_to_target_only"] is None
    # Every service run has its accepted count per round, in the order of k_per_round (what a pairs).
    service = {s.name for s in systems() if s.kind == "service"}
    for run in runs:
        if run["system"] in service:
            assert len(run["accepted_per_round"]) == len(run["k_per_round"]) == run["rounds"]
            assert sum(run["accepted_per_round"]) == run["accepted"]
            assert all(0 <= n <= k for n, k in zip(run["accepted_per_round"], run["k_per_round"]))
        else:
            assert run["accepted_per_round"] == []
    for name in ("tokens_per_s_vs_k_greedy.png", "tokens_per_s_vs_k_sampled.png", "acceptance_by_position.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert name in md


def test_the_machine_description_says_when_kernels_are_restricted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bench under ATEN_CPU_CAPABILITY=avx2 on an AVX-512 CPU (an AVX2 machine emulated) must not read
    as a figure of that CPU's own kernels."""
    from specdec.tools.bench import KERNEL_LIMITS, describe_machine
    for name in KERNEL_LIMITS:
        monkeypatch.delenv(name, raising=False)
    assert "restricted" not in describe_machine()["flags"]
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    flags = describe_machine()["flags"]
    assert "kernels restricted: ONEDNN_MAX_CPU_ISA=AVX2" in flags and "torch runs" in flags


def test_bench_repeats_and_a_system_selection(tmp_path: Path) -> None:
    """`--repeats 2 --systems ...`: each pass has its own seeds and figures, the selection runs in the
    mode asked for (k = 3 is greedy-only by default) beside the k = 0 reference, and the report gives
    the adaptive policy against the best fixed k per repeat."""
    result = subprocess.run([sys.executable, "-m", "specdec.cli", "bench", "--smoke", "--modes", "sampled",
                             "--repeats", "2", "--systems", r"fixed k=[34]$|cost \(server", "--out", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    names = {"target-only (service, k=0)", "service fixed k=3", "service fixed k=4", "service cost (server config)"}
    assert {r["system"] for r in report["runs"]} == names
    assert {r["mode"] for r in report["runs"]} == {"sampled"}
    per_pass = {(r["system"], r["prompt"], r["repeat"]) for r in report["runs"]}
    assert len(per_pass) == len(report["runs"]) == len(names) * len(report["prompts"]) * 2
    spread = report["summaries"][0]["repeats"]
    assert spread["repeats"] == 2 and set(spread["geomean_by_repeat"]) == names
    versus = spread["adaptive_vs_best_fixed"]
    assert versus["best_fixed"] in ("service fixed k=3", "service fixed k=4")
    assert len(versus["ratio_by_repeat"]) == 2 and all(x > 0 for x in versus["ratio_by_repeat"])
    rows = {r["system"]: r for r in report["summaries"][0]["rows"]}
    assert all(r["prompts"] == len(report["prompts"]) and r["runs"] == 2 * len(report["prompts"]) for r in rows.values())
    md = (tmp_path / "report.md").read_text()
    assert "| repeat 1 | repeat 2 | max / min |" in md and "Adaptive (service cost) against the best fixed k" in md
    assert "against each repeat's own best" in md
    assert "no HF anchors (`--systems`)" in md  # none selected: none loaded
    # Two passes over the same prompts sample differently: their own seeds.
    k4 = {(r["prompt"], r["repeat"]): r["token_ids"] for r in report["runs"] if r["system"] == "service fixed k=4"}
    assert any(k4[p, 0] != k4[p, 1] for p in report["prompts"])


@pytest.mark.parametrize("flags, message", [(["--repeats", "0"], "--repeats must be at least 1"),
                                            (["--systems", "no such system"], "matches none of"),
                                            (["--modes", "greedy,fast"], "--modes takes greedy and/or sampled")])
def test_bad_bench_flags_stop_it_before_any_model_loads(flags: list[str], message: str) -> None:
    result = subprocess.run([sys.executable, "-m", "specdec.cli", "bench", "--smoke", *flags], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
    assert "bench: on" not in result.stdout  # the line printed once the models are chosen, before loading


def test_the_bound_fraction_is_the_geometric_mean_and_identity_needs_every_reference() -> None:
    """Of bound: the geometric mean over prompts over the Leviathan S (a median over prompts sat well
    above it where acceptance differs by prompt); none for HF assisted (another reference, another
    draft cost). Identity: a run without its reference makes no "yes"."""
    import math

    from specdec.tools.bench import Run, speedup_bound, summarize

    def run(system: str, prompt: str, tok_s: float, ids=(1, 2, 3), k: int = 0, accepted: int = 0) -> Run:
        rounds = 4
        return Run(system, "greedy", prompt, 12, 12 / tok_s, list(ids), rounds=rounds, drafted=k * rounds,
                   accepted=accepted, k_per_round=[k] * rounds if k else [],
                   accepted_per_round=[accepted // rounds] * rounds if k else [],
                   draft_ms=10.0 * k * rounds, verify_ms=1200.0)
    runs = []
    for prompt, speedup in (("p1", 1.2), ("p2", 1.3), ("p3", 3.0)):
        runs += [run("target-only (service, k=0)", prompt, 10.0),
                 run("target-only (HF in-process)", prompt, 5.0),
                 run("service fixed k=2", prompt, 10.0 * speedup, k=2, accepted=4)]
    runs.append(run("HF assisted (default)", "p1", 6.0))
    runs.append(run("HF assisted (default)", "p2", 6.0, ids=(1, 2, 4)))
    summary = summarize(runs, "greedy")
    rows = {r["system"]: r for r in summary["rows"]}
    fixed = rows["service fixed k=2"]
    geomean = math.exp((math.log(1.2) + math.log(1.3) + math.log(3.0)) / 3)
    assert fixed["speedup_vs_target_only"] == pytest.approx(1.3)  # the median, as the column says
    assert fixed["leviathan_bound"] == pytest.approx(speedup_bound(summary["a"], 2, summary["c"]))
    assert fixed["bound_fraction"] == pytest.approx(geomean / fixed["leviathan_bound"])
    assert fixed["identical_to_target_only"] is True
    assert rows["HF assisted (default)"]["leviathan_bound"] is None
    assert rows["HF assisted (default)"]["identical_to_target_only"] is False
    assert rows["target-only (HF in-process)"]["identical_to_target_only"] is None
    lonely = summarize(runs + [run("service fixed k=4", "p4", 12.0, k=4, accepted=8)], "greedy")
    assert {r["system"]: r for r in lonely["rows"]}["service fixed k=4"]["identical_to_target_only"] is None
