"""Pipelined rounds: the draft drafts round n+1 while the target verifies round n.

A hit proposes exactly what a serial round would (same prefix, randomness keyed by position), so the
output must be the same token for token as without pipelining, greedy and sampled; a miss must leave
the draft's cache consistent. Real gRPC servers on 127.0.0.1 with tiny models.
"""
from __future__ import annotations

import asyncio
import dataclasses
import statistics
import threading
import time

import pytest

from orchestrator.config import SpeculationConfig, SpeculationOverride
from orchestrator.kpolicy import CostModelPolicy, Ewma, SessionStats, predraft_depth
from orchestrator.record import RoundRecord
from specdec.contract import slot_key
from specdec.errors import SessionNotFound
from tests.stack import cancel_stream_after, draft_stub, start_stack, target_stub
from tests.test_e2e_generate import reference_greedy
from tests.test_turn_atomicity import fail_on_call

PROMPT = [5, 6, 7, 8]
LONG_PROMPT = [(7 * i) % 240 + 3 for i in range(24)]  # more than rounds.OVERLAP_MIN_PREFILL tokens


async def _generate(stack, pipeline: bool, **fields):
    speculation = {"pipeline": pipeline, **fields.pop("speculation", {"fixed_k": 3})}
    return await stack.generate(prompt_ids=PROMPT, speculation=speculation, **fields)


@pytest.mark.parametrize("draft_ref", ["tiny:seed=0", "tiny:seed=0,noise=0.03", "tiny:seed=1"])
async def test_greedy_pipelined_equals_target_alone(draft_ref: str) -> None:
    stack = await start_stack(draft_ref=draft_ref)
    try:
        reply = await _generate(stack, True, max_new_tokens=40)
        assert list(reply.token_ids) == reference_greedy(PROMPT, 40)
        s = reply.stats
        assert s.predraft_hits + s.predraft_misses > 0
        if draft_ref == "tiny:seed=0":
            # The draft is the target: everything is accepted and the bonus guess is always right.
            assert s.predraft_misses <= 1 and s.predraft_hits >= 5, (s.predraft_hits, s.predraft_misses)
            assert s.predraft_saved_ms > 0
        if draft_ref == "tiny:seed=1":  # an unrelated draft: nearly every pre-draft misses
            assert s.predraft_hits <= s.predraft_misses
    finally:
        await stack.close()


@pytest.mark.parametrize("sampling", [
    {"temperature": 1.0},
    {"temperature": 0.7, "top_k": 20},
    {"temperature": 1.3, "top_p": 0.8},
], ids=["t1", "t0.7-topk20", "t1.3-topp0.8"])
async def test_sampled_pipelined_output_is_the_serial_output_token_for_token(sampling: dict) -> None:
    """Same seed, same tokens: pipelining changes when drafts are made, never what they are."""
    stack = await start_stack(draft_ref="tiny:seed=0,noise=0.02")
    try:
        hits = misses = 0
        for seed in range(6):
            serial = await _generate(stack, False, max_new_tokens=30, seed=seed, **sampling)
            piped = await _generate(stack, True, max_new_tokens=30, seed=seed, **sampling)
            assert list(piped.token_ids) == list(serial.token_ids), seed
            assert serial.stats.predraft_hits == serial.stats.predraft_misses == 0
            hits += piped.stats.predraft_hits
            misses += piped.stats.predraft_misses
        assert hits > 0 and misses > 0, (hits, misses)  # both paths ran
    finally:
        await stack.close()


async def test_multi_turn_session_with_pipelining_matches_serial() -> None:
    # A target slower than the draft, so that branch pre-drafts fit in its verifies and get taken.
    stack = await start_stack(draft_ref="tiny:seed=0,noise=0.03", target_call_delay_ms=40.0)
    recorded: list[RoundRecord] = []

    class Recorder:
        def observe(self, record: RoundRecord) -> None:
            recorded.append(record)
    stack.orch.engine.observers.append(Recorder())
    try:
        outputs = {}
        for pipeline in (False, True):
            sid = f"chat-{pipeline}"
            turns = []
            for turn in ([5, 6, 7], [40, 41], [90, 91, 92], [17, 18]):
                # (The seed decides which rejections happen, so whether a branch guessed one: with
                # seed 3, since the draws are keyed by their prefix (2026-11-28), none did; 1, 2, 4 and 5 do.)
                reply = await stack.generate(prompt_ids=turn, max_new_tokens=24, session_id=sid,
                                             temperature=1.0, seed=1, speculation={"fixed_k": 4, "pipeline": pipeline})
                turns.append(list(reply.token_ids))
            outputs[pipeline] = turns
            # What the orchestrator believes the draft holds, it holds (a pre-draft cancelled at the
            # end of the turn may have added more; the next commit crops what the target did not confirm).
            # On the slot the session drafts from now: after a taken branch that is not slot 0.
            session = stack.orch.engine.sessions.get(sid)
            # Let a cancelled pre-draft finish on the worker: its scheduler idle.
            deadline = time.monotonic() + 10.0
            while stack.draft.scheduler.snapshot().active or stack.draft.scheduler.waiting_calls:
                assert time.monotonic() < deadline, "the draft worker never went idle"
                await asyncio.sleep(0.01)
            held = stack.draft.core.session_tokens(slot_key(sid, session.draft_slot))
            assert held is not None and held[:len(session.draft_view.tokens)] == session.draft_view.tokens
            if pipeline:
                branch_hits = sum(r.predraft_branch_hit is True for r in recorded if r.session_id == sid)
                assert branch_hits > 0, "no branch was taken: the slot check checked slot 0 only"
        assert outputs[True] == outputs[False]
    finally:
        await stack.close()


async def test_a_failing_predraft_costs_nothing_but_time() -> None:
    """A pre-draft that loses its session or fails is discarded; the round drafts serially."""
    stack = await start_stack(draft_ref="tiny:seed=0,noise=0.01")
    try:
        reference = reference_greedy(PROMPT, 30)
        for call_number in (2, 3, 5):
            fail_on_call(stack.draft.engine, "propose_steps", call_number,
                         lambda: SessionNotFound("injected: the draft restarted"))
            reply = await _generate(stack, True, max_new_tokens=30)
            assert list(reply.token_ids) == reference
        fail_on_call(stack.draft.engine, "propose_steps", 3, lambda: RuntimeError("injected bug"))
        reply = await _generate(stack, True, max_new_tokens=30)
        assert list(reply.token_ids) == reference
    finally:
        await stack.close()


@pytest.mark.parametrize("target_delay_ms", [0.0, 40.0], ids=["near", "far-target-with-branches"])
async def test_cancelled_pipelined_stream_leaves_no_call_behind(target_delay_ms: float) -> None:
    stack = await start_stack(draft_ref="tiny:seed=0,noise=0.03", target_call_delay_ms=target_delay_ms)
    try:
        first = await stack.generate(prompt_ids=PROMPT, max_new_tokens=12, session_id="s",
                                     speculation={"fixed_k": 3, "pipeline": True})
        session = stack.orch.engine.sessions.get("s")
        before = list(session.tokens)
        await cancel_stream_after(stack, 6, prompt_ids=[40, 41], max_new_tokens=40, session_id="s",
                                  speculation={"fixed_k": 3, "pipeline": True})
        deadline = time.monotonic() + 5
        while session.lock.locked() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert not session.lock.locked(), "the cancelled turn never released its session"
        assert session.tokens == before
        # No pre-draft task outlives the cancelled turn.
        pending = [t for t in asyncio.all_tasks() if not t.done() and "_propose" in repr(t.get_coro())]
        assert not pending, pending
        second = await stack.generate(prompt_ids=[40, 41], max_new_tokens=20, session_id="s",
                                      speculation={"fixed_k": 3, "pipeline": True})
        assert list(first.token_ids) == reference_greedy(PROMPT, 12)
        expected = reference_greedy(PROMPT + list(first.token_ids) + [40, 41], 20)
        assert list(second.token_ids) == expected
    finally:
        await stack.close()


# ----------------------------------------------------------------------------- policy and config

def _stats(a: float, draft_ms: float, verify_ms: float, rtt: float, bonus: float) -> SessionStats:
    stats = SessionStats()
    stats.acceptance = Ewma(0.3, a)
    stats.bonus_match = Ewma(0.2, bonus)
    stats.timing.draft_ms_per_token = Ewma(0.2, draft_ms)
    stats.timing.seed(draft_ms, {k: verify_ms for k in range(0, 9)})
    stats.timing.rtt_ms = Ewma(0.2, rtt)
    stats.timing.draft_rtt_ms = Ewma(0.2, rtt)
    return stats


