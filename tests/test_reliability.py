"""Faults, deadlines, cancellation, bounded memory, admission, bad input, load, graceful shutdown.

Every server is a real gRPC server on 127.0.0.1; crashes and SIGTERM use real processes."""
from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.app import DRAFT_HEALTH_NAME, OrchestratorConfig, start_orchestrator
from orchestrator.backends import DraftReply, VerifyReply, WorkerDescription
from orchestrator.config import SpeculationOverride
from orchestrator.api import EngineLimits, GenerateParams, GenerationEvent
from orchestrator.engine import GenerationEngine
from orchestrator.kpolicy import SessionStats
from specdec.errors import DeadlineExceeded, SessionBusy, WorkerUnavailable
from specdec.tools.loadtest import run_load
from specdec.models import ByteTokenizer
from specdec.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc, worker_pb2, worker_pb2_grpc
from specdec.worker_core import StoreLimits
from tests.procs import aspawn, aspawn_worker, stop
from tests.stack import cancel_stream_after, request, start_stack, start_worker, target_stub
from tests.test_e2e_generate import reference_greedy

PROMPT = [11, 22, 33, 44, 55]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def health_of(channel: grpc.aio.Channel, service: str = "") -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return reply.status


async def stream_with_fault(stub, req, fault, after_tokens: int = 1):
    """Stream a request and inject `fault` (an async callable) once after_tokens have arrived."""
    ids, last, injected = [], None, False
    async for chunk in stub.GenerateStream(req, timeout=120):
        ids.extend(chunk.token_ids)
        last = chunk
        if not injected and len(ids) >= after_tokens:
            injected = True
            await fault()
    assert injected
    return ids, last


async def wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


# ----------------------------------------------------------------------------- 1. draft killed

async def test_draft_process_killed_mid_stream_falls_back_and_recovers(tmp_path) -> None:
    draft_proc, draft_port = await aspawn_worker("draft", "tiny:seed=0,noise=0.01", tmp_path)
    target_handle, target = await start_worker("target", "tiny:seed=0")
    cfg = OrchestratorConfig(f"127.0.0.1:{draft_port}", f"127.0.0.1:{target_handle.port}", "tiny:seed=0",
                             limits=EngineLimits(draft_timeout_s=2.0), connect_timeout_s=30)
    orch_handle, orch, backends = await start_orchestrator(cfg)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{orch_handle.port}")
    stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
    procs = [draft_proc]
    try:
        want = reference_greedy(PROMPT, 400)

        async def kill_draft() -> None:
            draft_proc.kill()  # SIGKILL: no goodbye
            await asyncio.to_thread(draft_proc.wait, 10)

        ids, last = await stream_with_fault(stub, request(prompt_ids=PROMPT, max_new_tokens=400,
                                                          speculation={"fixed_k": 3}), kill_draft, after_tokens=20)
        assert ids == want  # completed, no error, identical to target-only greedy
        assert last.stats.fallback_rounds > 0 and last.stats.draft_tokens > 0
        assert await health_of(channel, DRAFT_HEALTH_NAME) == NOT_SERVING   # degraded ...
        assert await health_of(channel) == SERVING                           # ... but serving
        # Restart the draft on the same port: the orchestrator retries with backoff and speculates again.
        procs.append((await aspawn_worker("draft", "tiny:seed=0,noise=0.01", tmp_path, port=draft_port))[0])
        for _ in range(100):
            reply = await stub.Generate(request(prompt_ids=PROMPT, max_new_tokens=20, speculation={"fixed_k": 3}),
                                        timeout=30)
            assert list(reply.token_ids) == want[:20]
            if reply.stats.fallback_rounds == 0 and reply.stats.draft_tokens > 0:
                break
            await asyncio.sleep(0.2)
        else:
            pytest.fail("the orchestrator never went back to the restarted draft worker")
        assert await health_of(channel, DRAFT_HEALTH_NAME) == SERVING
    finally:
        for proc in procs:
            stop(proc)
        await channel.close()
        for backend in backends:
            await backend.close()
        await orch_handle.stop(0)
        await target_handle.stop(0)
        target.close()


# ----------------------------------------------------------------------------- 2. target down

async def test_target_that_stays_down_gives_unavailable_quickly() -> None:
    stack = await start_stack(engine_limits=EngineLimits(target_retry_s=1.0))
    try:
        await stack.target_handle.stop(0)
        start = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stack.generate(prompt_ids=PROMPT, max_new_tokens=10, timeout=20)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "target worker unavailable" in err.value.details()
        assert time.monotonic() - start < 8
    finally:
        await stack.close()


# ----------------------------------------------------------------------------- 3. deadlines, cancellation

class _FakeDraft:
    def __init__(self) -> None:
        self.timeouts: list[float | None] = []

    async def propose(self, session_id, commit, k, sampling, min_draft_prob, timeout_s, slot=0, fork_from=None):
        self.timeouts.append(timeout_s)
        return DraftReply([7] * k, [0.9] * k, commit.cache_len + len(commit.append_tokens) + k - 1, 1.0, 0)

    async def end_session(self, session_id):
        return True


class _FakeTarget:
    def __init__(self) -> None:
        self.timeouts: list[float | None] = []

    async def verify(self, session_id, commit, draft_tokens, q_payload, sampling, timeout_s):
        self.timeouts.append(timeout_s)
        await asyncio.sleep(0.01)
        return VerifyReply(len(draft_tokens), 7, commit.cache_len + len(commit.append_tokens) + len(draft_tokens), 1.0, 0)

    async def end_session(self, session_id):
        return True


async def test_client_deadline_propagates_to_worker_calls() -> None:
    draft, target = _FakeDraft(), _FakeTarget()
    engine = GenerationEngine(draft, target, ByteTokenizer(), WorkerDescription("target", "fake", 260, 4096, [257]),
                              limits=EngineLimits(draft_timeout_s=3.0))
    params = GenerateParams(prompt_ids=(1, 2, 3), max_new_tokens=40, speculation=SpeculationOverride(fixed_k=3))
    async for _ in engine.generate(params, timeout_s=2.0):  # shorter than the draft's own timeout
        pass
    assert target.timeouts and all(t is not None and 0 < t <= 2.0 for t in target.timeouts)
    assert target.timeouts == sorted(target.timeouts, reverse=True)  # what is left of one deadline
    assert draft.timeouts and all(t is not None and 0 < t <= 2.0 for t in draft.timeouts)
    assert draft.timeouts == sorted(draft.timeouts, reverse=True)


