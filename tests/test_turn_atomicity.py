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
from orchestrator.api import GenerateParams
from orchestrator.engine import GenerationEngine
from orchestrator.rounds import DraftHealth
from specdec.errors import DeadlineExceeded, InvalidRequest, WorkerUnavailable
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