def test_pipelined_cost_model_hides_the_draft_on_hits() -> None:
    # A slow-ish draft on its own device and a long RTT: serial rounds lose, pipelined ones win.
    stats = _stats(a=0.9, draft_ms=30.0, verify_ms=100.0, rtt=10.0, bonus=0.9)
    serial, piped = CostModelPolicy(pipelined=False), CostModelPolicy(pipelined=True)
    for k in range(1, 6):
        assert CostModelPolicy.tokens_per_ms(stats, k, True) > CostModelPolicy.tokens_per_ms(stats, k, False)
    assert CostModelPolicy.tokens_per_ms(stats, 0, True) == CostModelPolicy.tokens_per_ms(stats, 0, False)
    # A draft too slow to pay for itself serially still pays when it runs during the verify.
    borderline = _stats(a=0.6, draft_ms=60.0, verify_ms=100.0, rtt=10.0, bonus=0.9)
    assert serial.next_k(borderline, 0, 8) == 0 and piped.next_k(borderline, 0, 8) >= 1
    # Where the bonus is never guessed, pipelining predicts nothing better than serial.
    # Worse, where the pre-draft outlasts the verify: a fully accepted round waits for it to learn
    # its guess of the bonus token, and only then drafts serially.
    never = _stats(a=0.9, draft_ms=30.0, verify_ms=100.0, rtt=10.0, bonus=0.0)
    assert CostModelPolicy.tokens_per_ms(never, 3, True) < CostModelPolicy.tokens_per_ms(never, 3, False)
    fast_draft = _stats(a=0.9, draft_ms=5.0, verify_ms=100.0, rtt=10.0, bonus=0.0)
    assert CostModelPolicy.tokens_per_ms(fast_draft, 3, True) == pytest.approx(
        CostModelPolicy.tokens_per_ms(fast_draft, 3, False))
    # A hit costs max(draft, verify) + rtt: with the draft slower than the verify, the overhang is
    # paid. The pre-draft after k = 3 drafts the bonus guess and k more (4 tokens, 200 ms against a
    # 100 ms verify): the one past k, for growing k, only where it fits in the verify's shadow.
    slow = _stats(a=1.0, draft_ms=50.0, verify_ms=100.0, rtt=0.0, bonus=1.0)
    slow.timing.draft_rtt_ms = Ewma(0.2, 0.0)
    assert predraft_depth(3, 8, slow.timing) == 4 and CostModelPolicy.tokens_per_ms(slow, 3, True) == pytest.approx(4 / 200.0)
    assert predraft_depth(3, 8) == 5 and predraft_depth(8, 8) == 9 and predraft_depth(32, 32) == 32
    quick = _stats(a=1.0, draft_ms=10.0, verify_ms=100.0, rtt=0.0, bonus=1.0)
    assert predraft_depth(3, 8, quick.timing) == 5 and predraft_depth(3, 3, quick.timing) == 4


def test_a_hit_saves_the_serial_draft_call_not_the_whole_predraft() -> None:
    """The pre-draft after k = 3 drafts 5 tokens; the round uses 3. A serial round would have made
    one call of 3 forwards, so that is what the hit hid (less any wait), not the 5 forwards."""
    from orchestrator.rounds import hit_saved_ms
    assert hit_saved_ms(110.0, 5, 3, 20.0, 0.0) == pytest.approx(70.0)  # 10 ms RTT + 3 x 20 ms
    assert hit_saved_ms(110.0, 5, 3, 20.0, 30.0) == pytest.approx(40.0)
    assert hit_saved_ms(110.0, 5, 3, 20.0, 90.0) == 0.0
    assert hit_saved_ms(110.0, 3, 3, 20.0, 0.0) == pytest.approx(110.0)


def test_a_hits_saving_prices_the_extra_tokens_at_the_pre_drafts_own_steps() -> None:
    """The session's running estimate of a draft token starts from the startup curve and lags: with
    a tiny draft it stayed at several times a step's cost, and every hit's saving came out 0. The
    pre-draft's own steps, measured in the same call, price its tokens past the round's."""
    from types import SimpleNamespace

    from orchestrator.backends import DraftReply
    from orchestrator.rounds import Round
    round_ = SimpleNamespace(session=SimpleNamespace(stats=SimpleNamespace(
        timing=SimpleNamespace(draft_ms_per_token=SimpleNamespace(value=16.0)))))
    predraft = DraftReply([1, 2, 3, 4], [0.9] * 4, 8, compute_ms=5.0, prefilled_tokens=1, catchup_ms=1.0,
                          draft_steps=4, wall_ms=6.0)
    used = predraft.window(1, 4)
    assert Round._saved_ms(round_, predraft, used, 0.5) == pytest.approx(6.0 - 1 * 1.0 - 0.5)  # 1 ms a step
    unmeasured = dataclasses.replace(predraft, draft_steps=0, prefilled_tokens=9)  # no step of its own
    assert Round._saved_ms(round_, unmeasured, used, 0.5) == 0.0  # the estimate: 6 - 16 - 0.5 < 0


def test_bonus_match_is_learned_only_after_fully_accepted_rounds() -> None:
    stats = SessionStats()
    start = stats.bonus_match.value

    def record(drafted: int, accepted: int, hit: bool | None) -> RoundRecord:
        return RoundRecord("s", 1, 0, "cost", drafted, tuple(range(drafted)), (), (), accepted, (1,), "", None,
                           False, True, 1.0, 1.0, 10.0, 10.0, 12.0, 0, 0, 0, 0, predraft_hit=hit)
    stats.observe(record(3, 1, None))
    stats.observe(record(3, 3, False))  # previous round rejected: a miss says nothing about the bonus
    assert stats.bonus_match.value == start
    stats.observe(record(3, 3, True))   # previous round fully accepted, and the guess hit
    assert stats.bonus_match.value > start


def test_branch_match_is_learned_from_rounds_after_a_branched_rejection() -> None:
    stats = SessionStats()
    start, bonus = stats.branch_match.value, stats.bonus_match.value

    def record(accepted: int, hit: bool | None, branch_hit: bool | None) -> RoundRecord:
        return RoundRecord("s", 1, 0, "cost", 3, (1, 2, 3), (), (), accepted, (1,), "", None, False, True,
                           1.0, 1.0, 10.0, 10.0, 12.0, 0, 0, 0, 0, predraft_hit=hit, predraft_branch_hit=branch_hit)
    stats.observe(record(1, False, None))  # no branch for that rejection: nothing learned
    assert stats.branch_match.value == start
    stats.observe(record(1, False, False))  # a branch there guessed the correction wrong
    assert stats.branch_match.value < start
    low = stats.branch_match.value
    stats.observe(record(3, True, True))
    assert stats.branch_match.value > low and stats.bonus_match.value == bonus


def test_pipeline_config_and_override() -> None:
    assert SpeculationConfig().pipeline is False
    on = SpeculationConfig().with_override(SpeculationOverride(pipeline=True))
    assert on.pipeline is True and on.make_policy().pipelined is True
    assert "pipeline = true" in on.to_toml()
    assert SpeculationConfig().with_values({"pipeline": True}, "test").pipeline is True
    with pytest.raises(Exception, match="pipeline must be true or false"):
        SpeculationConfig().with_values({"pipeline": "yes"}, "test")


# ----------------------------------------------------------------------------- network emulation and report