class _ThreadNoting(ByteTokenizer):
    def __init__(self) -> None:
        super().__init__()
        self.threads: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.threads.append(threading.current_thread().name)
        return super().encode(text, add_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        self.threads.append(threading.current_thread().name)
        return super().apply_chat_template(messages, add_generation_prompt)


async def test_long_input_is_tokenised_off_the_event_loop() -> None:
    """Every stream and the health checks share the event loop: a 1M-character prompt tokenised
    on it stalled them all for about a second."""
    tokenizer = _ThreadNoting()
    engine = GenerationEngine(_FakeDraft(), _FakeTarget(), tokenizer, WorkerDescription("target", "fake", 260, 40_000, [257]))
    loop_thread = threading.current_thread().name
    for params in (GenerateParams(prompt="short", max_new_tokens=2), GenerateParams(prompt="x" * 20_000, max_new_tokens=2),
                   GenerateParams(messages=(("user", "y" * 20_000),), max_new_tokens=2)):
        async for _ in engine.generate(params):
            pass
    assert tokenizer.threads[0] == loop_thread  # short text: no thread hop
    assert loop_thread not in tokenizer.threads[1:] and len(tokenizer.threads) >= 3


async def test_sessions_expiring_together_are_ended_a_few_at_a_time() -> None:
    """The first request after a lull longer than the TTL expires every idle session: each ended
    on the workers at once (2 calls each), 5,000 of them held 8 streams up for 4 s instead of 0.15."""
    from orchestrator.engine import CONCURRENT_ENDS

    class CountingTarget(_FakeTarget):
        in_flight = most = calls = 0

        async def end_session(self, session_id):
            CountingTarget.in_flight += 1
            CountingTarget.calls += 1
            CountingTarget.most = max(CountingTarget.most, CountingTarget.in_flight)
            await asyncio.sleep(0.001)
            CountingTarget.in_flight -= 1
            return True

    engine = GenerationEngine(_FakeDraft(), CountingTarget(), ByteTokenizer(), WorkerDescription("target", "fake", 260, 4096, [257]))
    now = [0.0]
    engine.sessions._clock = lambda: now[0]
    for i in range(200):
        engine.sessions.get_or_create(f"idle{i}", False, SessionStats).tokens = [1, 2, 3]
    now[0] += 10 * engine.limits.session_ttl_s
    async for _ in engine.generate(GenerateParams(prompt_ids=(1, 2), max_new_tokens=2)):
        pass
    await engine.settle(30.0)
    assert CountingTarget.calls >= 200 and CountingTarget.most <= CONCURRENT_ENDS


async def test_the_backlog_of_ends_is_bounded_and_an_end_asked_again_joins_the_queued_one() -> None:
    """EndSession spawns a background end on the workers that outlives the call: a caller looping on
    EndSession with a short deadline, or workers slow to end, grew the backlog without limit. An end
    of an id still queued serves a second one; with the backlog full, tidy-ups (stand-alone
    sessions) are left to the workers' TTL and an asked-for end is refused RESOURCE_EXHAUSTED with
    a retry hint, before it removes anything."""
    from orchestrator.engine import CONCURRENT_ENDS, PENDING_ENDS_HEADROOM
    from specdec.errors import CapacityExceeded
    release = asyncio.Event()

    class SlowEnds(_FakeTarget):
        calls: list[str] = []

        async def end_session(self, session_id):
            SlowEnds.calls.append(session_id)
            await release.wait()
            return True

    engine = GenerationEngine(_FakeDraft(), SlowEnds(), ByteTokenizer(), WorkerDescription("target", "fake", 260, 4096, [257]),
                              limits=EngineLimits(max_sessions=4))
    assert engine._max_pending_ends == 4 + PENDING_ENDS_HEADROOM
    engine._max_pending_ends = CONCURRENT_ENDS + 2  # (a small backlog for the test)
    asks = [asyncio.ensure_future(engine.end_session(f"gone{i}")) for i in range(CONCURRENT_ENDS + 1)]
    await asyncio.sleep(0.05)
    assert len(engine._background) == CONCURRENT_ENDS + 1 and set(engine._queued_ends) == {f"gone{CONCURRENT_ENDS}"}
    # The queued id asked again: the same end, no new task.
    again = asyncio.ensure_future(engine.end_session(f"gone{CONCURRENT_ENDS}"))
    await asyncio.sleep(0.01)
    assert len(engine._background) == CONCURRENT_ENDS + 1
    named = engine.sessions.get_or_create("named", False, SessionStats)
    named.tokens = [1, 2]
    await named.lock.acquire()  # a turn in flight: the end waits for it, past the first check
    waiting_end = asyncio.ensure_future(engine.end_session("named"))
    await asyncio.sleep(0.01)
    last = asyncio.ensure_future(engine.end_session("another"))  # fills the backlog meanwhile
    await asyncio.sleep(0.01)
    assert len(engine._background) == CONCURRENT_ENDS + 2
    named.lock.release()
    with pytest.raises(CapacityExceeded):
        await waiting_end
    assert engine.sessions.get("named") is named  # refused before it removed anything
    with pytest.raises(CapacityExceeded) as refused:
        await engine.end_session("named")
    assert refused.value.retry_after_ms > 0 and engine.sessions.get("named") is not None  # nothing removed
    # A stand-alone turn's tidy-up is dropped, not queued: its turn still completes.
    events = [event async for event in engine.generate(GenerateParams(prompt_ids=(1, 2), max_new_tokens=2))]
    assert events[-1].finish_reason is not None and len(engine._background) == CONCURRENT_ENDS + 2
    release.set()
    assert all(await asyncio.gather(*asks, again, last))
    await engine.settle(5.0)
    assert engine._background == set() and engine._queued_ends == {} and engine._ending == {}
    assert await engine.end_session("named")  # room again


class _HangingTarget(_FakeTarget):
    """A target whose process is up (keepalive answered) but whose Verify never returns."""

    async def verify(self, session_id, commit, draft_tokens, q_payload, sampling, timeout_s):
        self.timeouts.append(timeout_s)
        await asyncio.sleep(timeout_s if timeout_s is not None else 2.0)
        raise DeadlineExceeded("Deadline Exceeded")  # as gRPC ends a call at its timeout


async def test_a_hung_target_fails_the_request_unavailable_without_a_client_deadline() -> None:
    target = _HangingTarget()
    engine = GenerationEngine(_FakeDraft(), target, ByteTokenizer(), WorkerDescription("target", "fake", 260, 4096, [257]),
                              limits=EngineLimits(target_timeout_s=0.2))
    params = GenerateParams(prompt_ids=(1, 2, 3), max_new_tokens=8, speculation=SpeculationOverride(fixed_k=0))
    with pytest.raises(WorkerUnavailable, match="did not answer within 0.2 s"):
        async for _ in engine.generate(params, timeout_s=None):
            pass
    assert target.timeouts == [0.2]  # was None: no deadline, the request waited for ever
    with pytest.raises(DeadlineExceeded):  # the client's own deadline first: still its error
        async for _ in engine.generate(params, timeout_s=0.1):
            pass


class _HungTarget(_HangingTarget):
    """Hung for good: its EndSession does not answer either (the model thread is stuck)."""

    async def end_session(self, session_id):
        await asyncio.sleep(3600)


async def test_a_hung_target_replica_is_passed_over_like_one_that_is_down() -> None:
    from orchestrator.routing import ReplicaEjection, ReplicaPool, RoutedTarget
    hung = {"10.0.0.1:1": _HungTarget(), "10.0.0.2:1": _HungTarget()}
    pool = ReplicaPool("target", ",".join(hung), lambda address: hung[address])
    now = [0.0]
    pool.ejection = ReplicaEjection(clock=lambda: now[0])
    engine = GenerationEngine(_FakeDraft(), RoutedTarget(pool), ByteTokenizer(),
                              WorkerDescription("target", "fake", 260, 4096, [257]),
                              limits=EngineLimits(target_timeout_s=0.05))
    owner = pool.node_for("s0")
    same_owner = [f"s{i}" for i in range(50) if pool.node_for(f"s{i}") == owner][:2]
    try:
        for now[0], session_id in zip((0.0, 1.5), same_owner):  # failing for over ReplicaEjection.EJECT_AFTER_S
            params = GenerateParams(prompt_ids=(1, 2, 3), max_new_tokens=4, session_id=session_id,
                                    speculation=SpeculationOverride(fixed_k=0))
            with pytest.raises(WorkerUnavailable, match="did not answer"):
                async for _ in engine.generate(params):
                    pass
        assert pool.ejection.passed_over(owner) and pool.node_for(same_owner[0]) != owner
    finally:
        for task in list(engine._background):  # the EndSessions the hung replica never answers
            task.cancel()


async def test_a_verify_that_timed_out_is_charged_to_the_replica_it_went_to() -> None:
    """By the time a hung call times out its replica may be passed over and the session map to
    another: the timeout was charged to that other replica, which had never failed a call."""
    from orchestrator.routing import ReplicaEjection, ReplicaPool, RoutedTarget
    now = [0.0]

    class _PassedOverMeanwhile(_HungTarget):
        async def verify(self, session_id, *args):
            for now[0] in (0.0, 1.5):  # other calls on this replica fail while this one hangs
                pool.ejection.failed(owner)
            return await super().verify(session_id, *args)
    backends = {"10.0.0.1:1": _PassedOverMeanwhile(), "10.0.0.2:1": _PassedOverMeanwhile()}
    pool = ReplicaPool("target", ",".join(backends), lambda address: backends[address])
    pool.ejection = ReplicaEjection(clock=lambda: now[0])
    owner = pool.node_for("s")
    engine = GenerationEngine(_FakeDraft(), RoutedTarget(pool), ByteTokenizer(),
                              WorkerDescription("target", "fake", 260, 4096, [257]),
                              limits=EngineLimits(target_timeout_s=0.05))
    params = GenerateParams(prompt_ids=(1, 2, 3), max_new_tokens=4, session_id="s", speculation=SpeculationOverride(fixed_k=0))
    try:
        with pytest.raises(WorkerUnavailable, match="did not answer"):
            async for _ in engine.generate(params):
                pass
        assert set(pool.ejection._failing) == {owner}
    finally:
        for task in list(engine._background):
            task.cancel()


async def test_a_hung_draft_replica_is_passed_over_and_the_turn_runs_target_only() -> None:
    """A draft replica whose process answers pings but whose Propose never returns: each of its
    sessions waited out the draft timeout, fell back to target-only, and stayed on it for good
    (only UNAVAILABLE counted as failing). A timeout of our own now counts, as for the target."""
    from dataclasses import replace

    from orchestrator.routing import ReplicaEjection, ReplicaPool, RoutedDraft

    class _HangingDraft(_FakeDraft):
        async def propose(self, session_id, commit, k, sampling, min_draft_prob, timeout_s, slot=0, fork_from=None):
            self.timeouts.append(timeout_s)
            await asyncio.sleep(timeout_s)
            raise DeadlineExceeded("Deadline Exceeded")  # as gRPC ends a call at its timeout
    drafts = {"10.0.0.1:1": _FakeDraft(), "10.0.0.2:1": _FakeDraft()}
    pool = ReplicaPool("draft", ",".join(drafts), lambda address: drafts[address])
    engine = GenerationEngine(RoutedDraft(pool), _FakeTarget(), ByteTokenizer(),
                              WorkerDescription("target", "fake", 260, 4096, [257]),
                              limits=EngineLimits(draft_timeout_s=ReplicaEjection.EJECT_AFTER_S))  # one hung call: passed over
    owned = [f"s{i}" for i in range(50) if pool.node_for(f"s{i}") == pool.node_for("s0")][:2]
    hung = pool.node_for(owned[0])
    drafts[hung] = pool.backends[hung] = _HangingDraft()
    params = GenerateParams(prompt_ids=(1, 2, 3), max_new_tokens=4, session_id=owned[0],
                            speculation=SpeculationOverride(fixed_k=2))
    events = [event async for event in engine.generate(params)]
    assert events[-1].finish_reason is not None and events[-1].stats.fallback_rounds >= 1
    assert drafts[hung].timeouts and pool.ejection.passed_over(hung) and pool.node_for(owned[0]) != hung
    # The caller's own deadline running out is not the replica's failure.
    pool.ejection.succeeded(hung)
    engine.draft_health.entries[hung].succeeded()  # (its back-off after the failure, forgotten)
    with pytest.raises(DeadlineExceeded):
        async for _ in engine.generate(replace(params, session_id=owned[1]), timeout_s=0.3):
            pass
    assert len(drafts[hung].timeouts) == 2 and not pool.ejection.passed_over(hung)
    await engine.settle(5.0)


async def test_deadline_and_cancellation_leak_nothing(stack) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.generate(prompt_ids=PROMPT, max_new_tokens=3000, timeout=0.3, speculation={"fixed_k": 0})
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    for session_id in (None, "kept"):
        fields = dict(prompt_ids=PROMPT, max_new_tokens=3000, speculation={"fixed_k": 2})
        if session_id:
            fields["session_id"] = session_id
        await cancel_stream_after(stack, 10, **fields)
    engine = stack.orch.engine
    await wait_until(lambda: stack.orch.admission.running == 0 and not engine._background
                     and not stack.target.core.store._slots and not stack.draft.core.store._slots
                     and len(engine.sessions) == 0)
    # The cancelled turn was the session's first: it left the session as it was before, not there
    # (ended on the workers too), and the id starts a new one.
    reply = await stack.generate(prompt_ids=[1], max_new_tokens=4, session_id="kept")
    assert reply.stats.new_tokens == 4 and reply.stats.prompt_tokens == 1
    assert list(reply.token_ids) == reference_greedy([1], 4)
    await stack.stub.EndSession(common_pb2.EndSessionRequest(session_id="kept"))
    assert len(engine.sessions) == 0 and len(stack.target.core.store) == 0 and len(stack.draft.core.store) == 0
    # No pre-draft or branch call outlived its turn (those are the only tasks a turn starts).
    round_calls = {"Round._propose", "Round._propose_branch"}
    assert any(getattr(t.get_coro(), "__qualname__", "") == "test_deadline_and_cancellation_leak_nothing"
               for t in asyncio.all_tasks())  # (how a task's coroutine is named: this test's own)
    assert not [t for t in asyncio.all_tasks() if getattr(t.get_coro(), "__qualname__", "") in round_calls]


async def test_the_next_turn_waits_for_a_cancelled_turn_to_clean_up_not_for_a_running_one(stack) -> None:
    """A client cancels its stream and at once asks again on the same session: the cancelled turn
    still held the session while it settled its pre-drafts, and the next turn was refused
    FAILED_PRECONDITION 'busy' (3 of 12 tries with 4 branches). A turn that still runs is refused
    at once, as before."""
    from orchestrator.engine import ENDING_WAIT_S
    engine = stack.orch.engine
    params = GenerateParams(prompt_ids=(5,), max_new_tokens=3, session_id="s")
    session = engine.sessions.get_or_create("s", False, SessionStats)
    await session.lock.acquire()  # a turn holds the session
    session.ending = False
    with pytest.raises(SessionBusy):
        async for _ in engine.generate(params):
            pass
    session.ending = True  # ... and is only cleaning up now
    asyncio.get_running_loop().call_later(0.2, session.lock.release)
    started = time.monotonic()
    events = [event async for event in engine.generate(params)]
    assert events[-1].finish_reason is not None and time.monotonic() - started < ENDING_WAIT_S
    assert not session.lock.locked()
    # Two requests wait for a turn that is ending: the first takes the session, and the second, by
    # then behind a running turn, is refused like any request that arrives during one (it ran after
    # that whole turn).
    await session.lock.acquire()
    session.ending = True
    first, second = (asyncio.ensure_future(session.begin_turn(ENDING_WAIT_S)) for _ in range(2))
    await asyncio.sleep(0.05)
    session.lock.release()
    await first
    await asyncio.sleep(0.05)
    session.lock.release()  # the first request's turn ends
    with pytest.raises(SessionBusy):
        await second
    assert not session.lock.locked()
    # The whole path, over gRPC: cancel a pipelined stream with branches, ask again at once.
    spec = {"pipeline": True, "pipeline_branches": 4, "fixed_k": 4}
    for trial in range(6):
        await cancel_stream_after(stack, 4, prompt_ids=[40 + trial], max_new_tokens=300, session_id=f"c{trial}",
                                  speculation=spec)
        reply = await stack.generate(prompt_ids=[5], max_new_tokens=4, session_id=f"c{trial}", speculation=spec)
        assert reply.stats.new_tokens == 4


# ----------------------------------------------------------------------------- 4. bounded memory

async def test_kv_budget_evicts_lru_and_rebuilds_correctly() -> None:
    # Tiny model: 512 bytes of KV per token; 48 KiB holds ~96 tokens, i.e. about two sessions.
    stack = await start_stack(draft_ref="tiny:seed=0,noise=0.02",
                              worker_limits=StoreLimits(max_bytes=48 * 1024, ttl_s=600))
    try:
        first_turns = {}
        for n in range(8):
            reply = await stack.generate(prompt_ids=[n + 1] * 10, max_new_tokens=30, session_id=f"s{n}",
                                         speculation={"fixed_k": 3})
            first_turns[n] = list(reply.token_ids)
            assert stack.target.core.store.total_bytes() <= 48 * 1024
        assert stack.target.core.store.evictions >= 5 and len(stack.target.core.store) <= 3
        # Session 0 was evicted long ago: its next turn is re-prefilled and still exact.
        second = await stack.generate(prompt_ids=[99, 98], max_new_tokens=20, session_id="s0", speculation={"fixed_k": 3})
        assert second.stats.reprefills >= 1
        fresh = await stack.generate(prompt_ids=[1] * 10 + first_turns[0] + [99, 98], max_new_tokens=20,
                                     speculation={"fixed_k": 3})
        assert list(second.token_ids) == list(fresh.token_ids)
        # One request that can never fit the budget, not even on an empty worker: INVALID_ARGUMENT (no
        # point retrying it), not an OOM.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stack.generate(prompt_ids=[5] * 150, max_new_tokens=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "whole KV budget" in err.value.details()
    finally:
        await stack.close()


async def test_orchestrator_session_state_is_bounded() -> None:
    stack = await start_stack(engine_limits=EngineLimits(max_sessions=3))
    try:
        for n in range(10):
            await stack.generate(prompt_ids=[n + 1], max_new_tokens=4, session_id=f"o{n}")
            assert len(stack.orch.engine.sessions) <= 3
        # Evicted orchestrator sessions are ended on the workers too.
        await wait_until(lambda: len(stack.target.core.store) <= 3)
    finally:
        await stack.close()


async def test_stand_alone_and_refused_requests_do_not_evict_conversations_at_the_session_limit() -> None:
    """At --max-sessions, a request without a session id, or a new session whose first turn is
    refused (a prompt over the context), evicted the least recently used conversation (its next
    turn: NOT_FOUND). Only a new conversation whose turn completes takes an idle one's place."""
    stack = await start_stack(engine_limits=EngineLimits(max_sessions=2))
    sessions = stack.orch.engine.sessions
    try:
        for sid in ("alice", "bob"):
            await stack.generate(prompt_ids=[3, 4], max_new_tokens=3, session_id=sid)
        await stack.generate(prompt_ids=[5, 6], max_new_tokens=3)  # stand-alone
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stack.generate(prompt_ids=[1] * 5000, max_new_tokens=3, session_id="carol")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert sessions.get("alice") and sessions.get("bob") and sessions.get("carol") is None
        assert len(sessions) == sessions.named == 2
        await stack.generate(prompt_ids=[7], max_new_tokens=3, session_id="dave")  # completes: alice goes
        assert sessions.get("alice") is None and sessions.get("bob") and sessions.get("dave")
        assert sessions.named == 2
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stack.generate(prompt_ids=[8], max_new_tokens=3, session_id="alice")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await stack.close()


async def test_orchestrator_histories_are_bounded_in_tokens() -> None:
    """A count alone did not bound the memory: 10,000 sessions of 8k tokens took 3.9 GiB (about 50
    bytes a token), over the k8s limit of 2 GiB. Past the token budget the least recently used
    sessions go (NOT_FOUND next time, as for any eviction); the total follows turns and ends."""
    stack = await start_stack(engine_limits=EngineLimits(max_session_tokens=100))
    sessions = stack.orch.engine.sessions
    try:
        for n in range(6):  # 10 prompt + 10 new tokens each: 5 fit
            await stack.generate(prompt_ids=[n + 1] * 10, max_new_tokens=10, session_id=f"h{n}")
            assert sessions.tokens == sum(s.held_tokens for s in sessions._sessions.values()) <= 100
        assert sessions.get("h0") is None and sessions.tokens == 100
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stack.generate(prompt_ids=[7], max_new_tokens=4, session_id="h0")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "100 tokens" in err.value.details()
        await stack.generate(prompt_ids=[7], max_new_tokens=10, session_id="h5")  # its second turn: 31 tokens
        assert sessions.tokens <= 100 and sessions.get("h5") is not None and sessions.get("h1") is None
        await stack.stub.EndSession(common_pb2.EndSessionRequest(session_id="h5"))
        assert sessions.tokens == sum(s.held_tokens for s in sessions._sessions.values())
    finally:
        await stack.close()


async def test_an_evicted_sessions_next_turn_is_told_not_given_an_empty_history() -> None:
    """A session's history lives only in the orchestrator: the next turn on an evicted id gets
    NOT_FOUND once (then the id starts afresh), not an answer from its new input alone. Sessions of
    requests without an id leave nothing behind."""
    stack = await start_stack(engine_limits=EngineLimits(max_sessions=2))
    try:
        for name in ("a", "b", "c"):  # "c" evicts "a", the least recently used
            await stack.generate(prompt_ids=[5, 6], max_new_tokens=4, session_id=name)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stack.generate(prompt_ids=[7], max_new_tokens=4, session_id="a")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "evicted" in err.value.details()
        again = await stack.generate(prompt_ids=[7], max_new_tokens=4, session_id="a")
        assert again.stats.prompt_tokens == 1  # a new session, knowingly
        for _ in range(3):
            await stack.generate(prompt_ids=[5], max_new_tokens=2)
        assert not any(sid.startswith("tmp-") for sid in stack.orch.engine.sessions._gone)
    finally:
        await stack.close()


def test_sessions_all_generating_refuse_a_new_one_as_resource_exhausted() -> None:
    from orchestrator.sessions import OrchestratorSessions
    from specdec.errors import CapacityExceeded, SessionNotFound
    evicted: list[str] = []
    now = [0.0]
    sessions = OrchestratorSessions(1, ttl_s=10.0, on_evict=lambda s: evicted.append(s.session_id), clock=lambda: now[0])
    busy = sessions.get_or_create("a", False, SessionStats)
    asyncio.run(busy.lock.acquire())  # "a" is generating
    with pytest.raises(CapacityExceeded) as refused:
        sessions.get_or_create("b", False, SessionStats)  # was a KeyError (INTERNAL), and evicted "b" on the workers
    assert refused.value.retry_after_ms > 0  # the retry-after-ms trailer every RESOURCE_EXHAUSTED carries
    assert sessions.get("b") is None and sessions.get("a") is busy and evicted == []
    busy.lock.release()
    # A turn that ran 30 s: its idle time starts when it ends, not when it began.
    now[0] = 30.0
    sessions.touch(busy)
    now[0] = 35.0
    assert sessions.get_or_create("a", False, SessionStats) is busy
    now[0] = 50.0  # idle past the TTL: expired, and told so once
    with pytest.raises(SessionNotFound, match="expired"):
        sessions.get_or_create("a", False, SessionStats)
    assert evicted == ["a"] and sessions.get_or_create("a", False, SessionStats) is not busy


def test_a_new_session_in_its_first_turn_costs_no_conversation_through_another_sessions_turn() -> None:
    """At the limit a new session is let in while an idle one exists, but counts against
    --max-sessions only once its first turn completes: another session's turn ending meanwhile
    evicted the idle conversation, and the newcomer's turn was then refused anyway."""
    from orchestrator.sessions import OrchestratorSessions
    evicted: list[str] = []
    sessions = OrchestratorSessions(2, ttl_s=1000.0, on_evict=lambda s: evicted.append(s.session_id))
    for sid in ("alice", "bob"):
        sessions.touch(sessions.get_or_create(sid, False, SessionStats))
    carol = sessions.get_or_create("carol", False, SessionStats)  # its first turn runs (to be refused)
    asyncio.run(carol.lock.acquire())
    bob = sessions.get_or_create("bob", False, SessionStats)
    sessions.touch(bob)  # bob's next turn ends meanwhile
    assert evicted == [] and sessions.named == 3 and sessions.established == 2
    carol.lock.release()
    assert sessions.discard(carol) and sessions.named == 2 and evicted == []
    sessions.touch(sessions.get_or_create("dave", False, SessionStats))  # completes: the LRU idle one goes
    assert evicted == ["alice"] and sessions.named == sessions.established == 2


def test_eviction_takes_the_session_idle_longest_counted_from_its_last_turns_end() -> None:
    """A turn's end made it the most recent in time but not in the eviction order: a session whose
    long turn had just ended lost its history before one idle far longer."""
    from orchestrator.sessions import OrchestratorSessions
    evicted: list[str] = []
    now = [0.0]
    sessions = OrchestratorSessions(2, ttl_s=1000.0, on_evict=lambda s: evicted.append(s.session_id),
                                    clock=lambda: now[0])
    long_turn = sessions.get_or_create("x", False, SessionStats)  # x's turn begins at 0 and runs 99 s
    now[0] = 1.0
    sessions.touch(sessions.get_or_create("y", False, SessionStats))  # y: a short turn, idle from 1 s
    now[0] = 99.0
    sessions.touch(long_turn)
    now[0] = 100.0
    z = sessions.get_or_create("z", False, SessionStats)
    assert evicted == []  # not before z's first turn has completed
    sessions.touch(z)
    assert evicted == ["y"] and sessions.get("x") is long_turn
    # Expiry walks the same order and stops at the first session still within its TTL.
    now[0] = 1099.5
    sessions.get_or_create("w", False, SessionStats)
    assert evicted == ["y", "x"] and sessions.get("z") is not None


async def test_a_failed_first_turn_leaves_no_session_behind() -> None:
    """A named session's first turn that fails is left as it was before: not there. It stayed as an
    empty session (evicted later with a tombstone: the corrected retry got NOT_FOUND)."""
    stack = await start_stack(engine_limits=EngineLimits(max_sessions=2))
    try:
        await stack.generate(prompt_ids=[5, 6], max_new_tokens=4, session_id="a")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stack.generate(prompt_ids=[5] * 10, max_new_tokens=4090, session_id="bad")  # over the context
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert stack.orch.engine.sessions.get("bad") is None
        await stack.generate(prompt_ids=[5, 6], max_new_tokens=4, session_id="b")
        await stack.generate(prompt_ids=[7], max_new_tokens=4, session_id="a")  # "a" kept its place
        again = await stack.generate(prompt_ids=[5, 6], max_new_tokens=4, session_id="bad")  # no tombstone
        assert again.stats.prompt_tokens == 2
    finally:
        await stack.close()


async def test_a_request_waiting_for_a_failed_first_turn_starts_the_session_afresh() -> None:
    from orchestrator.sessions import OrchestratorSessions
    sessions = OrchestratorSessions(4, ttl_s=100.0, on_evict=lambda s: None)
    first = await sessions.take("s", False, SessionStats, wait_s=1.0)
    first.ending = True  # the turn failed and is cleaning up: a retry waits for it

    async def fail_the_first_turn() -> None:
        await asyncio.sleep(0.05)
        assert sessions.discard(first)
        first.lock.release()
    asyncio.get_running_loop().create_task(fail_the_first_turn())
    second = await sessions.take("s", False, SessionStats, wait_s=1.0)
    assert second is not first and sessions.get("s") is second and first.discarded


class _LoggingTarget(_FakeTarget):
    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, str, int]] = []

    async def verify(self, session_id, commit, *args):
        self.log.append(("verify", session_id, commit.cache_len))
        await asyncio.sleep(0.02)
        return await super().verify(session_id, commit, *args)

    async def end_session(self, session_id):
        self.log.append(("end", session_id, -1))
        await asyncio.sleep(0.05)  # still ending while a new session on the id could start
        return True


