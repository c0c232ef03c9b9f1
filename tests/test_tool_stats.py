"""The benchmark tools' statistics, without models or services: loadtest's percentile, the load
sweep's prompt mix per level and its report, the bench's per-round (k, accepted) pairing, reading
trace files, the simulator's timing fit and `specdec tune`'s candidates."""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from specdec.tools.loadreport import Level, markdown
from specdec.tools.loadsweep import balanced_requests_per_stream, prompt_plan, sweep_on
from specdec.tools.loadtest import percentile


# ----------------------------------------------------------------------------- percentile

def test_percentile_is_nearest_rank() -> None:
    assert percentile([1, 2, 3, 4], 0.5) == 2  # ceil(0.5 * 4) = 2nd; round(1.5) gave the 3rd
    assert percentile([4, 3, 2, 1], 0.5) == 2  # sorted first
    assert percentile([1, 2, 3, 4, 5], 0.5) == 3
    assert percentile([1, 2, 3, 4], 0.25) == 1 and percentile([1, 2, 3, 4], 0.26) == 2
    assert percentile([1, 2, 3, 4], 0.75) == 3 and percentile([1, 2, 3, 4], 1.0) == 4
    assert percentile([7.5], 0.99) == 7.5 and percentile([], 0.5) == 0.0
    assert percentile([1, 2, 3], 0.0) == 1  # clamped to the first
    values = list(range(1, 101))
    assert percentile(values, 0.99) == 99 and percentile(values, 0.5) == 50
    assert percentile(values, 0.07) == 7  # 0.07 * 100 is 7.000000000000001 in floating point
    assert percentile(values, 0.991) == 100
    assert percentile(list(range(1, 11)), 0.99) == 10


# ----------------------------------------------------------------------------- load sweep

def test_balanced_requests_per_stream() -> None:
    assert balanced_requests_per_stream([1, 2, 4, 8], 8, 2) == {1: 8, 2: 4, 4: 2, 8: 2}
    assert balanced_requests_per_stream([1, 2, 4, 8], 8, 6) == {1: 8, 2: 8, 4: 6, 8: 6}
    assert balanced_requests_per_stream([1, 3, 6], 4, 1) == {1: 4, 3: 4, 6: 2}
    assert balanced_requests_per_stream([2], 1, 0) == {2: 1}  # at least one request
    for levels, prompts, minimum in (([1, 2, 4, 8], 8, 2), ([1, 3, 5], 6, 3), ([4, 7], 5, 1)):
        for streams, r in balanced_requests_per_stream(levels, prompts, minimum).items():
            assert r >= minimum and streams * r % prompts == 0
            assert not any(streams * smaller % prompts == 0 for smaller in range(minimum, r))  # the smallest