async def test_emulated_latency_delays_both_directions_and_keeps_errors() -> None:
    import grpc

    from orchestrator.clients import EmulatedLatency, open_channel
    from specdec.v1 import common_pb2, worker_pb2, worker_pb2_grpc
    stack = await start_stack()
    channel = open_channel(f"127.0.0.1:{stack.draft_handle.port}", interceptors=[EmulatedLatency(30.0)])
    try:
        stub = worker_pb2_grpc.DraftWorkerStub(channel)
        started = time.perf_counter()
        info = await stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)
        assert info.role == "draft" and time.perf_counter() - started >= 0.060  # 2 x 30 ms, at least
        # Each direction: the request reaches the worker 30 ms after it was sent, and its answer
        # (here an error) reaches the caller 30 ms after the worker gave it.
        arrived: list[float] = []
        original = stack.draft.engine.propose_steps

        def timed(params):
            arrived.append(time.perf_counter())
            return original(params)
        stack.draft.engine.propose_steps = timed
        started = time.perf_counter()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Propose(worker_pb2.ProposeRequest(session_id="missing", k=2,
                                                         commit=common_pb2.CacheCommit(cache_len=5)), timeout=10)
        ended = time.perf_counter()
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert arrived and arrived[0] - started >= 0.030 and ended - arrived[0] >= 0.030
        # The caller's deadline covers the emulated round trip: 50 ms against 60 ms of network.
        started = time.perf_counter()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetInfo(common_pb2.GetInfoRequest(), timeout=0.05)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.perf_counter() - started < 0.5
        # A call cancelled while the worker still computes ends at once, as a real one does locally:
        # no return leg (with one, every pre-draft cancelled by a rejection held the next round back
        # by another one-way delay).
        in_step = threading.Event()

        def slow_steps(params):
            in_step.set()
            time.sleep(2.0)  # (on the worker's model thread) still computing when the caller cancels
            return original(params)
        stack.draft.engine.propose_steps = slow_steps
        slow = open_channel(f"127.0.0.1:{stack.draft_handle.port}", interceptors=[EmulatedLatency(1000.0)])
        try:
            call = asyncio.ensure_future(worker_pb2_grpc.DraftWorkerStub(slow).Propose(
                worker_pb2.ProposeRequest(session_id="missing", k=2, commit=common_pb2.CacheCommit(cache_len=5)),
                timeout=20))
            assert await asyncio.to_thread(in_step.wait, 10.0)  # past the 1 s send leg, in the 2 s step
            started = time.perf_counter()
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            assert time.perf_counter() - started < 0.5  # (with a return leg: 1 s or more)
        finally:
            await slow.close()
    finally:
        await channel.close()
        await stack.close()


def test_netbench_summary_ratios_hit_rate_and_identity() -> None:
    from specdec.tools.netreport import NetRun, markdown, summarize

    def run(system: str, prompt: str, wall: float, hits: int = 0, misses: int = 0, ids=(1, 2, 3),
            branch_hits: int = 0) -> NetRun:
        return NetRun(10.0, system, prompt, 30, wall, verify_ms=wall * 500, hits=hits, misses=misses,
                      saved_ms=hits * 5.0, token_ids=list(ids), branch_hits=branch_hits)
    runs = [run("target-only", "a", 3.0), run("serial", "a", 2.0), run("pipelined", "a", 1.5, 3, 1, branch_hits=1),
            run("target-only", "b", 3.0), run("serial", "b", 2.0), run("pipelined", "b", 1.0, 1, 3)]
    (row,) = summarize(runs)
    assert row["serial_vs_target_only"] == pytest.approx(1.5)
    assert row["pipelined_vs_serial"] == pytest.approx(statistics.median([2.0 / 1.5, 2.0]))
    assert row["pipelined_hit_rate"] == pytest.approx(0.5) and row["identical"]
    assert row["pipelined_branch_hit_share"] == pytest.approx(0.25)
    assert row["serial_target_busy"] == pytest.approx(0.5)
    assert "| 10 ms |" in markdown([row]) and "pipelined-no-branches_tok_s" not in row
    assert "no branches" not in markdown([row])  # a column per system that ran
    # A run whose prompt has no target-only reference compared nothing: not "identical".
    (lonely,) = summarize(runs + [run("pipelined", "c", 1.0, 1, 1)])
    assert lonely["identical"] is False
    runs += [run("pipelined-no-branches", "a", 2.0, 1, 3), run("pipelined-no-branches", "b", 2.0, 1, 1)]
    (row,) = summarize(runs)
    assert row["pipelined-no-branches_vs_serial"] == pytest.approx(1.0)
    assert row["pipelined-no-branches_hit_rate"] == pytest.approx(2 / 6)
    text = markdown([row])
    assert "| pipelined, no branches / serial | pipelined, branches, overlap auto (default) / serial |" in text
    assert "| 1.00 | 1.67 |" in text and "| 33% (0%), 5 ms, - | 50% (25%), 10 ms, - |" in text
    runs.append(run("pipelined", "c", 1.0, ids=(9,)))
    runs.append(run("target-only", "c", 1.0))
    assert not summarize(runs)[0]["identical"]


def test_netbench_repeats_pair_each_run_with_its_own_pass_and_select_systems() -> None:
    """--repeats: a run is compared with the references on the same prompt in the same pass, and the
    per-pass medians give the spread; --systems keeps the two references whatever it selects."""
    from specdec.tools.netbench import selected_systems
    from specdec.tools.netreport import SYSTEMS, NetRun, markdown, summarize

    def run(system: str, prompt: str, wall: float, repeat: int) -> NetRun:
        return NetRun(0.0, system, prompt, 30, wall, verify_ms=0.0, hits=0, misses=0, saved_ms=0.0,
                      token_ids=[1], repeat=repeat)
    runs = [run("target-only", "a", 3.0, 0), run("serial", "a", 2.0, 0), run("pipelined", "a", 1.0, 0),
            run("target-only", "a", 3.0, 1), run("serial", "a", 4.0, 1), run("pipelined", "a", 2.0, 1),
            run("target-only", "b", 3.0, 1), run("serial", "b", 2.0, 1), run("pipelined", "b", 2.0, 1)]
    (row,) = summarize(runs)
    # Pass 0: 2.0; pass 1: a 2.0, b 1.0 (paired across passes, a would read 4.0 / 1.0 or 2.0 / 2.0).
    assert row["pipelined_vs_serial_by_pass"] == [pytest.approx(2.0), pytest.approx(1.5)]
    assert row["pipelined_vs_serial"] == pytest.approx(2.0) and row["passes"] == 2
    assert "- 0 ms, pipelined: 2.00, 1.50 (max / min 1.333)" in markdown([row])
    assert selected_systems(None) == list(SYSTEMS)
    assert selected_systems("overlap$") == ["target-only", "serial", "pipelined-no-overlap", "pipelined-overlap"]
    assert selected_systems("^pipelined$") == ["target-only", "serial", "pipelined"]
    for bad in ("serial", "nothing", "("):
        with pytest.raises(ValueError, match="--systems"):
            selected_systems(bad)


def test_netbench_ceiling_and_verify_slowdown_from_round_traces(tmp_path) -> None:
    """The traces' sessions map to the runs in order (after the warm-up), checked by their tokens;
    the ceiling hides every draft of the serial rounds but the first round's; the slowdown compares
    verify compute at equal k, where both sides have a few rounds at that k."""
    from dataclasses import asdict

    from orchestrator.traces import RoundTrace, TraceWriter
    from specdec.tools.netreport import NetRun, attach_rounds, ceiling, markdown, summarize, verify_slowdown

    def trace(session: str, index: int, drafted: int, round_ms: float, verify_ms: float, wall_ms: float,
              prefilled: int = 1) -> RoundTrace:
        return RoundTrace(session, index, 10, "cost", drafted, drafted, drafted, [], 0.0, verify_ms, round_ms,
                          prefilled, prefilled, True, False, verify_wall_ms=wall_ms, emitted=drafted + 1)
    serial = [trace("s", 1, 3, 1000, 800, 810, prefilled=40), trace("s", 2, 3, 400, 300, 310),
              trace("s", 3, 3, 410, 310, 320), trace("s", 4, 3, 390, 290, 300), trace("s", 5, 2, 380, 290, 300)]
    piped = [trace("p", 1, 3, 1000, 800, 810, prefilled=40), trace("p", 2, 3, 360, 360, 362),
             trace("p", 3, 3, 330, 330, 335), trace("p", 4, 3, 345, 345, 350), trace("p", 5, 2, 300, 290, 300)]
    path = tmp_path / "rounds.jsonl"
    writer = TraceWriter(path)
    for t in [trace("warm", 1, 0, 5, 5, 5)] + serial + piped:
        writer.write(t)
    writer.close()
    runs = [NetRun(0.0, name, "a", 19, 1.0, 1.0, 0, 0, 0.0, [1]) for name in ("serial", "pipelined")]
    assert attach_rounds(runs, path) and [len(r.rounds) for r in runs] == [5, 5]
    assert not attach_rounds(runs[:1], path)  # one run more or less than sessions: nothing attached
    shifted = [NetRun(0.0, "serial", "a", 18, 1.0, 1.0, 0, 0, 0.0, [1]), runs[1]]
    assert not attach_rounds(shifted, path) and shifted[0].rounds == []  # tokens differ: not its rounds
    assert ceiling(runs[0]) == pytest.approx(2580 / 2230)
    # k = 3: pipelined (360 + 330 + 345) / 3 against serial (300 + 310 + 290) / 3; k = 2 has one
    # round a side, too few to compare.
    assert verify_slowdown([runs[1]], [runs[0]]) == pytest.approx(345 / 300)
    assert verify_slowdown([runs[1]], [NetRun(0.0, "serial", "a", 19, 1.0, 1.0, 0, 0, 0.0, [1], rounds=[asdict(t) for t in serial[:3]])]) is None
    runs.append(NetRun(0.0, "target-only", "a", 19, 2.0, 1.0, 0, 0, 0.0, [1]))
    (row,) = summarize(runs)
    assert row["ceiling_vs_serial"] == pytest.approx(ceiling(runs[0]))
    assert "| 1.16 | yes |" in markdown([row]) and "| 1.15x |" in markdown([row])