async def test_an_end_session_queued_behind_a_retry_waits_for_the_retrys_turn() -> None:
    """A first turn fails while a retry B and then an EndSession E wait on it: B starts the id afresh,
    and E, given the failed turn's lock, ended B's new session in the middle of B's turn."""
    target = _LoggingTarget()
    engine = GenerationEngine(_FakeDraft(), target, ByteTokenizer(), WorkerDescription("target", "fake", 260, 4096, [257]))
    first = await engine.sessions.take("s", False, SessionStats, wait_s=1.0)
    first.ending = True  # its turn failed and is cleaning up
    params = GenerateParams(prompt_ids=(1, 2, 3), max_new_tokens=6, session_id="s", speculation=SpeculationOverride(fixed_k=0))

    async def retry() -> GenerationEvent:
        return [event async for event in engine.generate(params, timeout_s=5)][-1]
    retried = asyncio.create_task(retry())
    await asyncio.sleep(0.01)
    ended = asyncio.create_task(engine.end_session("s"))
    await asyncio.sleep(0.01)
    assert engine.sessions.discard(first)  # what generate's cleanup does for a failed first turn
    first.lock.release()
    assert (await retried).stats.new_tokens == 6 and await ended
    verifies = [i for i, entry in enumerate(target.log) if entry[0] == "verify"]
    assert [entry[0] for entry in target.log[verifies[-1] + 1:]] == ["end"]  # after the whole turn, not in it
    assert engine.sessions.get("s") is None


