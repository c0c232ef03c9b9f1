"""End to end through three real gRPC servers on 127.0.0.1: the output equals the target alone."""
from __future__ import annotations

import grpc
import pytest
import torch

from orchestrator.api import EngineLimits
from orchestrator.config import SpeculationConfig
from specdec.v1 import orchestrator_pb2
from tests.stack import cached_model, start_stack

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [72, 101, 108, 108, 111], [200, 17, 33, 250, 9, 9, 9, 41, 120, 3, 77]]
MAX_NEW = 40


def reference_greedy(prompt: list[int], max_new: int = MAX_NEW, ref: str = "tiny:seed=0") -> list[int]:
    model = cached_model(ref).model
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("draft_ref", ["tiny:seed=0,noise=0.01", "tiny:seed=0,noise=0.04", "tiny:seed=1"])
@pytest.mark.parametrize("speculation", [{"fixed_k": 1}, {"fixed_k": 3}, {"fixed_k": 5},
                                         {"policy": "cost", "max_k": 6}, {"policy": "heuristic", "max_k": 8}],
                         ids=["k1", "k3", "k5", "adaptive-cost", "adaptive-heuristic"])
async def test_greedy_is_token_identical_to_target_alone(draft_ref: str, speculation: dict) -> None:
    # The tiny draft costs what the tiny target does, so the cost policy (rightly) stops drafting and
    # the pair guard goes target-only: a target call 20 ms slower makes speculating pay, and the
    # adaptive variants check speculative output, not target-only against target-only.
    stack = await start_stack(draft_ref=draft_ref, target_call_delay_ms=20.0 if "policy" in speculation else 0.0)
    try:
        for prompt in PROMPTS:
            reply = await stack.generate(prompt_ids=prompt, max_new_tokens=MAX_NEW, speculation=speculation)
            want = reference_greedy(prompt)
            assert list(reply.token_ids) == want
            expected_finish = (orchestrator_pb2.FINISH_REASON_EOS if want[-1] == 257 and len(want) < MAX_NEW
                               else orchestrator_pb2.FINISH_REASON_LENGTH)
            assert reply.finish_reason == expected_finish
            assert reply.stats.new_tokens == len(want)
            # Every fixed-k reply drafted, and each policy's first (later ones may rightly go
            # target-only: a draft of other weights, seed=1, is rarely accepted).
            if "fixed_k" in speculation or prompt is PROMPTS[0]:
                assert reply.stats.draft_tokens > 0, list(reply.stats.k_per_round)
    finally:
        await stack.close()


async def test_unset_max_new_tokens_runs_to_the_context_window_or_the_server_limit() -> None:
    """max_new_tokens unset (0): the turn fills what the context window has left (FINISH_REASON_CONTEXT)
    or stops at --max-new-tokens-limit (FINISH_REASON_LENGTH), with the target's own tokens; a set
    count that does not fit, or a prompt that leaves no room, is refused."""
    limit = 6
    stack = await start_stack(engine_limits=EngineLimits(max_new_tokens=limit))
    try:
        context = cached_model("tiny:seed=0").max_context
        long_prompt = [3 + (i * 7919) % 250 for i in range(context - 4)]  # 4 tokens of room; no EOS (257)
        reply = await stack.generate(prompt_ids=long_prompt, speculation={"fixed_k": 3})
        assert list(reply.token_ids) == reference_greedy(long_prompt, 4)
        assert reply.finish_reason == orchestrator_pb2.FINISH_REASON_CONTEXT and reply.stats.new_tokens == 4
        short = await stack.generate(prompt_ids=PROMPTS[0], speculation={"fixed_k": 3})
        assert list(short.token_ids) == reference_greedy(PROMPTS[0], limit)
        assert short.finish_reason == orchestrator_pb2.FINISH_REASON_LENGTH
        # Both bounds at once (room == limit): the limit's reason, by precedence.
        even = await stack.generate(prompt_ids=long_prompt[:context - limit], speculation={"fixed_k": 3})
        assert even.stats.new_tokens == limit and even.finish_reason == orchestrator_pb2.FINISH_REASON_LENGTH
        # A session's history takes room too: the second turn has context - (len + 3 + 2) = 5 left.
        first = await stack.generate(prompt_ids=long_prompt[:context - 10], max_new_tokens=3, session_id="s")
        second = await stack.generate(prompt_ids=[5, 6], session_id="s", speculation={"fixed_k": 3})
        history = long_prompt[:context - 10] + list(first.token_ids) + [5, 6]
        assert list(second.token_ids) == reference_greedy(history, 5)
        assert second.finish_reason == orchestrator_pb2.FINISH_REASON_CONTEXT
        for fields, message in ((dict(prompt_ids=long_prompt, max_new_tokens=5), "max_new_tokens (5) exceeds"),
                                (dict(prompt_ids=long_prompt + [5] * 4), "one new token exceeds")):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stack.generate(**fields)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()
    finally:
        await stack.close()