def test_metrics_count_predraft_outcomes_and_saved_time() -> None:
    from orchestrator.metrics import OrchestratorMetrics
    metrics = OrchestratorMetrics()

    def record(hit: bool | None, saved: float, branch: bool | None = None) -> RoundRecord:
        return RoundRecord("s", 2, 0, "cost", 3, (1, 2, 3), (), (), 3, (1, 2, 3, 4), "", None, False, True,
                           40.0, 10.0, 100.0, 101.0, 105.0, 1, 1, 0, 0, predraft_hit=hit, predraft_saved_ms=saved,
                           predraft_branch_hit=branch)
    for hit, saved, branch in ((True, 30.0, None), (True, 20.0, True), (False, 0.0, False), (None, 0.0, True)):
        metrics.observe(record(hit, saved, branch))
    value = metrics.registry.get_sample_value
    assert value("specdec_predrafts_total", {"outcome": "hit"}) == 2
    assert value("specdec_predraft_branch_hits_total") == 1
    assert value("specdec_predrafts_total", {"outcome": "miss"}) == 1
    assert value("specdec_predraft_saved_seconds_total") == pytest.approx(0.05)


async def test_k_can_grow_along_a_run_of_hits() -> None:
    """Each pre-draft is one deeper than its round, so a policy that raises k on full acceptance
    (heuristic: +2) is not held at its first k by the pipeline."""
    stack = await start_stack(draft_ref="tiny:seed=0")
    try:
        serial = await _generate(stack, False, max_new_tokens=40, speculation={"policy": "heuristic", "max_k": 8})
        piped = await _generate(stack, True, max_new_tokens=40, speculation={"policy": "heuristic", "max_k": 8})
        assert list(piped.token_ids) == list(serial.token_ids) == reference_greedy(PROMPT, 40)
        assert max(piped.stats.k_per_round) >= 6, list(piped.stats.k_per_round)
        assert piped.stats.predraft_hits >= 3
    finally:
        await stack.close()


@pytest.mark.parametrize("overlap", [True, False])
async def test_the_first_round_prefills_target_and_draft_side_by_side(overlap: bool) -> None:
    """Prefill overlap: round 1 runs target-only while the draft prefills the prompt beside it and
    pre-drafts round 2; the target's prefill does not wait for the draft's."""
    # A draft of its own (tiny:seed=0 would be the target's very model object, hooks and all).
    stack = await start_stack(draft_ref="tiny:seed=0,noise=0.001", speculation=SpeculationConfig(overlap_prefill=overlap))
    assert stack.draft.core.model is not stack.target.core.model
    events: list[str] = []

    def slow_draft(module, args):
        events.append("draft-start")
        time.sleep(0.2)
    hooks = [stack.draft.core.model.register_forward_pre_hook(slow_draft),
             stack.draft.core.model.register_forward_hook(lambda *a: events.append("draft-end")),
             stack.target.core.model.register_forward_pre_hook(lambda *a: events.append("target-start"))]
    try:
        reply = await stack.generate(prompt_ids=LONG_PROMPT, max_new_tokens=12)
        assert list(reply.token_ids) == reference_greedy(LONG_PROMPT, 12)
        s = reply.stats
        if overlap:
            # The target started its prefill while the draft's first forward was still running.
            assert events.index("target-start") < events.index("draft-end"), events[:6]
            assert s.k_per_round[0] == 0 and max(s.k_per_round) > 0
            # The draft is nearly the target: its guess of the first token is right.
            assert s.predraft_hits == 1 and s.predraft_misses == 0
        else:
            assert events.index("draft-end") < events.index("target-start"), (events[:6], list(s.k_per_round))
            assert s.k_per_round[0] > 0 and s.predraft_hits == s.predraft_misses == 0
        # A pinned k is the k of every round, the first included; a short prompt has nothing to hide.
        fixed = await stack.generate(prompt_ids=LONG_PROMPT, max_new_tokens=12, speculation={"fixed_k": 3})
        assert list(fixed.stats.k_per_round[:2]) == [3, 3]
        short = await stack.generate(prompt_ids=PROMPT, max_new_tokens=12)
        assert short.stats.predraft_hits == short.stats.predraft_misses == 0
    finally:
        for hook in hooks:
            hook.remove()
        await stack.close()


@pytest.mark.parametrize("overlap", [False, True])
async def test_the_policy_is_told_what_the_target_prefills_in_each_round(overlap: bool, monkeypatch) -> None:
    """A turn's first round carries its prompt into the target's forward (the policy prices its k
    for that, kpolicy.prefill_round_k); steady rounds carry one token. With the prefill overlap the
    first round runs target-only whatever k says, and its k only sizes round 2's pre-draft: 0 rows."""
    seen: list[int] = []
    real = CostModelPolicy.next_k

    def spy(self, stats, min_k, max_k, prefill_rows=0):
        seen.append(prefill_rows)
        return real(self, stats, min_k, max_k, prefill_rows)
    monkeypatch.setattr(CostModelPolicy, "next_k", spy)
    stack = await start_stack(draft_ref="tiny:seed=0,noise=0.001", speculation=SpeculationConfig(overlap_prefill=overlap))
    try:
        reply = await stack.generate(prompt_ids=LONG_PROMPT, max_new_tokens=12)
        assert list(reply.token_ids) == reference_greedy(LONG_PROMPT, 12)
        assert seen[0] == (0 if overlap else len(LONG_PROMPT)) and len(seen) >= 2, seen
        assert set(seen[1:]) == {1}, seen
    finally:
        await stack.close()


async def test_a_prompt_rounds_small_k_does_not_hold_back_the_pre_drafts_after_it(monkeypatch) -> None:
    """The first round drafts few (its k priced for the prompt's forward) but its pre-draft goes to
    max_k: round 2, a hit, drafts its own steady k at once instead of growing to it one per round."""
    def policy(self, stats, min_k, max_k, prefill_rows=0):
        return 1 if prefill_rows > 1 else 6
    monkeypatch.setattr(CostModelPolicy, "next_k", policy)
    stack = await start_stack(draft_ref="tiny:seed=0")  # the target's own model: every draft accepted
    try:
        reply = await stack.generate(prompt_ids=LONG_PROMPT, max_new_tokens=14, speculation={"pipeline": True})
        assert list(reply.token_ids) == reference_greedy(LONG_PROMPT, 14)
        s = reply.stats
        assert list(s.k_per_round[:2]) == [1, 6] and s.predraft_hits >= 1, list(s.k_per_round)
        # Position 6 of a round's drafts was accepted: round 2 drafted 6 (held back: 2, then 3, 4...).
        assert len(s.accepted_per_position) >= 6 and s.accepted_per_position[5] >= 1, list(s.accepted_per_position)
    finally:
        await stack.close()


@pytest.mark.parametrize("server_default", [False, True])
async def test_a_request_turns_the_prefill_overlap_on_or_off(server_default: bool) -> None:
    """SpeculationOptions.overlap_prefill wins over the server's setting, both ways."""
    stack = await start_stack(draft_ref="tiny:seed=0,noise=0.001",
                              speculation=SpeculationConfig(overlap_prefill=server_default))
    try:
        reply = await stack.generate(prompt_ids=LONG_PROMPT, max_new_tokens=12,
                                     speculation={"overlap_prefill": not server_default})
        assert list(reply.token_ids) == reference_greedy(LONG_PROMPT, 12)
        s = reply.stats
        if server_default:  # turned off: round 1 drafts, nothing was pre-drafted
            assert s.k_per_round[0] > 0 and s.predraft_hits == s.predraft_misses == 0, list(s.k_per_round)
        else:  # turned on: round 1 is target-only and round 2 takes the draft's pre-draft
            assert s.k_per_round[0] == 0 and s.predraft_hits == 1, list(s.k_per_round)
    finally:
        await stack.close()