async def test_a_new_session_waits_for_the_workers_to_end_the_last_one_on_its_id() -> None:
    """The workers' end of a dropped session ran in the background: it landed in the middle of the
    next session on the same id (its cache ended after the first Verify: one more prefill)."""
    target = _LoggingTarget()
    engine = GenerationEngine(_FakeDraft(), target, ByteTokenizer(), WorkerDescription("target", "fake", 260, 4096, [257]))
    dropped = engine.sessions.get_or_create("s", False, SessionStats)
    assert engine.sessions.discard(dropped)
    engine._end_on_workers(dropped.session_id)
    params = GenerateParams(prompt_ids=(1, 2, 3), max_new_tokens=4, session_id="s", speculation=SpeculationOverride(fixed_k=0))
    [event async for event in engine.generate(params, timeout_s=5)]
    assert target.log[0] == ("end", "s", -1) and all(entry[0] == "verify" for entry in target.log[1:])
    # An explicit EndSession, and the next request on the id at once: its end landed mid-turn too.
    target.log.clear()
    ended = asyncio.create_task(engine.end_session("s"))
    await asyncio.sleep(0)
    [event async for event in engine.generate(params, timeout_s=5)]
    assert await ended and target.log[0] == ("end", "s", -1) and all(e[0] == "verify" for e in target.log[1:])
    # Cancelled while it waits for that end: the new session is dropped (not left empty).
    await engine.end_session("s")
    engine._end_on_workers("s")
    waiting = asyncio.create_task(anext(aiter(engine.generate(params, timeout_s=5))))
    await asyncio.sleep(0.01)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert engine.sessions.get("s") is None