async def test_bf16_draft_keeps_greedy_output_identical() -> None:
    """The draft's precision only changes acceptance; the fp32 target decides every token."""
    stack = await start_stack(draft_ref="tiny:seed=0", draft_dtype=torch.bfloat16)
    try:
        for prompt in PROMPTS:
            reply = await stack.generate(prompt_ids=prompt, max_new_tokens=MAX_NEW, speculation={"fixed_k": 4})
            assert list(reply.token_ids) == reference_greedy(prompt)
            assert 0.3 < reply.stats.acceptance_rate <= 1.0
    finally:
        await stack.close()


@pytest.mark.parametrize("kind", ["bf16", "int4"])
async def test_a_draft_on_reduced_copies_for_few_rows_keeps_greedy_output_identical(monkeypatch: pytest.MonkeyPatch,
                                                                                   kind: str) -> None:
    """The draft's GEMM path may run its few-row steps on int4 copies of the weights, or a float32
    draft's on bf16 ones (linear_path "reduced"): its numerics change, the target's greedy output does
    not. With bf16 copies its proposals stay about as good as float32's (a broken copy would show as
    acceptance collapsing). Not so with int4 on this random-weight model: 16 levels per group of
    random weights cost it most of its acceptance (0.12 against 0.42), which is what the startup
    distribution check (calibration.reduced_overlap) is there to catch; real drafts kept 0.97."""
    from specdec import linear_path
    if kind == "int4" and not linear_path.int4_supported():
        pytest.skip("ATen's CPU int4 kernel is missing here")
    calls = []
    real = linear_path.reduced_linear
    monkeypatch.setattr(linear_path, "reduced_linear", lambda *args: calls.append(1) or real(*args))
    stack = await start_stack(draft_ref="tiny:seed=0,noise=0.02")
    draft = stack.draft.core.model  # the process-wide cached model: put its modules back afterwards
    linears = [(parent, name, child) for parent in draft.modules() for name, child in parent.named_children()
               if type(child) is torch.nn.Linear]
    try:
        float32 = [await stack.generate(prompt_ids=p, max_new_tokens=MAX_NEW, speculation={"fixed_k": 4})
                   for p in PROMPTS]
        # Every shape its kind of copy fits (int4: whole groups of 32 inputs, outputs by 16; not the
        # 260-word head).
        fits = [c for _, _, c in linears if kind == "bf16" or (c.in_features % 32 == 0 and c.out_features % 16 == 0)]
        plans = {(c.out_features, c.in_features): linear_path.ShapePlan(False, (1,), (False,), reduced_rows=2,
                                                                         reduced_kind=kind) for c in fits}
        assert linear_path.apply(draft, linear_path.PathChoice(plans)) == len(fits) > 0
        for prompt, before in zip(PROMPTS, float32):
            reply = await stack.generate(prompt_ids=prompt, max_new_tokens=MAX_NEW, speculation={"fixed_k": 4})
            assert list(reply.token_ids) == reference_greedy(prompt)
            assert reply.stats.draft_tokens > 0
            if kind == "bf16":
                assert reply.stats.acceptance_rate >= before.stats.acceptance_rate - 0.15, (reply.stats, before.stats)
        assert calls  # the draft's steps really ran on the copies
    finally:
        for parent, name, child in linears:
            setattr(parent, name, child)
        await stack.close()


async def test_acceptance_reflects_draft_quality(stack, disagreeing_stack) -> None:
    same = await stack.generate(prompt_ids=PROMPTS[0], max_new_tokens=MAX_NEW, speculation={"fixed_k": 4})
    worse = await disagreeing_stack.generate(prompt_ids=PROMPTS[0], max_new_tokens=MAX_NEW, speculation={"fixed_k": 4})
    assert same.stats.acceptance_rate == 1.0
    assert same.stats.rounds == MAX_NEW // 5  # 4 accepted + bonus per round
    assert worse.stats.acceptance_rate < 0.7
    assert sum(worse.stats.accepted_per_position) == worse.stats.accepted_tokens


async def test_k0_is_plain_target_decoding(disagreeing_stack) -> None:
    reply = await disagreeing_stack.generate(prompt_ids=PROMPTS[1], max_new_tokens=20, speculation={"fixed_k": 0})
    assert list(reply.token_ids) == reference_greedy(PROMPTS[1], 20)
    assert reply.stats.draft_tokens == 0 and reply.stats.rounds == 20 and reply.stats.bytes_to_draft == 0