@pytest.mark.parametrize("pays", [True, False])
async def test_auto_overlaps_the_first_round_where_the_price_says_so_and_only_when_pipelined(
        pays: bool, monkeypatch) -> None:
    """overlap_prefill = "auto" (the default): where the server's config has pipelining on (the
    workers on different devices), each turn's first round asks the cost model
    (kpolicy.prefill_overlap_price, here stubbed) with the turn's own pipelining, branches and token
    budget, and overlaps where it pays, runs serially where it does not. On a server without
    pipelining (one shared device) it never overlaps and never asks, whatever the request's
    pipeline. The round record says which rounds overlapped."""
    import orchestrator.engine as engine_module
    from orchestrator.kpolicy import OverlapPrice
    asked: list[tuple] = []

    def price(stats, rows, min_k, max_k, pipelined=False, branches=0, remaining=None):
        asked.append((rows, pipelined, branches, remaining))
        return OverlapPrice(serial=100.0, overlap=50.0 if pays else 90.0, make_up=20.0, k_serial=2)
    monkeypatch.setattr(engine_module, "prefill_overlap_price", price)
    # The policy drafts every round (the tiny pair's costs would have it pick k = 0 after a turn).
    monkeypatch.setattr(CostModelPolicy, "next_k", lambda self, stats, min_k, max_k, prefill_rows=0: 3)
    overlapped: list[bool] = []

    class Spy:
        def observe(self, record: RoundRecord) -> None:
            overlapped.append(record.overlapped)
    stack = await start_stack(draft_ref="tiny:seed=0,noise=0.001", speculation=SpeculationConfig(pipeline=True))
    assert stack.orch.engine.speculation.overlap_prefill == "auto"
    stack.orch.engine.observers.append(Spy())
    try:
        for pipelined in (True, False):  # the request's own pipelining: the server's says the devices are apart
            asked.clear(), overlapped.clear()
            reply = await stack.generate(prompt_ids=LONG_PROMPT, max_new_tokens=12,
                                         speculation={"pipeline": pipelined})
            assert list(reply.token_ids) == reference_greedy(LONG_PROMPT, 12)
            s = reply.stats
            branches = SpeculationConfig().pipeline_branches if pipelined else 2
            assert asked == [(len(LONG_PROMPT), pipelined, branches, 12)], asked  # once per turn, for its prompt
            if pays:
                assert s.k_per_round[0] == 0 and s.predraft_hits + s.predraft_misses >= 1, list(s.k_per_round)
                assert overlapped[0] and not any(overlapped[1:]), overlapped
            else:
                assert s.k_per_round[0] > 0 and not any(overlapped), (list(s.k_per_round), overlapped)
    finally:
        await stack.close()
    if pays:
        return
    stack = await start_stack(draft_ref="tiny:seed=0,noise=0.001")  # the server: pipeline off
    stack.orch.engine.observers.append(Spy())
    try:
        asked.clear(), overlapped.clear()
        reply = await stack.generate(prompt_ids=LONG_PROMPT, max_new_tokens=12, speculation={"pipeline": True})
        assert list(reply.token_ids) == reference_greedy(LONG_PROMPT, 12)
        assert asked == [] and overlapped and not any(overlapped), (asked, overlapped)
    finally:
        await stack.close()


# ----------------------------------------------------------------------------- branches

def test_a_forked_slot_drafts_what_the_session_would_and_leaves_it_alone() -> None:
    """A branch slot forked at a prefix drafts exactly what a session holding that prefix drafts
    (the KV copy is the session's own), the source slot keeps its cache, ending the session ends
    its slots, and bad forks answer NOT_FOUND, FAILED_PRECONDITION or INVALID_ARGUMENT."""
    from draft_worker.engine import DraftEngine, ProposeParams
    from specdec.contract import Commit, SamplingConfig, prefix_hash, slot_key
    from specdec.errors import CacheMismatch, InvalidRequest
    from specdec.models import load_model
    from specdec.worker_core import WorkerCore

    engine = DraftEngine(WorkerCore(load_model("tiny:seed=0,noise=0.03"), "draft"))
    core, greedy = engine.core, SamplingConfig()
    text = [5, 6, 7, 8, 9, 10, 11, 12]
    engine.propose(ProposeParams("s", Commit(0, 0, tuple(text)), 3, greedy))
    held = core.session_tokens("s")
    fork = Commit(5, prefix_hash(text[:5]), (42,))
    branch = engine.propose(ProposeParams("s", fork, 4, greedy, slot=2, fork_from=0))
    alone = engine.propose(ProposeParams("fresh", Commit(0, 0, tuple(text[:5] + [42])), 4, greedy))
    assert branch.tokens == alone.tokens and len(branch.tokens) == 4
    assert [t for t, _ in branch.alternatives] == [t for t, _ in alone.alternatives]
    assert all(t != d and 0 <= t for (t, _), d in zip(branch.alternatives, branch.tokens))
    assert core.session_tokens("s") == held  # the source slot is untouched
    assert core.session_tokens(slot_key("s", 2)) == text[:5] + [42] + branch.tokens[:-1]
    # A slot forked again is replaced, not appended to.
    engine.propose(ProposeParams("s", Commit(3, prefix_hash(text[:3]), (7,)), 1, greedy, slot=2, fork_from=0))
    assert core.session_tokens(slot_key("s", 2)) == text[:3] + [7]
    assert core.session_count() == 2 and len(core.store) == 3  # GetInfo and /metrics: branch slots are no sessions
    with pytest.raises(SessionNotFound):
        engine.propose(ProposeParams("s", fork, 2, greedy, slot=1, fork_from=3))
    with pytest.raises(CacheMismatch):
        engine.propose(ProposeParams("s", Commit(5, prefix_hash([1, 2, 3, 4, 5]), (42,)), 2, greedy,
                                     slot=1, fork_from=0))
    for slot, source in ((9, 0), (1, 1), (0, 9)):
        with pytest.raises(InvalidRequest):
            engine.propose(ProposeParams("s", fork, 2, greedy, slot=slot, fork_from=source))
    assert core.end_session("s")
    assert core.session_tokens("s") is None and core.session_tokens(slot_key("s", 2)) is None
    assert all(slot.pinned == 0 for slot in core.store._slots.values())
    # A fork of nothing (cache_len 0) from a slot the worker does not hold: the branch starts empty,
    # no empty source is made up (it was, marked the live slot, and the real branch a stale copy).
    nothing = engine.propose(ProposeParams("t", Commit(0, 0, (5, 6, 7)), 2, greedy, slot=1, fork_from=0))
    assert nothing.tokens == engine.propose(ProposeParams("u", Commit(0, 0, (5, 6, 7)), 2, greedy)).tokens
    assert core.session_tokens("t") is None and core.session_tokens(slot_key("t", 1)) == [5, 6, 7, nothing.tokens[0]]
    assert not core.store.peek(slot_key("t", 1)).stale


def test_branch_points_take_the_likeliest_rejections() -> None:
    from orchestrator.rounds import branch_points
    drafts, probs = [1, 2, 3, 4], [0.9, 0.5, 0.9, 0.9]
    alternatives = [(11, 0.05), (12, 0.4), (-1, 0.0), (14, 0.09)]
    # Paths: j=0 0.05; j=1 0.9*0.4 = 0.36; j=2 has no runner-up; j=3 0.9*0.5*0.9*0.09 = 0.036.
    assert branch_points(drafts, probs, alternatives, remaining=20, budget=2) == [(1, 12), (0, 11)]
    assert branch_points(drafts, probs, alternatives, remaining=20, budget=8) == [(1, 12), (0, 11), (3, 14)]
    assert branch_points(drafts, probs, alternatives, remaining=3, budget=8) == [(0, 11)]  # a round must follow
    assert branch_points(drafts, probs, alternatives, remaining=20, budget=0) == []
    assert branch_points([1], [0.9], [(1, 0.1)], remaining=20, budget=2) == []  # the runner-up is the draft