def test_a_session_keeps_one_kind_of_input() -> None:
    from orchestrator.sessions import OrchestratorSession
    from specdec.errors import SessionInputConflict
    raw = OrchestratorSession("r", False, tokens=[5, 6])
    raw.check_input(chat=False)
    with pytest.raises(SessionInputConflict, match="raw prompt"):
        raw.check_input(chat=True)
    chat = OrchestratorSession("c", False, tokens=[1, 2], messages=[{"role": "user", "content": "hi"}])
    chat.check_input(chat=True)
    with pytest.raises(SessionInputConflict, match="is a chat"):
        chat.check_input(chat=False)
    OrchestratorSession("new", False).check_input(chat=True)  # an empty session takes either


def test_a_chat_template_that_refuses_the_messages_is_invalid_argument() -> None:
    from specdec.errors import InvalidRequest
    from specdec.tokenizers import HFTokenizer

    class Refusing:
        def __init__(self, exc: Exception) -> None:
            self.exc = exc

        def apply_chat_template(self, *args, **kwargs):
            raise self.exc

    jinja_error = type("TemplateError", (Exception,), {"__module__": "jinja2.exceptions"})
    for exc in (jinja_error("Conversation roles must alternate"), ValueError("chat_template is not set")):
        with pytest.raises(InvalidRequest) as refused:
            HFTokenizer(Refusing(exc), [0]).apply_chat_template([{"role": "user", "content": "x"}])
        assert refused.value.code_name == "INVALID_ARGUMENT" and str(exc) in str(refused.value)
    with pytest.raises(RuntimeError):  # anything else is a bug, and stays one
        HFTokenizer(Refusing(RuntimeError("bug")), [0]).apply_chat_template([])


