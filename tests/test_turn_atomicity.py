"""A turn is all or nothing, one slow or broken worker call costs one round, worker errors keep their meaning.

Real gRPC servers on 127.0.0.1; faults are injected by wrapping the workers' engines.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from orchestrator.backends import DraftReply, VerifyReply, WorkerDescription
from orchestrator.config import SpeculationOverride
from orchestrator.api import EngineLimits, GenerateParams
from orchestrator.engine import GenerationEngine
from orchestrator.rounds import DraftHealth
from specdec.errors import CapacityExceeded, DeadlineExceeded, InvalidRequest, WorkerUnavailable
from specdec.models import ByteTokenizer
from specdec.v1 import common_pb2
from tests.stack import cancel_stream_after, request, start_stack
from tests.test_e2e_generate import reference_greedy

TURNS = [[5, 6, 7, 8, 9, 10], [40, 41, 42], [90, 91]]
NEW = 24
SPEC = {"fixed_k": 3}


def fail_on_call(obj: Any, method: str, call_number: int, error: Callable[[], BaseException]) -> list[int]:
    """Make obj.method raise error() on its call_number-th call (1-based); returns the call counter."""
    original = getattr(obj, method)
    calls = [0]

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == call_number:
            raise error()
        return original(*args, **kwargs)
    setattr(obj, method, wrapped)
    return calls


async def run_turns(stack, session_id: str, **fields: Any) -> list[list[int]]:
    out = []
    for turn in TURNS:
        reply = await stack.generate(prompt_ids=turn, max_new_tokens=NEW, session_id=session_id,
                                     speculation=SPEC, **fields)
        out.append(list(reply.token_ids))
    return out


async def test_cancelled_turn_leaves_the_session_as_before(disagreeing_stack) -> None:
    stack = disagreeing_stack
    reference = await run_turns(stack, "reference")
    first = await stack.generate(prompt_ids=TURNS[0], max_new_tokens=NEW, session_id="s", speculation=SPEC)
    session = stack.orch.engine.sessions.get("s")
    before = list(session.tokens)
    await cancel_stream_after(stack, 4, prompt_ids=TURNS[1], max_new_tokens=NEW, session_id="s", speculation=SPEC)
    for _ in range(200):
        if not session.lock.locked():
            break
        await asyncio.sleep(0.01)
    assert session.tokens == before  # no prompt, no partial output kept
    rest = [list((await stack.generate(prompt_ids=turn, max_new_tokens=NEW, session_id="s",
                                       speculation=SPEC)).token_ids) for turn in TURNS[1:]]
    assert [list(first.token_ids)] + rest == reference


def _learned(stats) -> tuple:
    t = stats.timing
    return (stats.acceptance.value, stats.typical.value, stats.rounds, stats.last_k, stats.last_accepted,
            stats.bonus_match.value, t.draft_ms_per_token.value, sorted((k, e.value) for k, e in t.verify_by_k.items()),
            sorted((k, v[0], v[1]) for k, v in stats.arms.items()))


async def test_a_failed_turn_teaches_neither_the_session_nor_the_pair(disagreeing_stack) -> None:
    """A turn retried with the same seed reuses its uniforms, so what the failed attempt's rounds
    accepted must not choose the retry's k (that would key k to the very uniforms the retry then
    uses: a biased retry). A cancelled turn leaves the session's statistics and the pair's prior as
    they were; a completed one teaches both."""
    stack = disagreeing_stack
    engine = stack.orch.engine
    await stack.generate(prompt_ids=TURNS[0], max_new_tokens=NEW, session_id="s", seed=3, temperature=1.0)
    session, prior = engine.sessions.get("s"), engine.prior_for("s")
    before, prior_before = _learned(session.stats), _learned(prior)
    assert session.stats.rounds > 0
    await cancel_stream_after(stack, 6, prompt_ids=TURNS[1], max_new_tokens=NEW, session_id="s", seed=4,
                              temperature=1.0)
    for _ in range(1000):
        if not session.lock.locked():
            break
        await asyncio.sleep(0.01)
    assert not session.lock.locked()
    assert _learned(session.stats) == before and _learned(prior) == prior_before
    assert session.stats.timing.load is prior.timing.load  # the pair's live load stays shared
    await stack.generate(prompt_ids=TURNS[1], max_new_tokens=NEW, session_id="s", seed=4, temperature=1.0)
    assert session.stats.rounds > before[2] and _learned(prior) != prior_before


@pytest.mark.parametrize("worker,method,call_number", [("target", "verify_steps", 4), ("draft", "propose_steps", 4)])
async def test_worker_error_mid_generation_then_retry_equals_a_session_that_never_failed(
        disagreeing_stack, worker: str, method: str, call_number: int) -> None:
    stack = disagreeing_stack
    reference = await run_turns(stack, "reference")
    first = await stack.generate(prompt_ids=TURNS[0], max_new_tokens=NEW, session_id="s", speculation=SPEC)
    session = stack.orch.engine.sessions.get("s")
    before = list(session.tokens)
    servicer = stack.target if worker == "target" else stack.draft
    fail_on_call(servicer.engine, method, call_number, lambda: RuntimeError("injected bug"))
    started = time.monotonic()
    second = None
    try:
        second = await stack.generate(prompt_ids=TURNS[1], max_new_tokens=NEW, session_id="s", speculation=SPEC)
    except grpc.aio.AioRpcError as err:
        # A target's INTERNAL is a bug: reported as INTERNAL at once, not retried as an outage.
        assert worker == "target" and err.code() == grpc.StatusCode.INTERNAL, err
        assert "target worker" in err.details()
        assert time.monotonic() - started < 5.0
        assert session.tokens == before
        second = await stack.generate(prompt_ids=TURNS[1], max_new_tokens=NEW, session_id="s", speculation=SPEC)
    else:
        # A draft's INTERNAL costs that round its drafts, and does not mark the draft unhealthy.
        assert worker == "draft" and second.stats.fallback_rounds == 1
        assert not stack.orch.engine.draft_degraded
    third = await stack.generate(prompt_ids=TURNS[2], max_new_tokens=NEW, session_id="s", speculation=SPEC)
    assert [list(first.token_ids), list(second.token_ids), list(third.token_ids)] == reference


async def test_failed_chat_turn_keeps_the_history(stack) -> None:
    await stack.generate(messages=[("user", "hello")], max_new_tokens=8, session_id="chat")
    session = stack.orch.engine.sessions.get("chat")
    messages, tokens = [dict(m) for m in session.messages], list(session.tokens)
    fail_on_call(stack.target.engine, "verify_steps", 3, lambda: RuntimeError("injected bug"))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.generate(messages=[("user", "again")], max_new_tokens=8, session_id="chat")
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert session.messages == messages and session.tokens == tokens


async def test_draft_invalid_request_runs_the_round_target_only(stack) -> None:
    fail_on_call(stack.draft.engine, "propose_steps", 2, lambda: InvalidRequest("injected: cannot serve"))
    reply = await stack.generate(prompt_ids=TURNS[0], max_new_tokens=NEW, speculation=SPEC)
    assert list(reply.token_ids) == reference_greedy(TURNS[0], NEW)
    assert reply.stats.fallback_rounds == 1 and reply.stats.draft_tokens > 0
    assert not stack.orch.engine.draft_degraded


async def test_a_draft_that_refuses_the_re_prefill_too_runs_the_round_target_only(stack) -> None:
    """NOT_FOUND, then NOT_FOUND again for the re-prefill: a draft bug. It failed the turn with
    NOT_FOUND (the caller's session blamed); now that round runs target-only and the next re-prefills."""
    from specdec.errors import SessionNotFound
    fail_on_call(stack.draft.engine, "propose_steps", 2, lambda: SessionNotFound("injected: lost"))
    fail_on_call(stack.draft.engine, "propose_steps", 3, lambda: SessionNotFound("injected: lost again"))
    reply = await stack.generate(prompt_ids=TURNS[0], max_new_tokens=NEW, speculation=SPEC)
    assert list(reply.token_ids) == reference_greedy(TURNS[0], NEW)
    assert reply.stats.fallback_rounds == 1 and reply.stats.reprefills >= 1 and reply.stats.draft_tokens > 0


async def test_draft_with_a_shorter_context_drafts_only_within_it() -> None:
    stack = await start_stack(draft_ref="tiny:seed=0,noise=0.04,max_positions=48")
    try:
        prompt = list(range(1, 41))
        reply = await stack.generate(prompt_ids=prompt, max_new_tokens=30, speculation=SPEC)
        assert list(reply.token_ids) == reference_greedy(prompt, 30)
        assert reply.stats.draft_tokens > 0 and reply.stats.fallback_rounds == 0
        assert stack.draft.core.counters.calls > 0
        # Past the draft's 48 positions every round was target-only (k = 0), not an error.
        assert reply.stats.k_per_round[-1] == 0
    finally:
        await stack.close()


async def test_tiny_temperature_is_greedy(stack) -> None:
    for temperature in (1e-38, 1e-30, 1e-6):
        reply = await stack.generate(prompt_ids=TURNS[0], max_new_tokens=NEW, temperature=temperature,
                                     speculation=SPEC)
        assert list(reply.token_ids) == reference_greedy(TURNS[0], NEW)


async def test_end_session_waits_for_the_turn_in_flight(stack) -> None:
    call = stack.stub.GenerateStream(request(prompt_ids=TURNS[0], max_new_tokens=200, session_id="busy",
                                             speculation=SPEC), timeout=60)
    chunks = call.__aiter__()
    await chunks.__anext__()  # the turn is running
    ended = asyncio.ensure_future(stack.stub.EndSession(common_pb2.EndSessionRequest(session_id="busy"), timeout=60))
    total = 0
    async for chunk in chunks:
        total += len(chunk.token_ids)
        assert not ended.done()  # EndSession is queued behind the running turn
    assert (await ended).existed
    assert stack.orch.engine.sessions.get("busy") is None
    for _ in range(100):
        if "busy" not in stack.draft.core.store and "busy" not in stack.target.core.store:
            break
        await asyncio.sleep(0.02)
    assert "busy" not in stack.draft.core.store and "busy" not in stack.target.core.store


async def test_draft_cost_is_measured_when_every_round_is_fully_accepted(stack) -> None:
    # Identical models: every round accepts all k drafts, so the next commit catches the draft up by two
    # tokens. The per-token drafting cost is timed apart from that catch-up and still observed.
    await stack.generate(prompt_ids=TURNS[0], max_new_tokens=40, session_id="full", speculation={"fixed_k": 4})
    session = stack.orch.engine.sessions.get("full")
    assert session.stats.acceptance.value > 0.95
    rounds = session.stats.rounds
    assert rounds >= 6 and session.stats.timing.draft_ms_per_token.observations == rounds


# ----------------------------------------------------------------------------- engine level (fake workers)

class _SlowOnceDraft:
    """Times out on its second call; records every commit it is sent."""

    def __init__(self) -> None:
        self.commits: list[Any] = []

    async def propose(self, session_id, commit, k, sampling, min_draft_prob, timeout_s, slot=0, fork_from=None):
        self.commits.append(commit)
        if len(self.commits) == 2:
            raise DeadlineExceeded("draft call took longer than the draft timeout")
        held = commit.cache_len + len(commit.append_tokens) + k - 1
        return DraftReply([7] * k, [0.9] * k, held, 1.0, len(commit.append_tokens))

    async def end_session(self, session_id):
        return True


class _EchoTarget:
    async def verify(self, session_id, commit, draft_tokens, q_payload, sampling, timeout_s):
        held = commit.cache_len + len(commit.append_tokens) + len(draft_tokens)
        return VerifyReply(len(draft_tokens), 7, held, 1.0, len(commit.append_tokens))

    async def end_session(self, session_id):
        return True


async def test_a_draft_timeout_does_not_re_prefill_the_prefix() -> None:
    draft = _SlowOnceDraft()
    engine = GenerationEngine(draft, _EchoTarget(), ByteTokenizer(),
                              WorkerDescription("target", "fake", 260, 4096, [257]))
    engine.draft_health.entries["draft"] = DraftHealth(initial_s=0.0)  # retry the draft on the next round
    prompt = tuple(range(1, 201))
    params = GenerateParams(prompt_ids=prompt, max_new_tokens=12, speculation=SpeculationOverride(fixed_k=3))
    async for _ in engine.generate(params):
        pass
    assert len(draft.commits) >= 3
    after_timeout = draft.commits[2]
    # The draft is still believed to hold the prefix it was sent before the slow call.
    assert after_timeout.cache_len >= draft.commits[1].cache_len >= len(prompt) - 1
    assert len(after_timeout.append_tokens) <= 8


class _FullTarget(_EchoTarget):
    """Answers RESOURCE_EXHAUSTED (a full queue, with a retry hint) on the given verify calls."""

    def __init__(self, full_on: set[int], hint_ms: int | None = 30) -> None:
        self.calls, self.full_on, self.hint_ms = 0, full_on, hint_ms

    async def verify(self, session_id, commit, draft_tokens, q_payload, sampling, timeout_s):
        self.calls += 1
        if self.calls in self.full_on:
            raise CapacityExceeded("target worker queue is full", retry_after_ms=self.hint_ms)
        return await super().verify(session_id, commit, draft_tokens, q_payload, sampling, timeout_s)


async def test_a_full_target_mid_turn_is_waited_out_not_a_failed_turn() -> None:
    """RESOURCE_EXHAUSTED from the target after the turn has streamed tokens is retried after its hint
    (failing would drop the streamed output); before the first token, or without a hint (a KV budget
    that cannot hold the session: waiting is not known to help), it reaches the caller at once."""
    def engine_for(target):
        engine = GenerationEngine(_SlowOnceDraft(), target, ByteTokenizer(),
                                  WorkerDescription("target", "fake", 260, 4096, [257]))
        engine.draft_health.entries["draft"] = DraftHealth(initial_s=0.0)
        return engine
    params = GenerateParams(prompt_ids=(5, 6, 7), max_new_tokens=12, speculation=SpeculationOverride(fixed_k=0))
    mid = _FullTarget({3, 4})
    tokens = [t async for event in engine_for(mid).generate(params) for t in event.token_ids]
    assert len(tokens) == 12 and mid.calls == 14  # 12 rounds of k = 0, the third refused twice
    for target in (_FullTarget({1}), _FullTarget({3}, hint_ms=None)):
        with pytest.raises(CapacityExceeded, match="queue is full"):
            async for _ in engine_for(target).generate(params):
                pass
        assert target.calls == min(target.full_on)


class _PrefillBoundDraft:
    """A draft whose calls take 1 ms per appended token: one whose timeout is shorter raises
    DeadlineExceeded after the timeout, but holds the tokens it was sent by then (the worker's forward
    runs on), as a real worker does."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, float]] = []
        self.held: list[int] = []

    async def propose(self, session_id, commit, k, sampling, min_draft_prob, timeout_s, slot=0, fork_from=None):
        self.calls.append((commit, timeout_s))
        tokens = self.held[:commit.cache_len] + list(commit.append_tokens)
        self.held = tokens
        if len(commit.append_tokens) * 0.001 > timeout_s:
            await asyncio.sleep(timeout_s)
            raise DeadlineExceeded("draft call took longer than the draft timeout")
        return DraftReply([7] * k, [0.9] * k, len(tokens) + k - 1, 1.0, len(commit.append_tokens))

    async def end_session(self, session_id):
        return True


async def test_a_long_prompt_gets_time_for_the_drafts_prefill_beyond_the_draft_timeout() -> None:
    """A prompt whose draft prefill outlasts draft_timeout_s was abandoned, resent whole from
    cache_len 0 the next round and abandoned again: the session never speculated, each round waited
    the whole timeout, and the draft went into backoff for everyone. The call now gets time for the
    prefill (a multiple of its expected cost); calls that append a few tokens keep the plain timeout."""
    draft = _PrefillBoundDraft()
    limits = EngineLimits(draft_timeout_s=0.2)
    engine = GenerationEngine(draft, _EchoTarget(), ByteTokenizer(),
                              WorkerDescription("target", "fake", 260, 4096, [257]), limits=limits)
    prompt = tuple(1 + i % 250 for i in range(400))  # 0.4 s of prefill at 1 ms a token
    params = GenerateParams(prompt_ids=prompt, max_new_tokens=12, speculation=SpeculationOverride(fixed_k=3))
    started = time.monotonic()
    async for _ in engine.generate(params):
        pass
    assert time.monotonic() - started < 5.0
    first_commit, first_timeout = draft.calls[0]
    assert len(first_commit.append_tokens) == len(prompt) and first_timeout > 0.4
    assert all(timeout == pytest.approx(0.2, abs=0.01) for commit, timeout in draft.calls[1:]
               if len(commit.append_tokens) <= 16)
    assert all(commit.cache_len >= len(prompt) - 1 for commit, _ in draft.calls[1:])  # never resent whole
    assert not engine.draft_degraded


def test_a_commit_resending_tokens_the_worker_holds_feeds_only_the_rest() -> None:
    """A call that timed out or was cancelled after its forwards leaves the caller unsure how far it
    got, so it resends from what it knows the worker holds. The worker keeps what it holds of those
    tokens and feeds the rest: a long prefill resent from cache_len 0 does not start over, and what
    it drafts is what a fresh session drafts."""
    from draft_worker.engine import DraftEngine, ProposeParams
    from specdec.contract import Commit, SamplingConfig
    from specdec.models import load_model
    from specdec.worker_core import WorkerCore

    engine = DraftEngine(WorkerCore(load_model("tiny:seed=0,noise=0.03"), "draft"))
    greedy = SamplingConfig()
    text = list(range(5, 45))
    engine.propose(ProposeParams("s", Commit(0, 0, tuple(text)), 1, greedy))
    again = engine.propose(ProposeParams("s", Commit(0, 0, tuple(text + [42])), 3, greedy))
    fresh = engine.propose(ProposeParams("fresh", Commit(0, 0, tuple(text + [42])), 3, greedy))
    assert again.stats.prefilled_tokens == 1 and again.stats.fed_tokens == 1 + 2  # [42], then 2 drafts
    assert fresh.stats.prefilled_tokens == len(text) + 1
    assert again.tokens == fresh.tokens and again.cache_len == fresh.cache_len
    # A resent prefix that differs from what is held past cache_len is fed from the first difference.
    other = engine.propose(ProposeParams("s", Commit(0, 0, tuple(text[:10] + [99] + text[11:])), 2, greedy))
    alone = engine.propose(ProposeParams("alone", Commit(0, 0, tuple(text[:10] + [99] + text[11:])), 2, greedy))
    assert other.stats.prefilled_tokens == len(text) - 10 and other.tokens == alone.tokens


async def test_a_forward_that_fails_halfway_leaves_no_stray_cache_entries(disagreeing_stack, monkeypatch) -> None:
    """A failure inside the model (after some layers appended to the KV cache) must not leave those
    entries behind: the next turn re-prefills and equals a session that never failed."""
    stack = disagreeing_stack
    reference = await run_turns(stack, "reference")
    first = await stack.generate(prompt_ids=TURNS[0], max_new_tokens=NEW, session_id="s", speculation=SPEC)
    layer = stack.target.core.model.model.layers[1]
    original = layer.forward
    calls = [0]

    def fail_once(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("injected failure inside the forward")
        return original(*args, **kwargs)
    monkeypatch.setattr(layer, "forward", fail_once)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.generate(prompt_ids=TURNS[1], max_new_tokens=NEW, session_id="s", speculation=SPEC)
    assert err.value.code() == grpc.StatusCode.INTERNAL
    rest = [list((await stack.generate(prompt_ids=turn, max_new_tokens=NEW, session_id="s",
                                       speculation=SPEC)).token_ids) for turn in TURNS[1:]]
    assert [list(first.token_ids)] + rest == reference


# ----------------------------------------------------------------------------- draft health per replica

def test_one_outage_seen_by_many_sessions_is_one_backoff_step(monkeypatch) -> None:
    """Eight sessions' calls in flight when a draft blips fail together: one outage, the first backoff
    (0.5 s), not 2^7 of it (capped at 30 s: target-only for 30 s after a blip)."""
    from orchestrator import rounds
    now = [100.0]
    monkeypatch.setattr(rounds.time, "monotonic", lambda: now[0])
    health = DraftHealth()
    for _ in range(8):
        health.failed()
    assert health.failures == 8 and not health.usable()
    now[0] += 0.5
    assert health.usable()
    health.failed()  # the retry after the backoff failed: the outage goes on, the wait doubles
    now[0] += 0.5
    assert not health.usable()
    now[0] += 0.5
    assert health.usable()


async def test_draft_health_counts_only_replicas_in_use_and_reports_changes() -> None:
    from orchestrator.rounds import DraftHealthBoard
    current = {"a", "b"}
    board = DraftHealthBoard(lambda session_id: session_id[0], lambda: current)
    reported: list[bool] = []

    async def record(degraded: bool) -> None:
        reported.append(degraded)
    board.on_change = record
    board.for_session("a1").failed()
    await board.report()
    await board.report()
    assert board.degraded and reported == [True]  # once per change
    current = {"b", "c"}  # the dead pod was replaced (a new address): its backoff no longer counts
    await board.report()
    assert not board.degraded and reported == [True, False]


class _Ring:
    def __init__(self, nodes: list[str]) -> None:
        self.nodes = tuple(nodes)

    def node_for(self, session_id: str) -> str:
        return self.nodes[0]


class _DraftLeavingMidCall:
    """A routed draft whose only replica leaves discovery during a call (its channel closes)."""

    def __init__(self) -> None:
        self.pool = type("Pool", (), {"ring": _Ring(["old:1"]), "in_use": lambda pool: set(pool.ring.nodes)})()

    def node_for(self, session_id: str) -> str:
        return self.pool.ring.node_for(session_id)

    async def propose(self, session_id, commit, k, sampling, min_draft_prob, timeout_s, slot=0, fork_from=None):
        if self.pool.ring.nodes == ("old:1",):
            self.pool.ring = _Ring(["new:1"])
            raise WorkerUnavailable("CANCELLED: channel closed")
        held = commit.cache_len + len(commit.append_tokens) + k - 1
        return DraftReply([7] * k, [0.9] * k, held, 1.0, len(commit.append_tokens))

    async def end_session(self, session_id):
        return True


async def test_a_failed_draft_call_is_charged_to_the_replica_it_went_to() -> None:
    engine = GenerationEngine(_DraftLeavingMidCall(), _EchoTarget(), ByteTokenizer(),
                              WorkerDescription("target", "fake", 260, 4096, [257]))
    params = GenerateParams(prompt_ids=(1, 2, 3), max_new_tokens=8, speculation=SpeculationOverride(fixed_k=3))
    async for event in engine.generate(params):
        pass
    health = engine.draft_health.entries
    assert health["old:1"].failures == 1 and health["new:1"].failures == 0
    assert event.stats.fallback_rounds == 1 and not engine.draft_degraded  # the new replica drafts at once
