"""Multi-turn cache reuse and transparent re-prefill when a worker lost a session."""
from __future__ import annotations


from specdec.v1 import common_pb2
from tests.stack import draft_stub, start_stack, start_worker, target_stub

TURN1 = [5, 6, 7, 8, 9, 10]
TURN2 = [40, 41, 42]


async def two_turns(stack, session_id: str, between=None):
    first = await stack.generate(prompt_ids=TURN1, max_new_tokens=24, session_id=session_id,
                                 speculation={"fixed_k": 3})
    if between is not None:
        await between()
    fed_before = stack.target.core.counters.fed_tokens
    second = await stack.generate(prompt_ids=TURN2, max_new_tokens=24, session_id=session_id,
                                  speculation={"fixed_k": 3})
    return first, second, stack.target.core.counters.fed_tokens - fed_before


async def fresh_run(stack, prompt: list[int]):
    fed_before = stack.target.core.counters.fed_tokens
    reply = await stack.generate(prompt_ids=prompt, max_new_tokens=24, speculation={"fixed_k": 3})
    return reply, stack.target.core.counters.fed_tokens - fed_before


async def test_second_turn_reuses_cache_and_equals_fresh_run(disagreeing_stack) -> None:
    stack = disagreeing_stack
    first, second, fed_continued = await two_turns(stack, "conv-1")
    conversation = TURN1 + list(first.token_ids) + TURN2
    fresh, fed_fresh = await fresh_run(stack, conversation)
    assert list(second.token_ids) == list(fresh.token_ids)
    # The target already held everything but the last generated token of turn 1.
    cached = len(TURN1) + len(first.token_ids) - 1
    assert second.stats.cached_prompt_tokens == cached
    assert second.stats.prompt_tokens == len(conversation)
    assert fed_continued == fed_fresh - cached  # only the new tokens were prefilled
    assert second.stats.reprefills == 0
    assert second.session_id == "conv-1"


async def test_chat_session_continues_with_history(stack) -> None:
    first = await stack.generate(messages=[("user", "hello")], max_new_tokens=12, session_id="chat")
    second = await stack.generate(messages=[("user", "again")], max_new_tokens=12, session_id="chat")
    fresh = await stack.generate(messages=[("user", "hello"), ("assistant", first.text), ("user", "again")],
                                 max_new_tokens=12)
    assert list(second.token_ids) == list(fresh.token_ids)
    assert second.stats.cached_prompt_tokens > 0


async def test_worker_end_session_is_re_prefilled(disagreeing_stack) -> None:
    stack = disagreeing_stack
    baseline_first, baseline_second, _ = await two_turns(stack, "baseline")

    async def drop_worker_sessions() -> None:
        for stub in (draft_stub(stack), target_stub(stack)):
            reply = await stub.EndSession(common_pb2.EndSessionRequest(session_id="lost"))
            assert reply.existed

    first, second, _ = await two_turns(stack, "lost", between=drop_worker_sessions)
    assert list(first.token_ids) == list(baseline_first.token_ids)
    assert list(second.token_ids) == list(baseline_second.token_ids)
    assert second.stats.reprefills == 2  # draft and target each rebuilt once
    assert second.stats.cached_prompt_tokens == 0  # the target re-prefilled the whole prompt


async def test_target_restart_is_re_prefilled() -> None:
    stack = await start_stack(draft_ref="tiny:seed=0,noise=0.04")
    try:
        baseline_first, baseline_second, _ = await two_turns(stack, "baseline")
        port = stack.target_handle.port

        async def restart_target() -> None:
            await stack.target_handle.stop(0)
            stack.target.close()
            stack.target_handle, stack.target = await start_worker("target", "tiny:seed=0", port=port)
            assert stack.target_handle.port == port

        first, second, _ = await two_turns(stack, "restarted", between=restart_target)
        assert list(first.token_ids) == list(baseline_first.token_ids)
        assert list(second.token_ids) == list(baseline_second.token_ids)
        assert second.stats.reprefills >= 1
    finally:
        await stack.close()


async def test_orchestrator_end_session_ends_worker_sessions(stack) -> None:
    await stack.generate(prompt_ids=TURN1, max_new_tokens=8, session_id="bye")
    assert "bye" in stack.target.core.store and "bye" in stack.draft.core.store
    reply = await stack.stub.EndSession(common_pb2.EndSessionRequest(session_id="bye"))
    assert reply.existed
    assert "bye" not in stack.target.core.store and "bye" not in stack.draft.core.store


async def test_ephemeral_requests_leave_no_sessions(stack) -> None:
    import asyncio
    for _ in range(3):
        await stack.generate(prompt_ids=TURN1, max_new_tokens=8)
    for _ in range(50):  # the workers' EndSession calls run in the background
        if not len(stack.target.core.store) and not len(stack.draft.core.store):
            break
        await asyncio.sleep(0.02)
    assert len(stack.target.core.store) == 0 and len(stack.draft.core.store) == 0
    assert len(stack.orch.engine.sessions) == 0


async def test_resume_session_refuses_an_id_without_history(stack) -> None:
    """Tombstones are bounded and die with the process: past them an expired session's next turn
    was answered from its new input alone. A client that says it continues gets NOT_FOUND instead."""
    import grpc
    import pytest
    stack.orch.engine.sessions.TOMBSTONES = 0  # the orchestrator no longer remembers any ended id
    first = await stack.generate(prompt_ids=TURN1, max_new_tokens=8, session_id="conv")
    second = await stack.generate(prompt_ids=TURN2, max_new_tokens=8, session_id="conv", resume_session=True)
    assert second.stats.prompt_tokens == len(TURN1) + len(first.token_ids) + len(TURN2)
    stack.orch.engine.sessions._evict("conv", "was evicted (test)")
    for kwargs in ({"session_id": "conv"}, {"session_id": "never-seen"}):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stack.generate(prompt_ids=TURN2, max_new_tokens=8, resume_session=True, **kwargs)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "resume_session" in err.value.details()
    assert stack.orch.engine.sessions.get("never-seen") is None  # refused without making one
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.generate(prompt_ids=TURN2, max_new_tokens=8, resume_session=True)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Without the flag the id starts afresh, as before.
    assert (await stack.generate(prompt_ids=TURN2, max_new_tokens=8, session_id="conv")).stats.prompt_tokens == len(TURN2)