# ----------------------------------------------------------------------------- 5. admission

async def test_over_capacity_gets_resource_exhausted() -> None:
    stack = await start_stack(max_concurrent=1, max_queue=1)
    try:
        calls = [stack.generate(prompt_ids=PROMPT, max_new_tokens=400, speculation={"fixed_k": 0}) for _ in range(5)]
        results = await asyncio.gather(*calls, return_exceptions=True)
        rejected = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        served = [r for r in results if not isinstance(r, Exception)]
        assert len(served) == 2 and len(rejected) == 3  # one running + one queued
        assert all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in rejected)
        assert "server busy" in rejected[0].details()
        hints = [next((v for k, v in r.trailing_metadata() or () if k == "retry-after-ms"), None) for r in rejected]
        assert all(h is not None and 100 <= int(h) <= 60_000 for h in hints)  # when to come back
        assert stack.orch.admission.running == 0 and stack.orch.admission.waiting == 0
    finally:
        await stack.close()


def test_the_admission_retry_hint_follows_the_measured_request_time() -> None:
    from orchestrator.admission import Admission
    admission = Admission(max_concurrent=4, max_queue=8)
    admission.mean_request_s = 2.0
    assert admission.retry_after_ms() == 500  # a place frees every 2 s / 4 slots
    admission.mean_request_s = 1e-4
    assert admission.retry_after_ms() == 100  # never a busy loop


async def test_a_rate_limit_keeps_its_rate_and_its_queue_bound() -> None:
    """--rate-per-s 0.5 became int(0.5) = 0 starts per second: every request waited for good; and
    requests held back by the rate never counted against max_queue (the queue grew without bound,
    callers timed out instead of getting RESOURCE_EXHAUSTED at once)."""
    from orchestrator.admission import Admission
    from specdec.errors import CapacityExceeded

    async def enter(admission: Admission) -> None:
        async with admission.slot():
            pass

    admission = Admission(max_concurrent=4, max_queue=2, rate_per_s=0.5)
    await asyncio.wait_for(enter(admission), 1.0)  # the first start comes at once
    held_back = [asyncio.create_task(enter(admission)) for _ in range(2)]  # the next ones in 2 s steps
    try:
        await asyncio.sleep(0.1)
        assert admission.waiting == 2 and admission.running == 0
        with pytest.raises(CapacityExceeded):
            await enter(admission)
        assert admission.rejected == 1
    finally:
        for task in held_back:
            task.cancel()
        await asyncio.gather(*held_back, return_exceptions=True)
    assert admission.waiting == 0
    throttler = Admission(4, 2, rate_per_s=1.5)._throttler
    assert throttler.rate_limit / throttler.period == pytest.approx(1.5)  # not int(1.5) = 1 per second
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            Admission(4, 2, rate_per_s=bad)


# ----------------------------------------------------------------------------- 6. bad input

async def test_bad_bytes_and_oversized_messages(stack) -> None:
    raw = stack.channel.unary_unary("/specdec.v1.Orchestrator/Generate", request_serializer=lambda b: b,
                                    response_deserializer=lambda b: b)
    good = request(prompt="x", max_new_tokens=2, stop=["ab"]).SerializeToString()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await raw(good.replace(b"ab", b"\xff\xfe"), timeout=10)  # invalid UTF-8 in a stop string
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "invalid UTF-8" in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await raw(b"\x0a\xff\xff\xff\xff\x0f", timeout=10)  # truncated garbage
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.generate(prompt="y" * (17 * 1024 * 1024), max_new_tokens=2)  # over the 16 MiB limit
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.generate(prompt="x", max_new_tokens=2, session_id="bad\nid")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    ended = await stack.stub.EndSession(common_pb2.EndSessionRequest(session_id="never-existed"))
    assert ended.existed is False
    target = target_stub(stack)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await target.Verify(worker_pb2.VerifyRequest(session_id="\x00", commit=common_pb2.CacheCommit(append_tokens=[1])))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Still healthy and correct.
    assert await health_of(stack.channel) == SERVING
    ok = await stack.generate(prompt_ids=PROMPT, max_new_tokens=8)
    assert list(ok.token_ids) == reference_greedy(PROMPT, 8)


# ----------------------------------------------------------------------------- 7. load

async def test_bounded_load_all_outputs_correct() -> None:
    stack = await start_stack(draft_ref="tiny:seed=0,noise=0.02", max_concurrent=64, max_queue=64)
    try:
        # k pinned: at 32 sessions the adaptive policy rightly runs tiny models mostly target-only,
        # and this test is about speculative rounds batched under load staying exact.
        report = await run_load(stack.address, concurrency=32, requests=64, max_new_tokens=16, time_limit_s=120,
                                fixed_k=3)
        summary = report.summary()
        assert summary["errors"] == {} and report.mismatches == 0 and report.ok == 64, summary
        assert 0 < summary["p50_ms"] <= summary["p99_ms"]
        # Speculation really ran under load (not a silent fallback to target-only).
        assert summary["draft_tokens"] > 0 and summary["accepted_tokens"] > 0, summary
        print("load:", summary)
    finally:
        await stack.close()


# ----------------------------------------------------------------------------- 8. graceful shutdown

async def test_sigterm_drains_in_flight_requests(tmp_path) -> None:
    draft_handle, draft = await start_worker("draft", "tiny:seed=0")
    target_handle, target = await start_worker("target", "tiny:seed=0")
    proc, port = await aspawn("orchestrator", ["--draft", f"127.0.0.1:{draft_handle.port}", "--target",
                                        f"127.0.0.1:{target_handle.port}", "--tokenizer", "tiny:seed=0",
                                        "--port", "0", "--drain-delay-s", "1.0", "--grace-s", "30"], tmp_path)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
    try:
        want = reference_greedy(PROMPT, 2000)

        async def sigterm() -> None:
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10.0
            while await health_of(channel) != NOT_SERVING:  # while the stream is still running
                assert time.monotonic() < deadline, "health did not turn NOT_SERVING after SIGTERM"
                await asyncio.sleep(0.05)

        ids, last = await stream_with_fault(stub, request(prompt_ids=PROMPT, max_new_tokens=2000,
                                                          speculation={"fixed_k": 0}), sigterm)
        assert ids == want and last.finish_reason == orchestrator_pb2.FINISH_REASON_LENGTH
        assert await asyncio.to_thread(proc.wait, 30) == 0  # drained, then exited on its own
    finally:
        stop(proc)
        await channel.close()
        for handle, servicer in ((draft_handle, draft), (target_handle, target)):
            await handle.stop(0)
            servicer.close()