def test_prompt_plan_gives_each_stream_a_run_and_each_prompt_equal_share() -> None:
    assert prompt_plan(2, 4, 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert prompt_plan(8, 2, 8)[:2] == [[0, 1], [2, 3]] and prompt_plan(8, 2, 8)[4] == [0, 1]
    for streams, r in balanced_requests_per_stream([1, 2, 4, 8], 8, 2).items():
        counts = Counter(i for run in prompt_plan(streams, r, 8) for i in run)
        assert set(counts) == set(range(8)) and len(set(counts.values())) == 1


class _Chunk:
    def __init__(self, token_ids: list[int], stats: Any = None) -> None:
        self.token_ids, self.stats = token_ids, stats

    def HasField(self, name: str) -> bool:  # noqa: N802 (the protobuf name)
        return getattr(self, name) is not None


class FakeStub:
    """GenerateStream answers two chunks per request, the tokens a function of the prompt, and
    records which prompt each request carried."""

    def __init__(self, prompts: list[list[int]]) -> None:
        self.index = {tuple(p): i for i, p in enumerate(prompts)}
        self.calls: list[int] = []
        self.speculative: list[bool] = []  # not pinned to k = 0

    def GenerateStream(self, req: Any, timeout: float) -> Any:  # noqa: N802
        ids = list(req.prompt_ids.ids)
        self.calls.append(self.index[tuple(ids)])
        self.speculative.append(not (req.speculation.HasField("fixed_k") and req.speculation.fixed_k == 0))

        async def chunks() -> Any:
            yield _Chunk([sum(ids) % 50, 1, 2])
            yield _Chunk([], SimpleNamespace(draft_tokens=4, accepted_tokens=2, rounds=2, k_per_round=[2, 2],
                                             guard_off_rounds=0))
        return chunks()


async def test_sweep_runs_each_prompt_equally_often_at_every_level() -> None:
    prompts = [[10 + i, i] for i in range(8)]
    stub = FakeStub(prompts)
    per_stream = balanced_requests_per_stream([1, 2, 4, 8], len(prompts), 2)
    levels, references = await sweep_on(stub, prompts, [1, 2, 4, 8], per_stream, 3, 5.0, repeats=2)
    assert stub.calls[:8] == list(range(8)) and sorted(references) == list(range(8))  # the references
    assert stub.calls[8] == 0 and stub.speculative[8]  # then one speculative warm-up, not in any block
    assert not any(stub.speculative[:8])
    calls = stub.calls[9:]
    assert [(lv.mode[0], lv.streams, lv.repeat) for lv in levels][:8] == [  # ABBA kept, flipped per level
        ("s", 1, 0), ("t", 1, 0), ("t", 1, 1), ("s", 1, 1), ("t", 2, 0), ("s", 2, 0), ("s", 2, 1), ("t", 2, 1)]
    shares = set()
    for lv in levels:
        served, calls = calls[:lv.requests], calls[lv.requests:]  # the blocks ran one after another
        assert Counter(served) == Counter(lv.prompts_run)
        assert lv.requests == lv.streams * per_stream[lv.streams] and lv.requests_per_stream == per_stream[lv.streams]
        counts = Counter(served)
        assert set(counts) == set(range(8)) and len(set(counts.values())) == 1, (lv.streams, counts)
        shares.add(tuple(sorted((i, n / lv.requests) for i, n in counts.items())))
        assert lv.mismatches == 0 and lv.errors == {} and lv.tokens == 3 * lv.requests
    assert not calls and len(shares) == 1  # every level, the same mix of prompts
    table = markdown(levels)
    assert "| speculative | 1 | 8 | 1 |" in table and "| target-only | 8 | 2 | 2 |" in table
    assert "requests / stream" in table
    json.dumps([asdict(lv) for lv in levels])  # the report's raw section still serialises


async def test_sweep_with_one_count_keeps_it_at_every_level() -> None:
    """An int is taken as given (library callers; main passes the balanced counts)."""
    prompts = [[1], [2], [3]]
    stub = FakeStub(prompts)
    levels, _ = await sweep_on(stub, prompts, [1, 2], 1, 3, 5.0)
    assert len(stub.calls) == 3 + 1 + 6  # references, the warm-up, the blocks
    assert [(lv.streams, lv.requests, lv.prompts_run) for lv in levels] == [
        (1, 1, [0]), (1, 1, [0]), (2, 2, [0, 1]), (2, 2, [0, 1])]
    # One repeat: the mode that runs first alternates per level (not speculation first everywhere).
    assert [lv.mode for lv in levels] == ["speculative", "target-only", "target-only", "speculative"]


def _block(mode: str, streams: int, tokens: int, wall_s: float, per_stream: int = 2) -> Level:
    return Level(mode, streams, 0, requests=streams * per_stream, tokens=tokens, wall_s=wall_s,
                 requests_per_stream=per_stream, arrivals=[(wall_s, tokens)], stream_ends=[wall_s] * streams)


def test_report_x_one_stream() -> None:
    with_one = [_block("speculative", 1, 10, 1.0, 8), _block("target-only", 1, 5, 1.0, 8),
                _block("speculative", 4, 30, 1.0), _block("target-only", 4, 20, 1.0)]
    table = markdown(with_one)
    assert "| speculative | 4 | 2 | 30.00 | 3.00x |" in table and "| target-only | 4 | 2 | 20.00 | 4.00x |" in table
    assert "| speculative | 1 | 8 | 10.00 | 1.00x |" in table
    without_one = [_block("speculative", 2, 30, 1.0), _block("target-only", 2, 20, 1.0)]
    table = markdown(without_one)
    assert "| speculative | 2 | 2 | 30.00 | - |" in table and "| target-only | 2 | 2 | 20.00 | - |" in table
    assert "0.00x" not in table
    assert "| speculative | 2 | - |" in markdown([Level("speculative", 2, tokens=1, wall_s=1.0)])  # not recorded


# ----------------------------------------------------------------------------- bench: (k, accepted) per round

def _run(system: str, ks: list[int], apc: list[int], accepted: int, per_round: list[int] | None = None) -> Any:
    from specdec.tools.bench import Run
    return Run(system, "greedy", "p", tokens=sum(per_round or []) + len(ks), wall_s=1.0, token_ids=[],
               rounds=len(ks), drafted=sum(ks), accepted=accepted, accepted_per_position=apc, k_per_round=ks,
               accepted_per_round=per_round or [])


def test_round_outcomes_pair_each_k_with_its_own_accepted_count() -> None:
    from specdec.tools.bench import _round_outcomes, summarize
    # Rounds (k=8, accepted 0) then (k=2, accepted 2), the budget having capped the second round's k.
    capped = _run("service fixed k=8", [8, 2], [1, 1], 2, per_round=[0, 2])
    assert _round_outcomes(capped) == [(8, 0), (2, 2)]  # sorted pairing made (8, 2), (2, 0)
    assert summarize([capped], "greedy")["a"] == pytest.approx(2 / 3)  # 2 accepted, 1 rejection (was 0.50)
    with pytest.raises(ValueError, match="accepted counts"):  # an orchestrator that does not send them
        _round_outcomes(_run("service fixed k=8", [8, 2], [1, 1], 2))


def _timed(system: str, prompt: str, repeat: int, tok_s: float) -> Any:
    from specdec.tools.bench import Run
    return Run(system, "sampled", prompt, tokens=48, wall_s=48 / tok_s, token_ids=[], repeat=repeat)


def test_repeats_give_each_pass_its_own_figure_and_compare_adaptive_with_the_best_fixed_k() -> None:
    from specdec.tools.bench import BASELINE, repeat_spread, summarize
    categories = {"c1": "code", "c2": "code", "s1": "story"}
    runs = []
    for repeat, (k2, k4, cost) in enumerate([(2.0, 3.0, 2.7), (2.0, 2.4, 2.7)]):
        for prompt in categories:
            runs.append(_timed(BASELINE, prompt, repeat, 1.0 if prompt != "s1" else 2.0))
            runs.append(_timed("service fixed k=2", prompt, repeat, k2))
            runs.append(_timed("service fixed k=4", prompt, repeat, k4))
            runs.append(_timed("service cost (server config)", prompt, repeat, cost))
    spread = repeat_spread(runs, "sampled", categories)
    assert spread["reference"] == BASELINE and spread["repeats"] == 2
    # Per repeat: per category (code: c1, c2 alike; story: half, its reference being 2 tok/s), then over them.
    assert spread["geomean_by_repeat"]["service fixed k=4"] == pytest.approx([3.0 / 2 ** 0.5, 2.4 / 2 ** 0.5])
    assert spread["geomean_by_repeat"][BASELINE] == pytest.approx([1.0, 1.0])
    versus = spread["adaptive_vs_best_fixed"]
    assert versus["candidates"] == ["service fixed k=2", "service fixed k=4"]
    assert versus["best_fixed"] == "service fixed k=4"  # best on the mean of the repeats (k=2: 2.0 in both)
    assert versus["ratio_by_repeat"] == pytest.approx([0.9, 1.125])
    assert versus["ratio_by_repeat_own_best"] == pytest.approx([0.9, 2.7 / 2.4])  # k=4 both times here
    assert versus["spread_between_repeats"] == pytest.approx(0.25)  # k=4 moved 3.0 -> 2.4
    assert spread["prompts_per_repeat"] == 3 and spread["prompts_by_repeat"]["service fixed k=2"] == [3, 3]
    # A run that made no tokens is left out (its prompt counted out of the pass), not divided by.
    broken = [r for r in runs if not (r.prompt == "s1" and r.repeat == 1 and r.system == BASELINE)]
    broken.append(_timed(BASELINE, "s1", 1, 1.0))
    broken[-1].tokens = 0
    holed = repeat_spread(broken, "sampled", categories)
    assert holed["prompts_by_repeat"]["service fixed k=4"] == [3, 2]
    assert holed["geomean_by_repeat"]["service fixed k=4"][1] == pytest.approx(2.4)  # code alone
    assert summarize(broken, "sampled", None, categories)["rows"]  # no ZeroDivisionError
    # Runs of a repeat are divided by the reference of the same repeat, never of another one.
    slower_pass = [_timed(BASELINE, "c1", 0, 1.0), _timed("service fixed k=2", "c1", 0, 2.0),
                   _timed(BASELINE, "c1", 1, 0.5), _timed("service fixed k=2", "c1", 1, 1.0)]
    rows = {r["system"]: r for r in summarize(slower_pass, "sampled", None, categories)["rows"]}
    assert rows["service fixed k=2"]["speedup_vs_target_only"] == pytest.approx(2.0)  # 2.0 and 2.0, not 1.0 / 4.0
    one_pass = [r for r in runs if r.repeat == 0]
    assert "adaptive_vs_best_fixed" not in repeat_spread(one_pass, "sampled", categories)  # no noise measured


def test_a_system_selection_keeps_the_reference_and_runs_in_every_mode() -> None:
    from specdec.tools.bench import BASELINE, select_systems, systems
    chosen = select_systems(systems(), r"fixed k=[36]$|cost \(server")
    assert [s.name for s in chosen] == [BASELINE, "service fixed k=3", "service fixed k=6",
                                        "service cost (server config)"]
    assert all(s.modes == ("greedy", "sampled") for s in chosen)  # k = 3 and 6 are greedy-only by default
    with pytest.raises(ValueError, match="matches none"):
        select_systems(systems(), "no such system")


# ----------------------------------------------------------------------------- traces, simulator, tune

def _trace(round_: int, k: int, drafted: int, draft_ms: float, verify_ms: float, round_ms: float) -> Any:
    from orchestrator.traces import RoundTrace
    return RoundTrace("s", round_, round_, "fixed", k, drafted, min(drafted, 1), [0.9] * drafted, draft_ms,
                      verify_ms, round_ms, 1, 1, True, False, draft_confidences=[0.9] * max(drafted, 1))


def test_a_trace_file_cut_mid_line_keeps_its_complete_lines(tmp_path: Path) -> None:
    from orchestrator.traces import load_traces
    lines = [json.dumps(asdict(_trace(r, 2, 2, 2.0, 5.0, 8.0))) for r in range(1, 4)]
    killed = tmp_path / "killed.jsonl"
    killed.write_text("\n".join(lines) + "\n" + lines[0][:37])  # killed while writing the 4th line
    assert [t.round for t in load_traces(killed)] == [1, 2, 3]
    broken = tmp_path / "broken.jsonl"  # a bad complete line is still an error, not skipped
    broken.write_text(lines[0] + "\n" + lines[1][:37] + "\n" + lines[2] + "\n")
    with pytest.raises(ValueError, match=":2: not a round trace"):
        load_traces(broken)


def test_the_simulators_call_overhead_counts_the_draft_call_of_an_early_stopped_round() -> None:
    from specdec.tools import simulator
    per_call_ms = 5.0
    # k = 3 asked, the early stop left no drafts: the draft was still called (both RPCs' overhead).
    traces = [_trace(r, 3, 0, 4.0, 20.0, 24.0 + 2 * per_call_ms) for r in range(1, 31)]
    traces += [_trace(r, 3, 3, 12.0, 23.0, 35.0 + 2 * per_call_ms) for r in range(31, 41)]
    traces += [_trace(r, 0, 0, 0.0, 20.0, 20.0 + per_call_ms) for r in range(41, 51)]  # target-only: one call
    assert simulator.build(traces).timing.rpc_overhead_ms == pytest.approx(per_call_ms)


def test_tune_tries_fixed_k_only_where_the_orchestrator_would_run_it() -> None:
    from specdec.tools import tune
    fixed = [c.config for c in tune.grid(2, 6, [0.0, 0.3]) if c.config.policy == "fixed"]
    # The orchestrator clamps a fixed k into [min_k, max_k]: a fixed k = 0 under min_k = 2 runs k = 2.
    assert fixed and all(2 <= c.fixed_k <= 6 and c.min_k == 2 for c in fixed)
    assert tune.target_only_candidate(6).config.validate().fixed_k == 0