def test_the_cost_model_counts_branch_hits() -> None:
    stats = SessionStats()
    stats.timing.seed(40.0, {k: 300.0 + 5 * k for k in range(9)})
    stats.timing.draft_curve = ((1, 10.0), (9, 10.0))  # branches ride along for free (a GPU draft)
    stats.acceptance = Ewma(0.3, 0.6)
    stats.bonus_match, stats.branch_match = Ewma(0.2, 0.5), Ewma(0.2, 0.8)
    plain = CostModelPolicy.tokens_per_ms(stats, 3, True, 0)
    assert CostModelPolicy.tokens_per_ms(stats, 3, True, 2) > plain
    stats.timing.load.target_batch = Ewma(0.3, 4.0)  # other sessions on the pair: no branches
    assert CostModelPolicy.tokens_per_ms(stats, 3, True, 2) == pytest.approx(plain)
    stats.timing.load.target_batch = Ewma(0.3, 1.0)
    stats.timing.draft_curve = ((1, 10.0), (2, 30.0))  # no time for them beside the main pre-draft
    assert CostModelPolicy.tokens_per_ms(stats, 3, True, 2) == pytest.approx(plain)
    stats.timing.draft_curve = ((1, 10.0), (9, 10.0))
    assert CostModelPolicy.tokens_per_ms(stats, 0, True, 2) == CostModelPolicy.tokens_per_ms(stats, 0, False)
    stats.branch_match = Ewma(0.2, 0.0)  # branches never guess right: nothing gained
    assert CostModelPolicy.tokens_per_ms(stats, 3, True, 2) == pytest.approx(plain)
    assert SpeculationConfig().pipeline_branches == 2
    assert SpeculationConfig().with_override(SpeculationOverride(pipeline_branches=0)).pipeline_branches == 0
    assert SpeculationConfig(pipeline=True).make_policy().branches == 2
    for bad in (-1, 9, True, 1.5):
        with pytest.raises(Exception, match="pipeline_branches"):
            SpeculationConfig().with_values({"pipeline_branches": bad}, "test")


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0}], ids=["greedy", "t1"])
async def test_branch_predrafts_hit_and_change_no_token(sampling: dict) -> None:
    # (the draft worker advertises its branch slots; the orchestrator pre-drafts on branches only then)
    """With branches, rounds after a rejection whose correction was the draft's runner-up take their
    drafts from the branch at once, and the output is the serial output token for token (greedy: the
    target's own); with branches off, no such hit is counted. (A far target, 40 ms per call, gives
    the draft the idle time branches need: kpolicy.branch_budget.)"""
    stack = await start_stack(draft_ref="tiny:seed=0,noise=0.03", target_call_delay_ms=40.0)
    try:
        branch_hits = 0
        for seed in range(4):
            serial = await _generate(stack, False, max_new_tokens=40, seed=seed, **sampling)
            branched = await _generate(stack, True, max_new_tokens=40, seed=seed, **sampling,
                                       speculation={"fixed_k": 3, "pipeline": True})
            plain = await _generate(stack, True, max_new_tokens=40, seed=seed, **sampling,
                                    speculation={"fixed_k": 3, "pipeline": True, "pipeline_branches": 0})
            assert list(branched.token_ids) == list(serial.token_ids) == list(plain.token_ids), seed
            if not sampling:
                assert list(serial.token_ids) == reference_greedy(PROMPT, 40)
            assert plain.stats.predraft_branch_hits == 0
            assert branched.stats.predraft_branch_hits <= branched.stats.predraft_hits
            branch_hits += branched.stats.predraft_branch_hits
        assert branch_hits > 0
    finally:
        await stack.close()


async def test_branches_only_where_the_draft_worker_has_slots() -> None:
    """The draft advertises its branch slots in GetInfo (the target none); an orchestrator whose draft
    has none (an older worker) pre-drafts on no branch, and the output is the same."""
    from specdec.contract import MAX_BRANCH_SLOTS
    from specdec.v1 import common_pb2
    stack = await start_stack(draft_ref="tiny:seed=0,noise=0.03", target_call_delay_ms=40.0)
    try:
        assert (await draft_stub(stack).GetInfo(common_pb2.GetInfoRequest())).branch_slots == MAX_BRANCH_SLOTS
        assert (await target_stub(stack).GetInfo(common_pb2.GetInfoRequest())).branch_slots == 0
        engine = stack.orch.engine
        assert engine.draft_branch_slots == MAX_BRANCH_SLOTS
        slots: list[int] = []
        original = stack.draft.engine.propose_steps

        def spy(params):
            slots.append(params.slot)
            return original(params)
        stack.draft.engine.propose_steps = spy
        with_branches = await _generate(stack, True, max_new_tokens=40)
        assert any(slot > 0 for slot in slots)
        engine.draft_branch_slots, slots[:] = 0, []
        without = await _generate(stack, True, max_new_tokens=40)
        assert slots and all(slot == 0 for slot in slots) and without.stats.predraft_branch_hits == 0
        assert list(without.token_ids) == list(with_branches.token_ids) == reference_greedy(PROMPT, 40)
    finally:
        await stack.close()


def test_branch_budget_uses_only_the_time_the_draft_would_idle() -> None:
    from orchestrator.kpolicy import TimingModel, branch_budget
    timing = TimingModel()
    timing.seed(100.0, {k: 300.0 + 100.0 * k for k in range(9)})  # verify at k = 3: 600 ms
    timing.rtt_ms, timing.draft_rtt_ms = Ewma(0.2, 0.0), Ewma(0.2, 0.0)
    # A GPU-like draft: a forward over 3 rows costs what one does. 5 tokens = 500 ms fit in 600.
    timing.draft_curve = ((1, 10.0), (3, 10.0), (9, 11.0))
    assert branch_budget(timing, 3, 5, 2) == 2
    assert branch_budget(timing, 3, 5, 0) == 0 and branch_budget(timing, 0, 5, 2) == 0
    # A CPU-like draft whose forward grows with its rows: 2 rows 1.1x fits (550 ms), 3 rows 1.5x not.
    timing.draft_curve = ((1, 10.0), (2, 11.0), (3, 15.0), (9, 40.0))
    assert branch_budget(timing, 3, 5, 2) == 1
    # A draft slower than the verify: no branch, which would only delay the main pre-draft.
    timing.draft_ms_per_token = Ewma(0.2, 130.0)
    assert branch_budget(timing, 3, 5, 2) == 0
    # No calibration: rows are priced as linear, so branches need that much slack.
    timing.draft_curve, timing.draft_ms_per_token = (), Ewma(0.2, 40.0)
    assert timing.draft_rows_factor(3) == 3.0
    assert branch_budget(timing, 3, 5, 2) == 2  # 5 x 40 x 3 = 600 <= 600
    timing.draft_ms_per_token = Ewma(0.2, 45.0)
    assert branch_budget(timing, 3, 5, 2) == 1  # 5 x 45 x 2 = 450


async def test_a_draft_that_ignores_slots_turns_branches_off() -> None:
    """A draft worker that runs branch calls on the session's own cache (an older worker behind the
    same address, which knows no slots) is found out from the slot its reply names: branches stop
    for good, and the output is still the target's."""
    import dataclasses
    stack = await start_stack(draft_ref="tiny:seed=0,noise=0.03", target_call_delay_ms=40.0)
    try:
        original = stack.draft.engine.propose_steps
        forks: list[int] = []

        def old_worker(params):
            forks.append(params.slot)
            return original(dataclasses.replace(params, slot=0, fork_from=None))
        stack.draft.engine.propose_steps = old_worker
        reply = await _generate(stack, True, max_new_tokens=40)
        assert list(reply.token_ids) == reference_greedy(PROMPT, 40)
        assert any(slot > 0 for slot in forks) and stack.orch.engine.draft_branch_slots == 0
        # Off from the round that found out, not from the next turn: only that round's branches
        # (at most pipeline_branches, sent together) ever asked for a slot.
        assert sum(slot > 0 for slot in forks) <= SpeculationConfig().pipeline_branches
        forks.clear()
        reply = await _generate(stack, True, max_new_tokens=40)
        assert list(reply.token_ids) == reference_greedy(PROMPT, 40) and forks and set(forks) == {0}
    finally:
        await stack.close()