async def test_streams_cut_at_the_end_of_the_grace_end_their_sessions_on_the_workers(tmp_path) -> None:
    """The orchestrator closed its worker channels while the cut turns still unwound: their
    sessions stayed on the workers until the TTL, and each logged 'Task exception was never
    retrieved'. A worker cut the same way logged an ERROR traceback per call."""
    draft_handle, draft = await start_worker("draft", "tiny:seed=0")
    target_proc, target_port = await aspawn_worker("target", "tiny:seed=0", tmp_path)
    proc, port = await aspawn("orchestrator", ["--draft", f"127.0.0.1:{draft_handle.port}", "--target",
                                               f"127.0.0.1:{target_port}", "--tokenizer", "tiny:seed=0",
                                               "--port", "0", "--grace-s", "0.5"], tmp_path)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
    try:
        calls = [stub.GenerateStream(request(prompt_ids=[5, i], max_new_tokens=4000, speculation={"fixed_k": 3}))
                 for i in range(3)]
        for call in calls:
            await call.read()  # each turn is under way
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                while await call.read() is not grpc.aio.EOF:
                    pass
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # cut at the end of the grace
        assert draft.core.session_count() == 0  # ended before the channels closed
        target_proc.send_signal(signal.SIGTERM)  # (nothing in flight: a clean exit)
        assert await asyncio.to_thread(target_proc.wait, 30) == 0
        log_text = (tmp_path / "orchestrator.log").read_text()
        assert "never retrieved" not in log_text and "ERROR" not in log_text, log_text[-2000:]
    finally:
        stop(proc)
        stop(target_proc)
        await channel.close()
        await draft_handle.stop(0)
        draft.close()


async def test_a_worker_cut_at_the_end_of_its_grace_logs_no_errors(tmp_path) -> None:
    proc, port = await aspawn("target_worker", ["--model", "tiny:layers=6,hidden=512,max_positions=4096", "--port", "0",
                                                "--threads", "1", "--calibration-s", "0", "--max-batch", "1",
                                                "--grace-s", "0.5"], tmp_path)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = worker_pb2_grpc.TargetWorkerStub(channel)
            calls = [asyncio.ensure_future(stub.Verify(worker_pb2.VerifyRequest(
                session_id=f"s{i}", commit={"cache_len": 0, "append_tokens": [5] * 3000}), timeout=60))
                for i in range(6)]
            await asyncio.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(proc.wait, 60) == 0
            await asyncio.gather(*calls, return_exceptions=True)
        log_text = (tmp_path / "target_worker.log").read_text()
        assert "ERROR" not in log_text and "Traceback" not in log_text, log_text[-2000:]
    finally:
        stop(proc)


async def test_fresh_worker_checks_the_budget_on_its_first_request() -> None:
    from specdec.models import estimate_kv_bytes_per_token
    from tests.stack import cached_model
    assert estimate_kv_bytes_per_token(cached_model("tiny:seed=0").model) == 512  # 2 x 2 layers x 2 heads x 16 x 4 B
    stack = await start_stack(worker_limits=StoreLimits(max_bytes=32 * 1024, ttl_s=600))
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stack.generate(prompt_ids=[5] * 200, max_new_tokens=4)  # 200 x 512 B > 32 KiB
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # more than the whole budget
        assert stack.target.core.store.total_bytes() == 0  # rejected before any KV was allocated
    finally:
        await stack.close()


async def test_ending_an_evicted_session_lets_its_id_start_afresh(stack) -> None:
    """The client was told its session was evicted, ended it, and started a new conversation with
    the same id: NOT_FOUND 'was evicted', again."""
    from specdec.errors import SessionNotFound
    engine = stack.orch.engine
    sessions = engine.sessions
    for session_id in ("a", "b"):
        sessions.get_or_create(session_id, False, SessionStats)
        sessions._evict(session_id, "was evicted (test)")
    with pytest.raises(SessionNotFound, match="evicted"):
        sessions.get_or_create("a", False, SessionStats)
    assert not await engine.end_session("b")  # EndSession on the evicted id: nothing held any more
    assert sessions.get_or_create("b", False, SessionStats).tokens == []


async def test_the_workers_get_one_startup_timeout_between_them() -> None:
    """The target and then the draft each had --connect-timeout-s of their own: up to twice the
    timeout that the k8s startup probe is sized on, so the kubelet killed the orchestrator before
    its own error named the missing worker."""
    from orchestrator.app import wait_for_workers

    class Worker:
        def __init__(self, ready_after_s: float) -> None:
            self.ready_at = time.monotonic() + ready_after_s

        async def describe(self, timeout_s: float) -> str:
            if time.monotonic() < self.ready_at:
                raise WorkerUnavailable("loading")
            return "info"

    started = time.monotonic()
    with pytest.raises(SystemExit, match="the draft worker did not answer GetInfo within --connect-timeout-s"):
        await wait_for_workers(Worker(0.6), Worker(60.0), timeout_s=1.0)
    assert time.monotonic() - started < 1.8  # (was 1.6 + 0.5 for the draft's own second)
    assert await wait_for_workers(Worker(0.0), Worker(0.0), timeout_s=1.0) == ("info", "info")


def test_orchestrator_flags_are_checked_before_it_waits_for_the_workers() -> None:
    """--max-concurrent 0 or a NaN rate failed only after the workers answered (up to 900 s in
    k8s); --connect-timeout-s nan retried for ever."""
    import argparse

    from orchestrator.app import add_args, config_from_args
    parser = argparse.ArgumentParser()
    add_args(parser)
    base = ["--draft", "d:1", "--target", "t:1"]
    assert config_from_args(parser.parse_args(base)).connect_timeout_s == 120.0
    for flags in (["--max-concurrent", "0"], ["--rate-per-s", "nan"], ["--rate-per-s", "-1"],
                  ["--max-queue", "-1"], ["--connect-timeout-s", "nan"], ["--connect-timeout-s", "0"],
                  ["--discovery-refresh-s", "0"], ["--target-timeout-s", "-1"], ["--max-session-tokens", "0"],
                  ["--max-sessions", "0"]):  # refresh 0: a busy DNS loop
        with pytest.raises(SystemExit, match="must be"):
            config_from_args(parser.parse_args(base + flags))
    assert config_from_args(parser.parse_args(base)).limits.target_timeout_s == 600.0
    # Half a TLS pair served plaintext (the bearer tokens in clear), mTLS flags without a CA talked plaintext.
    for flags in (["--tls-cert", "c.pem"], ["--tls-key", "k.pem"], ["--worker-client-cert", "c", "--worker-client-key", "k"],
                  ["--worker-server-name", "w"]):
        with pytest.raises(SystemExit, match="needs"):
            config_from_args(parser.parse_args(base + flags))