async def test_stream_equals_unary(disagreeing_stack) -> None:
    from tests.stack import request
    unary = await disagreeing_stack.generate(prompt="hello world", max_new_tokens=30, speculation={"fixed_k": 3})
    chunks = [c async for c in disagreeing_stack.stub.GenerateStream(
        request(prompt="hello world", max_new_tokens=30, speculation={"fixed_k": 3}), timeout=60)]
    assert len(chunks) > 1
    assert [t for c in chunks for t in c.token_ids] == list(unary.token_ids)
    assert "".join(c.text_delta for c in chunks) == unary.text
    assert chunks[-1].HasField("stats") and not any(c.HasField("stats") for c in chunks[:-1])
    assert chunks[-1].finish_reason == unary.finish_reason


async def test_sampled_run_is_reproducible_with_seed(disagreeing_stack) -> None:
    kwargs = dict(prompt_ids=PROMPTS[0], max_new_tokens=40, temperature=0.9, top_k=50, top_p=0.95,
                  speculation={"fixed_k": 3})
    a = await disagreeing_stack.generate(seed=1234, **kwargs)
    b = await disagreeing_stack.generate(seed=1234, **kwargs)
    c = await disagreeing_stack.generate(seed=4321, **kwargs)
    assert list(a.token_ids) == list(b.token_ids)
    assert list(a.token_ids) != list(c.token_ids)
    assert a.stats.seed == 1234
    # Without a seed the server picks one and reports it; replaying with it reproduces the output.
    d = await disagreeing_stack.generate(**kwargs)
    e = await disagreeing_stack.generate(seed=d.stats.seed, **kwargs)
    assert list(d.token_ids) == list(e.token_ids)


async def test_sampling_bytes_grow_with_k_not_vocab(disagreeing_stack) -> None:
    """q travels sparse: bytes per drafted token follow the warped support (top_k), not the vocabulary."""
    async def bytes_per_draft_token(**kw) -> float:
        r = await disagreeing_stack.generate(prompt_ids=PROMPTS[0], max_new_tokens=40, seed=1,
                                             speculation={"fixed_k": 4}, **kw)
        return r.stats.bytes_to_target / max(1, r.stats.draft_tokens)
    sparse = await bytes_per_draft_token(temperature=1.0, top_k=8)
    dense = await bytes_per_draft_token(temperature=1.0)  # untruncated: ~256 entries per position
    greedy = await bytes_per_draft_token()
    assert greedy < 40          # ids only (plus the per-call session id and commit)
    assert sparse < 8 * 10 + 40  # ~8 (id, prob) pairs per position
    assert dense > 5 * sparse


async def test_stop_strings_truncate_text_and_tokens(stack) -> None:
    full = await stack.generate(prompt="abc", max_new_tokens=30, speculation={"fixed_k": 3})
    text = full.text
    assert len(text) > 6
    stop = text[3:5]
    cut = await stack.generate(prompt="abc", max_new_tokens=30, stop=[stop], speculation={"fixed_k": 3})
    assert cut.finish_reason == orchestrator_pb2.FINISH_REASON_STOP
    assert cut.text == text[:text.find(stop)]
    assert list(cut.token_ids) == list(full.token_ids)[:len(cut.token_ids)]


async def test_chat_messages_use_the_chat_template(stack) -> None:
    tok = cached_model("tiny:seed=0").tokenizer
    messages = [("system", "be brief"), ("user", "hi")]
    rendered = tok.apply_chat_template([{"role": r, "content": c} for r, c in messages])
    chat = await stack.generate(messages=messages, max_new_tokens=20)
    raw = await stack.generate(prompt_ids=rendered, max_new_tokens=20)
    assert list(chat.token_ids) == list(raw.token_ids)
    assert chat.stats.prompt_tokens == len(rendered)


async def test_server_default_policy_comes_from_config() -> None:
    s = await start_stack(draft_ref="tiny:seed=0,noise=0.04", speculation=SpeculationConfig(policy="fixed", fixed_k=2))
    try:
        reply = await s.generate(prompt_ids=PROMPTS[0], max_new_tokens=20)
        assert set(reply.stats.k_per_round[:-1]) == {2}
        reply = await s.generate(prompt_ids=PROMPTS[0], max_new_tokens=20, speculation={"fixed_k": 1})
        assert set(reply.stats.k_per_round[:-1]) == {1}  # the request overrides the server default
    finally:
        await s.close()


async def test_concurrent_requests_on_one_session_are_refused(stack) -> None:
    import asyncio
    first = asyncio.ensure_future(stack.generate(prompt_ids=PROMPTS[0], max_new_tokens=200, session_id="busy"))
    for _ in range(500):  # until the first turn holds the session (a fixed sleep raced it)
        if (session := stack.orch.engine.sessions.get("busy")) is not None and session.lock.locked():
            break
        await asyncio.sleep(0.01)
    assert session is not None and session.lock.locked()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.generate(prompt_ids=PROMPTS[0], max_new_tokens=5, session_id="busy")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "busy" in err.value.details()
    await first