def test_stale_slot_copies_are_evicted_before_live_caches() -> None:
    """A branch not taken, and the slot a taken branch replaced, go first; the live cache stays,
    on whichever slot it is. Eviction went by 'is a branch key': after a taken branch it evicted
    the live cache and kept the stale copy on slot 0."""
    from draft_worker.engine import DraftEngine, ProposeParams
    from specdec.contract import Commit, SamplingConfig, prefix_hash, slot_key
    from specdec.models import load_model
    from specdec.worker_core import StoreLimits, WorkerCore

    core = WorkerCore(load_model("tiny:seed=0,noise=0.03"), "draft", StoreLimits(max_sessions=3))
    engine, greedy = DraftEngine(core), SamplingConfig()
    text = [5, 6, 7, 8, 9]
    engine.propose(ProposeParams("s", Commit(0, 0, tuple(text)), 2, greedy))
    fork = Commit(len(text), prefix_hash(text), (42,))
    taken = engine.propose(ProposeParams("s", fork, 2, greedy, slot=1, fork_from=0))  # pre-drafts
    engine.propose(ProposeParams("s", fork, 2, greedy, slot=2, fork_from=0))
    on_branch = text + [42] + taken.tokens[:1]
    engine.propose(ProposeParams("s", Commit(len(on_branch), prefix_hash(on_branch), (7,)), 2, greedy, slot=1))
    assert core.session_count() == 1 and len(core.store) == 3  # slot 1 took over the session
    engine.propose(ProposeParams("t", Commit(0, 0, (3, 4)), 2, greedy))
    engine.propose(ProposeParams("u", Commit(0, 0, (3, 4)), 2, greedy))  # each over max_sessions once
    assert slot_key("s", 1) in core.store and "t" in core.store and "u" in core.store
    assert "s" not in core.store and slot_key("s", 2) not in core.store
    assert core.session_count() == 3