def test_bearer_tokens_without_tls_are_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Tokens over plaintext are allowed (TLS may end at a mesh sidecar) but never silently."""
    import argparse

    from orchestrator.app import add_args, config_from_args
    parser = argparse.ArgumentParser()
    add_args(parser)
    tokens = tmp_path / "tokens"
    tokens.write_text("s3cret\n")
    base = ["--draft", "d:1", "--target", "t:1", "--auth-token-file", str(tokens)]
    with caplog.at_level(logging.WARNING, logger="orchestrator.app"):
        assert config_from_args(parser.parse_args(base)).auth_tokens == ("s3cret",)
    assert "plaintext" in caplog.text
    caplog.clear()
    from tests.test_deploy import make_pki
    pki = make_pki(tmp_path)  # (the files are read and checked at startup now)
    with caplog.at_level(logging.WARNING, logger="orchestrator.app"):
        config_from_args(parser.parse_args(base + ["--tls-cert", pki["server_cert"], "--tls-key", pki["server_key"]]))
    assert "plaintext" not in caplog.text


async def test_a_sessions_first_text_gets_the_tokenizers_bos_and_its_continuations_do_not() -> None:
    """A raw prompt was encoded without special tokens, so a Llama- or Gemma-style model ran without
    its BOS, unlike HF generate on tokenizer(prompt), vLLM and TGI (the output differed from the
    target-only reference). The first text of a session gets them; text that continues it does not."""
    from specdec.tokenizers import HFTokenizer

    class BosTokenizer:  # HF-like: a post-processor that puts <s> (id 1) first
        def encode(self, text, add_special_tokens=True):
            return ([1] if add_special_tokens else []) + [3 + b % 200 for b in text.encode()]

        def decode(self, ids, **kwargs):
            return "".join(chr(97 + i % 26) for i in ids)

    class Recording(_FakeTarget):
        def __init__(self) -> None:
            super().__init__()
            self.appended: list[tuple[int, ...]] = []

        async def verify(self, session_id, commit, draft_tokens, q_payload, sampling, timeout_s):
            self.appended.append(tuple(commit.append_tokens))
            return await super().verify(session_id, commit, draft_tokens, q_payload, sampling, timeout_s)
    target = Recording()
    engine = GenerationEngine(_FakeDraft(), target, HFTokenizer(BosTokenizer(), [257]),
                              WorkerDescription("target", "fake", 260, 4096, [257]))
    for prompt in ("hi", "more"):
        async for _ in engine.generate(GenerateParams(prompt=prompt, max_new_tokens=2, session_id="s")):
            pass
        text_ids = tuple(3 + b % 200 for b in prompt.encode())
        first = target.appended[0]  # the turn's first commit: (last turn's output token,) + the prompt's ids
        assert first[-len(text_ids) - 1:] == ((1,) + text_ids if prompt == "hi" else (7,) + text_ids), first
        target.appended.clear()


def test_a_prompt_that_brings_its_own_bos_gets_one_bos() -> None:
    """A client that renders the chat template itself sends text that starts with the BOS token's
    text; HF tokenizers parse it, so adding the special tokens gave two BOS."""
    from specdec.tokenizers import HFTokenizer

    class BosTokenizer:
        bos_token_id = 1

        def encode(self, text, add_special_tokens=True):
            ids = [1] if text.startswith("<s>") else []
            return ([1] if add_special_tokens else []) + ids + [3 + b % 200 for b in text.removeprefix("<s>").encode()]
    tok = HFTokenizer(BosTokenizer(), [2])
    assert tok.encode("<s>hi", add_special_tokens=True) == [1, 3 + ord("h"), 3 + ord("i")]
    assert tok.encode("hi", add_special_tokens=True) == [1, 3 + ord("h"), 3 + ord("i")]
    assert tok.encode("hi") == [3 + ord("h"), 3 + ord("i")]


def test_a_failing_trace_write_stops_tracing_not_the_request(tmp_path, caplog) -> None:
    """--trace-file on a full disk: each round's write raised, the turn rolled back and the client got
    INTERNAL. Now it is logged once and tracing stops."""
    from orchestrator.traces import RoundTrace, TraceWriter

    writer = TraceWriter(tmp_path / "t.jsonl")

    class Full:
        def write(self, text):
            raise OSError(28, "No space left on device")

        def close(self):
            pass
    writer._file = Full()
    trace = RoundTrace(**{f.name: 0 for f in __import__("dataclasses").fields(RoundTrace)})
    with caplog.at_level(logging.ERROR, logger="orchestrator.traces"):
        writer.write(trace)
        writer.write(trace)
    assert [r.getMessage() for r in caplog.records].count("round trace file write failed, tracing stops: "
                                                        "[Errno 28] No space left on device") == 1


async def test_an_ephemeral_turn_does_not_evict_named_sessions() -> None:
    """An ephemeral turn's tokens were counted (touch) before its session was dropped: a 200-token
    request evicted a 450-token chat history from a 1,000-token budget, although its own were freed
    at once, and that chat's next turn got NOT_FOUND."""
    engine = GenerationEngine(_FakeDraft(), _FakeTarget(), ByteTokenizer(),
                              WorkerDescription("target", "fake", 260, 4096, [257]),
                              limits=EngineLimits(max_session_tokens=1000))
    for name in ("alice", "bob"):
        async for _ in engine.generate(GenerateParams(prompt_ids=tuple(3 + i % 250 for i in range(440)), max_new_tokens=10,
                                                      session_id=name)):
            pass
    assert engine.sessions.tokens == 900
    async for _ in engine.generate(GenerateParams(prompt_ids=tuple(range(3, 193)), max_new_tokens=10)):
        pass
    assert engine.sessions.tokens == 900 and len(engine.sessions) == 2
    async for _ in engine.generate(GenerateParams(prompt_ids=(5,), max_new_tokens=1, session_id="alice",
                                                  resume_session=True)):
        pass


async def test_draining_turns_every_health_entry_not_serving_for_good() -> None:
    """stop() set only "" and the service names: the orchestrator's .../draft entry stayed SERVING
    through the drain, and a draft report could set it back."""
    from grpc_health.v1 import health_pb2

    from specdec import grpc_util
    handle = await grpc_util.start_server(lambda server: None, ["specdec.v1.Orchestrator"])
    await handle.set_status("specdec.v1.Orchestrator/draft", True)
    await handle.stop(grace_s=0.1)
    await handle.set_status("specdec.v1.Orchestrator/draft", True)  # a late report changes nothing
    statuses = handle.health._server_status
    assert set(statuses) >= {"", "specdec.v1.Orchestrator", "specdec.v1.Orchestrator/draft"}
    assert all(status == health_pb2.HealthCheckResponse.NOT_SERVING for status in statuses.values())


async def test_a_chat_request_of_too_many_messages_is_refused_before_rendering() -> None:
    """Messages were counted by their text only: 100k empty ones were rendered on the event loop
    (1.85 s with the embedded tokenizer), stalling every stream and the health checks."""
    from specdec.errors import InvalidRequest

    engine = GenerationEngine(_FakeDraft(), _FakeTarget(), ByteTokenizer(), WorkerDescription("target", "fake", 260, 4096, [257]),
                              limits=EngineLimits(max_messages=4))
    with pytest.raises(InvalidRequest, match="5 messages; the limit is 4"):
        async for _ in engine.generate(GenerateParams(messages=(("user", ""),) * 5, max_new_tokens=2)):
            pass
    async for _ in engine.generate(GenerateParams(messages=(("user", "hi"),) * 4, max_new_tokens=2)):
        pass


async def test_a_dropped_stream_closes_the_servicers_generator_at_once() -> None:
    """gRPC drops a stream's handler generator when the stream is cancelled while a write blocks.
    The servicer's generator under it (and the turn under that: its session lock, its pre-draft)
    must close with it, not at some later garbage collection: until then a retry on the session was
    refused as busy and the admission slot was free while the turn still ran."""
    from types import SimpleNamespace

    from specdec import grpc_util
    closed: list[str] = []

    class Servicer:
        async def GenerateStream(self, request, context):
            try:
                for i in range(10):
                    yield orchestrator_pb2.GenerateStreamResponse(text_delta=str(i))
            finally:
                closed.append("servicer")

        async def Generate(self, request, context): ...

        async def EndSession(self, request, context): ...
    captured: list = []
    server = SimpleNamespace(add_generic_rpc_handlers=captured.extend)
    grpc_util.add_service(server, orchestrator_pb2.DESCRIPTOR.services_by_name["Orchestrator"], Servicer())
    details = SimpleNamespace(method="/specdec.v1.Orchestrator/GenerateStream", invocation_metadata=())
    handler = captured[0].service(details)
    stream = handler.unary_stream(orchestrator_pb2.GenerateRequest(), SimpleNamespace())
    assert (await stream.__anext__()).text_delta == "0"
    await stream.aclose()
    assert closed == ["servicer"]


async def test_a_dropped_stream_ends_its_turn_before_its_admission_slot_is_freed() -> None:
    from types import SimpleNamespace

    from orchestrator.admission import Admission
    from orchestrator.servicer import OrchestratorServicer
    admission = Admission(max_concurrent=1, max_queue=0)
    seen: list[int] = []

    async def generate(params, timeout_s, speculation):
        try:
            for i in range(10):
                yield GenerationEvent(token_ids=[i], text_delta=str(i))
        finally:
            seen.append(admission.running)  # the turn ends while it still holds its slot
    engine = SimpleNamespace(validate=lambda params: None, generate=generate)
    servicer = OrchestratorServicer(engine, admission)
    events = servicer._events(orchestrator_pb2.GenerateRequest(prompt="x"), SimpleNamespace(time_remaining=lambda: None),
                              "GenerateStream")
    assert (await events.__anext__()).token_ids == [0]
    await events.aclose()
    assert seen == [1] and admission.running == 0