def test_netbench_smoke_runs_every_system_and_reads_its_traces(tmp_path) -> None:
    """`specdec netbench --smoke` end to end (tiny models, real services): every system runs, the
    outputs match target-only's, and the round traces map onto the requests (ceiling reported)."""
    import json
    import subprocess
    import sys

    from specdec.tools.netreport import SYSTEMS
    result = subprocess.run([sys.executable, "-m", "specdec.cli", "netbench", "--smoke", "--latencies-ms", "0",
                             "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    (row,) = report["rows"]
    assert row["identical"] and row["ceiling_vs_serial"] > 0
    assert {r["system"] for r in report["runs"]} == set(SYSTEMS)
    assert "do not match" not in result.stdout
    config = (tmp_path / "orchestrator.toml").read_text()
    assert "\nguard = false\n" in config  # one guard for all systems: off
    assert '\noverlap_prefill = "auto"\n' in config and "pipelined_overlapped" in row  # what "pipelined" runs
    assert "\npipeline = true\n" in config  # the workers are apart: "auto" may act
    assert (tmp_path / "logs-0ms" / "orchestrator.log").exists()  # the services' logs stay with the results


async def test_pipelining_at_the_largest_k_asks_the_draft_for_no_more_than_it_serves(caplog) -> None:
    """A pre-draft asks for one more than its round's k: at max_k = MAX_K that was MAX_K + 1, which
    the draft refuses (INVALID_ARGUMENT), so every such pre-draft failed and was logged."""
    import logging

    from specdec.contract import MAX_K
    caplog.set_level(logging.INFO)
    stack = await start_stack()  # identical draft: every pre-draft hits
    asked: list[int] = []
    propose_steps = stack.draft.engine.propose_steps
    stack.draft.engine.propose_steps = lambda params: (asked.append(params.k), propose_steps(params))[1]
    try:
        prompt = [5, 6, 7, 8]
        reply = await stack.generate(prompt_ids=prompt, max_new_tokens=120,
                                     speculation={"fixed_k": MAX_K, "pipeline": True, "pipeline_branches": 0})
        assert list(reply.token_ids) == reference_greedy(prompt, 120)
        assert max(asked) == MAX_K and reply.stats.predraft_hits >= 2
        assert not [r for r in caplog.records if "failed" in r.getMessage() or "cannot serve" in r.getMessage()]
    finally:
        await stack.close()


async def test_pre_drafts_that_fail_count_as_neither_hit_nor_miss() -> None:
    """A pre-draft that failed tested nothing, also when the round then rejected (it was a miss)."""
    from specdec.errors import CapacityExceeded
    stack = await start_stack(draft_ref="tiny:seed=0,noise=0.02", target_call_delay_ms=30.0)
    backend = stack.orch.engine.workers.draft
    propose = backend.propose
    failed = []

    async def failing_predrafts(*args, **kwargs):
        task = asyncio.current_task()
        if task is not None and task.get_coro().__qualname__ == "Round._propose":  # a pre-draft's own task
            failed.append(1)
            raise CapacityExceeded("injected: the draft's queue is full")
        return await propose(*args, **kwargs)
    backend.propose = failing_predrafts
    try:
        prompt = [5, 6, 7, 8]
        reply = await stack.generate(prompt_ids=prompt, max_new_tokens=30,
                                     speculation={"fixed_k": 3, "pipeline": True, "pipeline_branches": 0})
        assert list(reply.token_ids) == reference_greedy(prompt, 30)
        assert len(failed) >= 3 and reply.stats.accepted_tokens < reply.stats.draft_tokens  # some rounds rejected
        assert reply.stats.predraft_hits == reply.stats.predraft_misses == 0
    finally:
        await stack.close()


async def test_bytes_sent_count_every_request_a_cancelled_pre_draft_included(monkeypatch: pytest.MonkeyPatch) -> None:
    """Request bytes were counted from the reply: a pre-draft cancelled by a rejecting verify never
    replied, so pipelined bytes_to_draft came out at about half of what was sent."""
    from orchestrator import clients
    sent = {"draft": 0, "target": 0}
    cancelled = [0]
    original = clients._WorkerClient._call

    async def counting_call(self, method, request, timeout_s):
        if type(request).__name__ in ("ProposeRequest", "VerifyRequest"):
            sent[self.role] += request.ByteSize()
        try:
            return await original(self, method, request, timeout_s)
        except asyncio.CancelledError:
            cancelled[0] += 1
            raise
    monkeypatch.setattr(clients._WorkerClient, "_call", counting_call)
    stack = await start_stack(draft_ref="tiny:seed=1", draft_call_delay_ms=5.0,
                              speculation=SpeculationConfig(policy="fixed", fixed_k=4))
    try:
        for spec in ({}, {"pipeline": True, "pipeline_branches": 2}):
            sent.update(draft=0, target=0)
            reply = await stack.generate(prompt_ids=list(range(5, 45)), max_new_tokens=60, seed=1, temperature=1.0,
                                         speculation=spec)
            assert (reply.stats.bytes_to_draft, reply.stats.bytes_to_target) == (sent["draft"], sent["target"])
        assert cancelled[0] > 0  # the pipelined turn had pre-drafts dropped in flight
    finally:
        await stack.close()


def test_a_cache_copy_holds_only_the_prefix_and_shares_nothing() -> None:
    """copy_cache (a branch slot's fork) copies the first `length` positions only, into tensors of
    its own; the source keeps its cache; the copy computes what the prefix alone would."""
    import torch

    from specdec.models import copy_cache, load_model, new_cache

    model = load_model("tiny:seed=0").model
    cache = new_cache(model)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    model(input_ids=ids, past_key_values=cache, use_cache=True)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    copied = copy_cache(cache, 5)
    assert copied.get_seq_length() == 5 and cache.get_seq_length() == 8
    for layer, mine, (keys, values) in zip(cache.layers, copied.layers, before):
        assert mine.keys.shape[-2] == mine.values.shape[-2] == 5
        assert mine.keys.untyped_storage().nbytes() == mine.keys.numel() * mine.keys.element_size()  # no whole copy kept
        assert mine.keys.untyped_storage().data_ptr() != layer.keys.untyped_storage().data_ptr()
        assert torch.equal(mine.keys, keys[..., :5, :]) and torch.equal(mine.values, values[..., :5, :])
    extra = torch.tensor([[42]])
    branched = model(input_ids=extra, past_key_values=copied, use_cache=True).logits
    fresh = new_cache(model)
    model(input_ids=ids[:, :5], past_key_values=fresh, use_cache=True)
    torch.testing.assert_close(branched, model(input_ids=extra, past_key_values=fresh, use_cache=True).logits)
    for layer, (keys, values) in zip(cache.layers, before):  # the source is untouched by the copy's growth
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)


def test_a_cache_copy_of_sliding_window_layers_is_the_prefix_too() -> None:
    """Sliding-window layers keep a length of their own: copied whole and cropped by their rules (a
    K/V slice alone left that length behind, and the crop that follows cut every layer again)."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    from specdec.models import copy_cache, new_cache

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=16, max_position_embeddings=128)
    model = MistralForCausalLM(config).eval()
    ids, extra = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]]), torch.tensor([[42]])
    with torch.inference_mode():
        cache = new_cache(model)
        assert any(type(layer).__name__ != "DynamicLayer" for layer in cache.layers)  # sliding layers
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        copied = copy_cache(cache, 5)
        assert copied.get_seq_length() == 5 and cache.get_seq_length() == 8
        fresh = new_cache(model)
        model(input_ids=ids[:, :5], past_key_values=fresh, use_cache=True)
        torch.testing.assert_close(model(input_ids=extra, past_key_values=copied, use_cache=True).logits,
                                   model(input_ids=extra, past_key_values=fresh, use_cache=True).logits)


def test_a_branch_near_the_end_of_the_context_drafts_as_the_session_would() -> None:
    """A fork reserved room for all k drafts and refused past the context (INVALID_ARGUMENT), where
    the session's own slot drafts up to the context's end: the same commit on a branch is no error."""
    from draft_worker.engine import DraftEngine, ProposeParams
    from specdec.contract import Commit, SamplingConfig, prefix_hash
    from specdec.errors import InvalidRequest
    from specdec.models import load_model
    from specdec.worker_core import WorkerCore

    engine = DraftEngine(WorkerCore(load_model("tiny:seed=0,max_positions=64"), "draft"))
    assert engine.core.max_context == 64
    text = [5 + i % 50 for i in range(61)]
    engine.propose(ProposeParams("s", Commit(0, 0, tuple(text)), 1, SamplingConfig()))
    commit = Commit(60, prefix_hash(text[:60]), (text[60],))
    branch = engine.propose(ProposeParams("s", commit, 8, SamplingConfig(), slot=1, fork_from=0))
    alone = engine.propose(ProposeParams("s", commit, 8, SamplingConfig()))
    assert branch.tokens == alone.tokens and 0 < len(branch.tokens) < 8
    with pytest.raises(InvalidRequest, match="exceeds the model context"):  # what is fed must fit
        engine.propose(ProposeParams("s", Commit(60, prefix_hash(text[:60]), tuple(text[60:]) + (7,) * 4), 1,
                                     SamplingConfig(), slot=2, fork_from=0))


def test_a_cropped_cache_counts_the_memory_it_still_holds() -> None:
    """A crop leaves views of the longer tensors (freed at the next forward's concatenation): the
    KV budget counts what is held, not only the positions kept."""
    import torch

    from specdec.models import cache_nbytes, crop_cache, load_model, new_cache

    model = load_model("tiny:seed=0").model
    cache = new_cache(model)
    model(input_ids=torch.tensor([list(range(5, 25))]), past_key_values=cache, use_cache=True)
    full = cache_nbytes(cache)
    crop_cache(cache, 12)
    assert cache_nbytes(cache) == full  # still held
    model(input_ids=torch.tensor([[7]]), past_key_values=cache, use_cache=True)
    assert cache_nbytes(cache) == full * 13 // 20  # the concatenation copied 13 positions; the rest freed


async def test_pre_drafts_stay_inside_a_shorter_draft_context(caplog: pytest.LogCaptureFixture) -> None:
    """A draft whose context is shorter than the target's: the round's k stops at it (the engine), and
    the pre-drafts and branches that run ahead of the canonical tokens stop there too (the draft
    worker clamps k to its context: no refusal, no warning). Past its end the turn runs target-only,
    token-identical."""
    draft_context = 64
    stack = await start_stack(draft_ref=f"tiny:seed=0,max_positions={draft_context}",
                              speculation=SpeculationConfig(pipeline=True, pipeline_branches=2))
    prompt = list(range(3, 3 + 42))  # rounds of 5 tokens reach 62: k = 2 there, and a pre-draft from 64
    positions: list[int] = []  # how far into its context each draft forward reached

    def record(module: object, args: tuple, kwargs: dict) -> None:
        ids, past = kwargs.get("input_ids"), kwargs.get("past_key_values")
        if ids is not None and past is not None:
            positions.append(past.get_seq_length() + ids.shape[-1])
    hook = stack.draft.core.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with caplog.at_level("WARNING", logger="orchestrator.rounds"):
            reply = await stack.generate(prompt_ids=prompt, max_new_tokens=40, speculation={"fixed_k": 4})
        assert list(reply.token_ids) == reference_greedy(prompt, 40)
        assert reply.stats.draft_tokens > 0 and reply.stats.predraft_hits > 0  # it pipelined while there was room
        assert positions and max(positions) <= draft_context, max(positions)
        assert "draft cannot serve" not in caplog.text, caplog.text
    finally:
        hook.remove()
        await stack.close()


async def test_a_second_cancellation_while_settling_still_cancels_the_main_pre_draft() -> None:
    """settle() awaited the branches before it cancelled the main pre-draft: a cancellation of the
    turn during that wait left the pre-draft's draft call running past its turn, untracked."""
    from orchestrator.rounds import Round, _Branch, _Calls, _PreDraft
    round_ = Round.__new__(Round)

    async def slow_to_cancel() -> None:  # a branch whose cancellation takes a moment (gRPC teardown)
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            await asyncio.sleep(0.05)
            raise
    ahead = _PreDraft([], _Calls(), asyncio.create_task(asyncio.sleep(10)), 0.0)
    branch = _Branch([], 0, 0, 1, _Calls(), asyncio.create_task(slow_to_cancel()), 0.0)
    round_._ahead, round_._branches = ahead, [branch]
    await asyncio.sleep(0)
    settling = asyncio.create_task(round_.settle())
    await asyncio.sleep(0.01)
    settling.cancel()
    with pytest.raises(asyncio.CancelledError):
        await settling
    await asyncio.sleep(0)
    assert ahead.task.cancelled() and not round_.predraft_pending


@pytest.mark.parametrize("which", ["branch", "main"])
async def test_a_pre_draft_that_fails_with_a_bug_is_logged_with_its_traceback_and_changes_no_token(caplog, which) -> None:
    """A branch's failure was dropped without a trace (caught nowhere, and cancelled after it ended);
    the main pre-draft's was an INFO line without one."""
    import logging
    stack = await start_stack(draft_ref="tiny:seed=0,noise=0.02", target_call_delay_ms=30.0)
    backend = stack.orch.engine.workers.draft
    propose = backend.propose

    async def failing(*args, slot=0, fork_from=None, **kwargs):
        task = asyncio.current_task()
        predraft = task is not None and task.get_coro().__qualname__ == "Round._propose"
        if (fork_from is not None) if which == "branch" else (predraft and fork_from is None):
            raise RuntimeError(f"injected bug in a {which} pre-draft")
        return await propose(*args, slot=slot, fork_from=fork_from, **kwargs)
    backend.propose = failing
    try:
        prompt = [5, 6, 7, 8]
        speculation = {"fixed_k": 3, "pipeline": True} | ({} if which == "branch" else {"pipeline_branches": 0})
        reply = await stack.generate(prompt_ids=prompt, max_new_tokens=30, speculation=speculation)
        assert list(reply.token_ids) == reference_greedy(prompt, 30)
        logged = [r for r in caplog.records if r.levelno >= logging.ERROR and r.exc_info
                  and "injected bug" in str(r.exc_info[1])]
        assert logged
    finally:
        await stack.close()


def test_a_hits_hidden_draft_time_is_not_taken_off_the_overhead() -> None:
    from orchestrator.api import GenerationStats
    from orchestrator.record import RoundRecord
    base = {f: 0 for f in RoundRecord.__dataclass_fields__} | {
        "session_id": "s", "policy": "cost", "drafts": (1, 2), "draft_probs": (), "draft_confidences": (),
        "emitted": (1, 2, 3), "text_delta": "", "finish": None, "fallback": False, "greedy": True, "guard": ""}
    stats = GenerationStats()
    stats.observe(RoundRecord(**{**base, "draft_ms": 30.0, "verify_ms": 40.0, "predraft_hit": None}))
    stats.observe(RoundRecord(**{**base, "draft_ms": 30.0, "verify_ms": 40.0, "predraft_hit": True}))
    stats.total_ms = 30.0 + 40.0 + 40.0 + 12.0  # the hit's draft ran during the first verify
    assert stats.draft_ms == 60.0  # compute, as the reply's field says
    assert stats.overhead_ms == pytest.approx(12.0)
