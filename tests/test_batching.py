"""Cross-session batching on each worker: ragged forwards, identity under batching, queue limits and
a bounded mixed load with cancellations and a draft restart. Real gRPC servers on 127.0.0.1."""
from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from typing import Callable

import grpc
import pytest
import torch

from orchestrator.api import EngineLimits
from orchestrator.config import SpeculationConfig
from specdec.models import load_model, new_cache
from specdec.ragged import (RaggedForward, RaggedItem, packed_attention_agrees, reference_packed_attention,
                            torch_varlen_attention, unsupported_reason)
from specdec.scheduler import BatchLimits
from specdec.v1 import common_pb2, worker_pb2
from specdec.worker_core import ForwardStep, WorkerCore, WorkerSession
from tests.stack import cancel_stream_after, request, start_stack, start_worker, target_stub
from tests.test_e2e_generate import reference_greedy

PROMPTS = [[random.Random(i).randrange(3, 250) for _ in range(4 + 3 * i)] for i in range(8)]


@contextlib.contextmanager
def slow_solo_forwards(model: torch.nn.Module, ms: float):
    """A forward of one call alone (the model's own forward) takes at least `ms`; batched forwards
    (ragged, which does not go through the model's forward) do not. Calls sent together then surely
    overlap a forward and meet in the next one, however fast or loaded the machine is."""
    handle = model.register_forward_pre_hook(lambda module, args: time.sleep(ms / 1000.0))
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def hold_first_solo_forward(model: torch.nn.Module, until: Callable[[], bool], timeout_s: float = 20.0):
    """The first forward of one call alone (or the first through `model`, a submodule that every
    forward runs) waits (up to timeout_s) until `until()` holds: calls sent meanwhile are all in the
    scheduler when it ends, and the next forward selects among all of them, whatever the order and
    timing of their arrival."""
    held = threading.Event()

    def hold(module, args) -> None:
        if held.is_set():
            return
        held.set()
        deadline = time.monotonic() + timeout_s
        while not until() and time.monotonic() < deadline:
            time.sleep(0.005)
    handle = model.register_forward_pre_hook(hold)
    try:
        yield held  # set once the first forward is held
    finally:
        handle.remove()


# ----------------------------------------------------------------------------- the ragged forward

def hf_logits(model: torch.nn.Module, chunks: list[list[int]]) -> list[torch.Tensor]:
    cache = new_cache(model)
    return [model(input_ids=torch.tensor([c]), past_key_values=cache, use_cache=True).logits[0].float()
            for c in chunks]


@pytest.mark.parametrize("ref", ["tiny:seed=0", "tiny:seed=3,layers=3,hidden=96"])
def test_a_batch_of_one_is_bitwise_the_models_own_forward(ref: str) -> None:
    model = load_model(ref).model
    ragged = RaggedForward(model)
    cache = new_cache(model)
    chunks = [[5, 6, 7, 8], [9], [10, 11, 12]]
    ours = [ragged([RaggedItem(cache, c)])[0] for c in chunks]
    for mine, theirs in zip(ours, hf_logits(model, chunks)):
        assert torch.equal(mine, theirs)


def test_ragged_sessions_match_their_own_forwards() -> None:
    model = load_model("tiny:seed=0").model
    ragged = RaggedForward(model)
    histories = [[[3, 4, 5, 6, 7], [8, 9]], [[20], [21, 22, 23]], [[40, 41, 42, 43, 44, 45, 46, 47], [48]]]
    caches = [new_cache(model) for _ in histories]
    step1 = ragged([RaggedItem(c, h[0]) for c, h in zip(caches, histories)])
    step2 = ragged([RaggedItem(c, h[1], logits_rows=1) for c, h in zip(caches, histories)])
    for i, history in enumerate(histories):
        alone = hf_logits(model, history)
        # Same values up to the GEMM's reduction order for a different number of rows.
        torch.testing.assert_close(step1[i], alone[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(step2[i], alone[1][-1:], rtol=1e-4, atol=1e-4)
        assert step1[i].argmax(-1).tolist() == alone[0].argmax(-1).tolist()
        assert caches[i].get_seq_length() == sum(len(c) for c in history)


def test_asking_for_more_logit_rows_than_tokens_gives_the_items_own_rows() -> None:
    # As the model's own logits_to_keep: clamped to the item, never the previous item's rows.
    model = load_model("tiny:seed=0").model
    out = RaggedForward(model)([RaggedItem(new_cache(model), [5, 6, 7, 8], 1),
                                RaggedItem(new_cache(model), [9, 10], logits_rows=3)])
    alone = hf_logits(model, [[9, 10]])[0]
    assert out[1].shape == alone.shape
    torch.testing.assert_close(out[1], alone, rtol=1e-4, atol=1e-4)


def test_unsupported_architectures_run_one_forward_per_step() -> None:
    loaded = load_model("tiny:seed=0")
    core = WorkerCore(loaded, "target")
    assert core.ragged_unsupported is None
    model = load_model("tiny:seed=0").model
    # Attention the ragged mask or rotary table would get wrong is refused, not approximated.
    model.config.sliding_window, model.config.use_sliding_window = 64, True
    assert "sliding" in unsupported_reason(model)
    model.config.use_sliding_window = False
    model.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    assert "dynamic" in unsupported_reason(model)
    model.config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    model.config.model_type = "gpt_neox"  # not a Llama-shaped decoder as far as ragged.py knows
    assert "not one of" in unsupported_reason(model)
    loaded_copy = type(loaded)(loaded.ref, model, loaded.tokenizer, loaded.vocab_size, loaded.max_context,
                               loaded.eos_token_ids)
    fallback = WorkerCore(loaded_copy, "target")
    assert fallback._ragged is None
    sessions = [WorkerSession(new_cache(model)) for _ in range(2)]
    out = fallback.feed_many([ForwardStep(sessions[0], [5, 6], 1), ForwardStep(sessions[1], [7], 1)])
    alone = model(input_ids=torch.tensor([[5, 6]]), past_key_values=new_cache(model), logits_to_keep=1)
    assert torch.equal(out[0], alone.logits[0].float())
    assert torch.equal(out[1], hf_logits(model, [[7]])[0])
    assert [s.tokens for s in sessions] == [[5, 6], [7]]


def test_run_one_at_a_time_a_steps_failure_is_its_own() -> None:
    """Without ragged batching the steps of a forward run one after another: a step that fails
    (out of memory, say) returns its error as its output, and the steps that ran keep theirs."""
    core = WorkerCore(load_model("tiny:seed=0"), "target")
    core._ragged = None
    good, bad = WorkerSession(new_cache(core.model)), WorkerSession(new_cache(core.model))
    feed = core.feed

    def feed_failing_for_bad(session, tokens, logits_rows=0):
        if session is bad:
            raise RuntimeError("out of memory (bad only)")
        return feed(session, tokens, logits_rows)

    core.feed = feed_failing_for_bad
    out = core.feed_many([ForwardStep(good, [5, 6, 7], 1), ForwardStep(bad, [8], 1)])
    assert isinstance(out[0], torch.Tensor) and out[0].shape[0] == 1 and good.tokens == [5, 6, 7]
    assert isinstance(out[1], RuntimeError) and bad.tokens == []
    with pytest.raises(RuntimeError):  # a step alone still raises, as before
        core.feed_many([ForwardStep(bad, [8], 1)])


def test_a_batched_forward_out_of_memory_is_resource_exhausted_for_its_calls() -> None:
    """Two verifies share a ragged forward that runs out of memory (torch's own CPU allocator error,
    by asking it for 4 EiB): both fail RESOURCE_EXHAUSTED with a retry hint, not INTERNAL; their
    caches were reset, so a retry from the whole prefix works."""
    from specdec.contract import Commit, SamplingConfig
    from specdec.errors import CapacityExceeded
    from specdec.scheduler import BatchScheduler
    from target_worker.engine import TargetEngine, VerifyParams
    core = WorkerCore(load_model("tiny:seed=0"), "target")
    engine = TargetEngine(core)
    ragged = core._ragged
    assert ragged is not None

    def ragged_out_of_memory(items):
        if len(items) == 2:
            torch.empty(2 ** 62, dtype=torch.uint8)  # raises: DefaultCPUAllocator: can't allocate memory
        return ragged(items)
    core._ragged = ragged_out_of_memory
    scheduler = BatchScheduler(core.feed_many, BatchLimits(window_ms=0.0), name="target-model")
    try:
        def verify(session: str):
            params = VerifyParams(session, Commit(0, 0, tuple(PROMPTS[1])), (), (), SamplingConfig())
            return scheduler.submit(session, lambda: engine.verify_steps(params))[0]
        entered, gate = threading.Event(), threading.Event()

        def hold(module, args) -> None:
            entered.set()
            assert gate.wait(30)
        handle = core.model.register_forward_pre_hook(hold)
        first = verify("x")
        assert entered.wait(30)  # x's solo forward: a and b arrive during it and share the next one
        handle.remove()
        failing = [verify("a"), verify("b")]
        gate.set()
        first.result(30)
        for future in failing:
            with pytest.raises(CapacityExceeded, match="out of memory") as failed:
                future.result(30)
            assert failed.value.code_name == "RESOURCE_EXHAUSTED" and failed.value.retry_after_ms > 0
        # Nothing to trust, and both were created for these calls: not kept (held to --max-sessions)
        assert core.session_tokens("a") is None and core.session_tokens("b") is None
        assert verify("a").result(30).next_token == first.result().next_token  # the retry from the prefix
    finally:
        scheduler.close()


def test_a_step_split_into_prefill_chunks_feeds_what_the_whole_step_does() -> None:
    core = WorkerCore(load_model("tiny:seed=0", torch.float32), "target")
    prompt = [random.Random(5).randrange(3, 250) for _ in range(23)]
    whole, chunked = WorkerSession(new_cache(core.model)), WorkerSession(new_cache(core.model))
    for session in (whole, chunked):  # a cache to crop: the commit's crop must run once, first
        core.feed_many([ForwardStep(session, [9, 9, 9, 9], 1)])
    step = ForwardStep(whole, prompt, 3, crop_to=2)
    expected = core.feed_many([step])[0]
    rest = ForwardStep(chunked, prompt, 3, crop_to=2)
    heads = []
    while (parts := rest.split(8)) is not None:
        head, rest = parts
        heads.append((len(head.tokens), head.logits_rows, head.crop_to))
        core.feed_many([head])
    got = core.feed_many([rest])[0]
    # The head never takes a row whose logits are wanted, and only the first crops.
    assert heads == [(8, 1, 2), (8, 1, -1), (4, 1, -1)] and len(rest.tokens) == 3 and rest.crop_to == -1
    assert chunked.tokens == whole.tokens == [9, 9] + prompt
    assert torch.allclose(got, expected, atol=1e-4) and torch.equal(got.argmax(-1), expected.argmax(-1))
    assert ForwardStep(whole, prompt, 0).split(8) is None  # every row's logits wanted: not splittable
    assert ForwardStep(whole, [1, 2], 2).split(8) is None


# ----------------------------------------------------------------------------- identity under batching

@pytest.mark.parametrize("speculation, prefill_chunk",
                         [({"fixed_k": 3}, 64), ({"policy": "cost", "max_k": 6}, 64), ({"fixed_k": 0}, 64),
                          ({"fixed_k": 3}, 4)],
                         ids=["k3", "adaptive", "target-only", "k3-chunked-prefill"])
async def test_concurrent_streams_are_token_identical_to_each_alone(speculation: dict, prefill_chunk: int) -> None:
    stack = await start_stack(draft_ref="tiny:seed=0,noise=0.02", batch=BatchLimits(prefill_chunk=prefill_chunk))
    try:
        # Prompts longer than a decode step (33 rows) where prefills are chunked.
        prompts = PROMPTS if prefill_chunk == 64 else [p * 3 for p in PROMPTS]
        alone = [reference_greedy(p, 24) for p in prompts]
        target = stack.target.scheduler
        forwards_before = target.forwards
        if prefill_chunk == 64:
            meet = slow_solo_forwards(stack.target.core.model, 30)
        else:
            # Prompts of 12 to 30 tokens verify 3 drafts in a decode-sized step (<= 33 rows); those of
            # 39 to 75 do not. Holding the first forward until the other 7 calls wait puts both kinds
            # in the next forward: the long ones are chunked between the short ones' decode steps.
            # (Held at the embedding, which ragged forwards run too: a first forward that already
            # batched two calls went by unheld, and the calls then trickled in without meeting.)
            meet = hold_first_solo_forward(stack.target.core.model.model.embed_tokens,
                                           lambda: target.waiting_calls + len(target._active) >= len(prompts))
        with meet as held:
            calls = [stack.generate(prompt_ids=p, max_new_tokens=24, speculation=speculation) for p in prompts]
            if prefill_chunk == 64:
                replies = await asyncio.gather(*calls)
            else:
                # The shortest prompt's verify first, alone in the held forward: sent together, the
                # short prompts' verifies came first (their drafts' prefills are shorter), filled the
                # first forward, and the long ones then met no decode-sized step to be chunked beside
                # (seen once in CI: prefill_chunks 0).
                first = asyncio.ensure_future(calls[0])
                for _ in range(2000):
                    if held is not None and held.is_set():
                        break
                    await asyncio.sleep(0.005)
                rest = asyncio.gather(*calls[1:])  # sent now, while the first forward is held
                replies = [await first, *await rest]
        assert [list(r.token_ids) for r in replies] == alone
        # The streams really shared forwards on the target.
        forwards = target.forwards - forwards_before
        assert forwards > 0 and target.batched_sessions > target.forwards, (forwards, target.batched_sessions)
        if speculation.get("fixed_k"):
            assert stack.draft.scheduler.batched_sessions > stack.draft.scheduler.forwards
        if prefill_chunk == 4:  # prompts of 39 to 75 tokens met other calls' decode steps in chunks
            assert target.prefill_chunks > 0
    finally:
        await stack.close()


async def test_worker_timing_reports_the_batch() -> None:
    stack = await start_stack()
    try:
        stub = target_stub(stack)

        async def verify(i: int) -> worker_pb2.VerifyResponse:
            commit = common_pb2.CacheCommit(append_tokens=PROMPTS[i])
            return await stub.Verify(worker_pb2.VerifyRequest(session_id=f"t{i}", commit=commit,
                                                              draft_tokens=[7, 8]), timeout=30)
        with slow_solo_forwards(stack.target.core.model, 100):
            replies = await asyncio.gather(*(verify(i) for i in range(6)))
        assert all(r.timing.batch_prompt_rows == 0 for r in replies)  # every step decode-sized (<= 33 rows)
        sizes = [r.timing.batch_sessions for r in replies]
        assert all(1.0 <= s <= 6.0 for s in sizes) and max(sizes) > 1.0, sizes
        assert all(r.timing.batch_rows >= len(PROMPTS[i]) + 2 for i, r in enumerate(replies))
        assert all(r.timing.queue_ms >= 0.0 and 0.0 <= r.timing.worker_utilisation <= 1.0 for r in replies)
        info = await stub.GetInfo(common_pb2.GetInfoRequest())
        assert info.max_batch == 8 and info.batching == "ragged, attention per-session"  # a CPU: no flash kernel
    finally:
        await stack.close()


async def test_worker_timing_reports_the_prompt_rows_beside_a_call() -> None:
    """A verify that shares its forward with another session's 51-row prompt reports those rows
    (the pair guard takes them out of the round's time); one alone reports none."""
    stack = await start_stack()
    try:
        stub, scheduler = target_stub(stack), stack.target.scheduler

        def verify(session: str, prompt: list[int]):
            return stub.Verify(worker_pb2.VerifyRequest(session_id=session, commit=common_pb2.CacheCommit(
                append_tokens=prompt), draft_tokens=[7, 8]), timeout=30)
        long_prompt = [random.Random(99).randrange(3, 250) for _ in range(49)]
        # The first call runs alone and is held until the other two wait: they share the next forward.
        with hold_first_solo_forward(stack.target.core.model, lambda: scheduler.waiting_calls >= 2):
            alone = asyncio.ensure_future(verify("a", PROMPTS[0]))
            deadline = time.monotonic() + 10.0
            while scheduler.snapshot().active < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            beside, prompt = await asyncio.gather(verify("b", PROMPTS[1]), verify("p", long_prompt))
            alone = await alone
        assert alone.timing.batch_prompt_rows == 0 and alone.timing.batch_sessions == 1
        assert beside.timing.batch_sessions == 2 and beside.timing.batch_prompt_rows == 51
        assert prompt.timing.batch_prompt_rows == 51  # its own
    finally:
        await stack.close()


async def test_a_finished_request_is_not_expected_back_by_the_workers() -> None:
    """An ephemeral session's EndSession tells each worker's scheduler that the session will not
    come back: no forward waits for it (with --shared-compute a wait could last a forward)."""
    stack = await start_stack(speculation=SpeculationConfig(policy="fixed", fixed_k=2, guard=False))
    try:
        await stack.generate(prompt_ids=PROMPTS[3], max_new_tokens=8)
        schedulers = (stack.target.scheduler, stack.draft.scheduler)
        deadline = time.monotonic() + 10.0
        while any(s._returns for s in schedulers) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # EndSession runs after the reply, in the background
        assert [dict(s._returns) for s in schedulers] == [{}, {}]
    finally:
        await stack.close()


def test_a_call_cancelled_before_its_forward_leaves_the_cache_as_it_was() -> None:
    """The commit's crop happens with its forward: a call dropped while it waits changes nothing."""
    from specdec.contract import Commit, prefix_hash
    from target_worker.engine import TargetEngine, VerifyParams
    from specdec.contract import SamplingConfig
    core = WorkerCore(load_model("tiny:seed=0"), "target")
    engine = TargetEngine(core)
    prompt = [5, 6, 7, 8, 9]
    engine.verify(VerifyParams("s", Commit(0, 0, tuple(prompt)), (), (), SamplingConfig()))
    held = list(core.session_tokens("s"))
    # Keep 3 tokens and verify: the call is admitted (checks, pin) and then dropped before its forward.
    steps = engine.verify_steps(VerifyParams("s", Commit(3, prefix_hash(held[:3]), ()), (11,), (), SamplingConfig()))
    step = next(steps)
    assert step.crop_to == 2 and step.tokens == [held[2], 11]
    steps.close()
    assert core.session_tokens("s") == held and core.store._slots["s"].pinned == 0
    assert core.store.get("s").cache.get_seq_length() == len(held)


def _budget_core(role: str, tokens: int) -> WorkerCore:
    """A worker core whose KV byte budget holds `tokens` tokens."""
    from specdec.worker_core import StoreLimits
    loaded = load_model("tiny:seed=0")
    per_token = WorkerCore(loaded, role)._bytes_per_token
    return WorkerCore(loaded, role, StoreLimits(max_bytes=tokens * per_token, ttl_s=600.0))


def test_calls_admitted_together_cannot_overcommit_the_kv_budget() -> None:
    """Two 80-token prompts admitted in one scheduler pass, budget 100 tokens: each call's checks
    run before either forward, so the second must see the first's reservation (both ran, holding
    1.6x the budget)."""
    from specdec.contract import Commit, SamplingConfig
    from specdec.errors import CapacityExceeded
    from target_worker.engine import TargetEngine, VerifyParams
    core = _budget_core("target", 100)
    engine = TargetEngine(core)
    prompt = tuple(range(3, 83))
    first = engine.verify_steps(VerifyParams("a", Commit(0, 0, prompt), (), (), SamplingConfig()))
    assert len(next(first).tokens) == 80  # admitted: checked and pinned, its forward not yet run
    with pytest.raises(CapacityExceeded, match="budget"):
        next(engine.verify_steps(VerifyParams("b", Commit(0, 0, prompt), (), (), SamplingConfig())))
    first.close()
    assert "b" not in core.store  # the refused call leaves no empty session behind
    assert "a" not in core.store  # nor the admitted one, cancelled before its forward ran


def test_a_draft_near_the_whole_budget_drafts_fewer_tokens_rather_than_fail() -> None:
    """Budget 40 tokens, a 35-token session, k = 8: the reservation for 8 drafts was over the whole
    budget, so every such Propose was INVALID_ARGUMENT (and its round target-only), although 5 fit."""
    from draft_worker.engine import DraftEngine, ProposeParams
    from specdec.contract import Commit, SamplingConfig
    core = _budget_core("draft", 40)
    engine = DraftEngine(core)
    result = engine.propose(ProposeParams("s", Commit(0, 0, tuple(range(3, 38))), 8, SamplingConfig()))
    assert len(result.tokens) == 5 and result.cache_len == 39  # (the last draft is not fed)
    assert core.store.total_bytes() <= core.store.max_bytes


def test_a_call_that_cannot_fit_evicts_nobody() -> None:
    """A prompt over the whole budget is refused before any idle session is evicted for it (a client
    retrying it wiped every other session's cache)."""
    from specdec.contract import Commit, SamplingConfig
    from specdec.errors import InvalidRequest
    from target_worker.engine import TargetEngine, VerifyParams
    core = _budget_core("target", 100)
    engine = TargetEngine(core)
    for i in range(5):
        engine.verify(VerifyParams(f"idle{i}", Commit(0, 0, tuple(range(3, 18))), (), (), SamplingConfig()))
    with pytest.raises(InvalidRequest):
        engine.verify(VerifyParams("huge", Commit(0, 0, (7,) * 150), (), (), SamplingConfig()))
    assert sorted(core.store._slots) == [f"idle{i}" for i in range(5)] and core.store.evictions == 0


def test_a_refused_branch_call_leaves_no_copy_and_an_impossible_one_is_invalid(monkeypatch) -> None:
    """A fork's copy was checked against the budget twice; refused the second time, the copy stayed.
    A call that not even an empty worker could hold is INVALID_ARGUMENT, not a retryable
    RESOURCE_EXHAUSTED."""
    from draft_worker.engine import DraftEngine, ProposeParams
    from specdec.contract import Commit, SamplingConfig, prefix_hash, slot_key
    from specdec.errors import CapacityExceeded, InvalidRequest
    core = _budget_core("draft", 40)
    engine = DraftEngine(core)
    text = tuple(range(3, 23))
    engine.propose(ProposeParams("s", Commit(0, 0, text), 0, SamplingConfig()))
    held = engine.propose_steps(ProposeParams("other", Commit(0, 0, tuple(range(3, 18))), 0, SamplingConfig()))
    next(held)  # another call in use: 15 tokens pinned
    fork = Commit(20, prefix_hash(list(text)), (42,))
    copies = []
    import specdec.worker_core
    monkeypatch.setattr(specdec.worker_core, "copy_cache", lambda *a: copies.append(a) or pytest.fail("copied"))
    with pytest.raises(CapacityExceeded):  # 20 + 1 + 8 drafts next to the 15 in use
        next(engine.propose_steps(ProposeParams("s", fork, 8, SamplingConfig(), slot=1, fork_from=0)))
    assert not copies  # refused before the KV copy, not after it
    assert slot_key("s", 1) not in core.store and core.session_tokens("s") == list(text)
    held.close()
    with pytest.raises(InvalidRequest, match="whole KV budget"):
        next(engine.propose_steps(ProposeParams("big", Commit(0, 0, tuple(range(3, 50))), 0, SamplingConfig())))


def test_the_draft_reserves_room_for_the_tokens_it_drafts() -> None:
    """A Propose feeds its k drafts after the commit's forward: they count against the budget from
    the start, so a session that leaves no room for them evicts an idle one first."""
    from draft_worker.engine import DraftEngine, ProposeParams
    from specdec.contract import Commit, SamplingConfig
    core = _budget_core("draft", 40)
    engine = DraftEngine(core)
    engine.propose(ProposeParams("idle", Commit(0, 0, tuple(range(3, 13))), 0, SamplingConfig()))
    steps = engine.propose_steps(ProposeParams("a", Commit(0, 0, tuple(range(3, 28))), 8, SamplingConfig()))
    next(steps)  # admitted: 25 committed + 8 drafts reserved, 10 idle would make 43 > 40
    assert "idle" not in core.store
    steps.close()


# ----------------------------------------------------------------------------- limits

async def test_a_full_worker_queue_answers_resource_exhausted_with_a_retry_hint() -> None:
    handle, servicer = await start_worker("target", "tiny:seed=0", batch=BatchLimits(max_batch=1, max_queue=1))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}")
    try:
        from specdec.v1 import worker_pb2_grpc
        stub = worker_pb2_grpc.TargetWorkerStub(channel)
        # A long prefill each, so that the first is still running when the others arrive.
        long_prompt = [random.Random(9).randrange(3, 250) for _ in range(480)]
        calls = [stub.Verify(worker_pb2.VerifyRequest(session_id=f"s{i}", draft_tokens=[5],
                                                      commit=common_pb2.CacheCommit(append_tokens=long_prompt)),
                             timeout=60) for i in range(8)]
        with slow_solo_forwards(servicer.core.model, 300):
            results = await asyncio.gather(*(c for c in calls), return_exceptions=True)
        refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        assert refused and all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused), results
        assert len(refused) < len(results)  # the running and the queued call were served
        hint = dict(list(refused[0].trailing_metadata() or ()))
        assert int(hint["retry-after-ms"]) > 0 and "retry after" in refused[0].details()
        assert servicer.scheduler.rejected == len(refused)
    finally:
        await channel.close()
        await handle.stop(0)
        servicer.close()


# ----------------------------------------------------------------------------- nothing is lost

async def test_mixed_load_with_cancellations_and_a_draft_restart_loses_nothing() -> None:
    """200 requests, 8 at a time: greedy with several k, some streams cancelled by their client, and
    the draft worker stopped and restarted on the same port in the middle. Every request completes
    with the single-stream output or fails with a clear status; none hangs."""
    stack = await start_stack(draft_ref="tiny:seed=0,noise=0.02", max_concurrent=8, max_queue=256,
                              engine_limits=EngineLimits(draft_timeout_s=2.0))
    draft_port = stack.draft_handle.port
    expected = {i: reference_greedy(p, 12) for i, p in enumerate(PROMPTS)}
    outcomes: dict[str, int] = {}
    mismatches: list[int] = []
    done = asyncio.Event()
    finished = [0]
    fallback_rounds = [0]
    restarted_after = [0]
    semaphore = asyncio.Semaphore(8)

    async def one(n: int) -> None:
        idx = n % len(PROMPTS)
        speculation = [{"fixed_k": 3}, {"fixed_k": 1}, {"policy": "cost", "max_k": 6}, {"fixed_k": 0}][n % 4]
        async with semaphore:
            try:
                if n % 10 == 7:
                    await cancel_stream_after(stack, 3, prompt_ids=PROMPTS[idx], max_new_tokens=12,
                                              speculation=speculation)
                    outcomes["cancelled"] = outcomes.get("cancelled", 0) + 1
                else:
                    reply = await stack.generate(prompt_ids=PROMPTS[idx], max_new_tokens=12,
                                                 speculation=speculation, timeout=60)
                    if list(reply.token_ids) != expected[idx]:
                        mismatches.append(n)
                    fallback_rounds[0] += reply.stats.fallback_rounds
                    outcomes["ok"] = outcomes.get("ok", 0) + 1
            except grpc.aio.AioRpcError as err:
                outcomes[err.code().name] = outcomes.get(err.code().name, 0) + 1
                assert err.code() != grpc.StatusCode.INTERNAL and err.details(), err
            finished[0] += 1
            if finished[0] == 60:
                done.set()

    async def restart_draft() -> None:
        await done.wait()
        await stack.draft_handle.stop(0)
        stack.draft.close()
        await asyncio.sleep(0.3)
        stack.draft_handle, stack.draft = await start_worker("draft", "tiny:seed=0,noise=0.02", port=draft_port)
        restarted_after[0] = finished[0]

    await asyncio.wait_for(asyncio.gather(restart_draft(), *(one(n) for n in range(200))), timeout=240)
    try:
        assert sum(outcomes.values()) == 200, outcomes
        assert not mismatches, mismatches
        assert outcomes.get("cancelled") == 20
        assert outcomes.get("ok", 0) == 180, outcomes  # draft failures fall back to target-only rounds
        # The restart happened under load: requests in flight lost their draft and fell back.
        assert restarted_after[0] < 200 and fallback_rounds[0] > 0, (restarted_after, fallback_rounds)
        # After the restart the orchestrator speculates again.
        for _ in range(50):
            reply = await stack.generate(prompt_ids=PROMPTS[0], max_new_tokens=12, speculation={"fixed_k": 3})
            assert list(reply.token_ids) == expected[0]
            if reply.stats.fallback_rounds == 0 and reply.stats.draft_tokens > 0:
                break
            await asyncio.sleep(0.2)
        else:
            pytest.fail("never speculated again after the draft restart")
        assert stack.target.scheduler.snapshot().active == 0 and stack.target.scheduler.snapshot().waiting == 0
    finally:
        await stack.close()


async def test_the_retry_hint_reaches_the_orchestrators_caller() -> None:
    stack = await start_stack(batch=BatchLimits(max_batch=1, max_queue=0))
    try:
        with slow_solo_forwards(stack.target.core.model, 200):
            results = await asyncio.gather(*(stack.generate(prompt_ids=p, max_new_tokens=4, speculation={"fixed_k": 0})
                                             for p in PROMPTS[:4]), return_exceptions=True)
        refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        assert refused and all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused), results
        assert int(dict(list(refused[0].trailing_metadata() or ()))["retry-after-ms"]) > 0
        assert "target worker" in refused[0].details()
    finally:
        await stack.close()


def test_load_report_rates_and_ratios_by_hand() -> None:
    from specdec.tools.loadreport import Level, pooled, pooled_busy, ratios
    # Two streams: the first ends at 3 s, the second at 6 s. By 3 s, 2 + 3 tokens had come: 5 / 3 tok/s.
    spec0 = Level("speculative", 2, 0, tokens=9, wall_s=6.0, arrivals=[(1.0, 2), (2.0, 3), (5.0, 4)],
                  stream_ends=[3.0, 6.0])
    assert spec0.busy_tokens_per_s() == pytest.approx(5 / 3) and spec0.summary()["tokens_per_s"] == 1.5
    plain0 = Level("target-only", 2, 0, tokens=6, wall_s=3.0, arrivals=[(1.0, 3), (3.0, 3)], stream_ends=[3.0, 3.0])
    plain1 = Level("target-only", 2, 1, tokens=6, wall_s=6.0, arrivals=[(2.0, 3), (6.0, 3)], stream_ends=[6.0, 6.0])
    spec1 = Level("speculative", 2, 1, tokens=8, wall_s=4.0, arrivals=[(2.0, 8)], stream_ends=[2.0, 4.0])
    levels = [spec0, plain0, plain1, spec1]
    # Each speculative block against the target-only block of its own repeat.
    assert ratios(levels)[2] == pytest.approx([1.5 / 2.0, 2.0 / 1.0])
    assert ratios(levels, busy=True)[2] == pytest.approx([(5 / 3) / 2.0, 4.0 / 1.0])
    assert pooled(levels, "speculative", 2) == pytest.approx(17 / 10)  # tokens over wall time, both repeats
    assert pooled_busy(levels, "target-only", 2) == pytest.approx(12 / 9)  # windows of 3 and 6 s
    assert pooled_busy(levels, "speculative", 2) == pytest.approx((5 + 8) / (3 + 2))


def test_guard_epochs_split_a_trace_into_runs_of_one_policy_and_mode() -> None:
    from orchestrator.traces import RoundTrace
    from specdec.tools.loadreport import epochs_markdown, guard_epochs

    def trace(ts: float, guard: str, policy: str = "cost", accepted: int = 0, emitted: int = -1,
              target_prefilled: int = 1, draft_prefilled: int = 0) -> RoundTrace:
        return RoundTrace("s", 1, 0, policy, 0, 0, accepted, [], 0.0, 0.0, 1000.0, draft_prefilled, target_prefilled,
                          True, False, ts=ts, guard=guard, emitted=emitted)
    traces = [trace(101.0, "spec", accepted=3, target_prefilled=40, draft_prefilled=40),
              trace(102.0, "spec", accepted=2, emitted=1),  # a stop cut the round: 1 token, not 3
              trace(103.0, "off"), trace(104.0, "off"), trace(105.0, "", policy="fixed")]
    epochs = guard_epochs(traces)
    assert [(e["policy"], e["guard"], e["from_s"], e["to_s"], e["rounds"], e["tokens"]) for e in epochs] == [
        ("cost", "spec", 0.0, 2.0, 2, 5), ("cost", "off", 2.0, 4.0, 2, 2), ("fixed", "-", 4.0, 5.0, 1, 1)]
    assert epochs[0]["prompts"] == 1 and epochs[0]["draft_prefilled"] == 40
    assert epochs[0]["tokens_per_s"] == 2.5 and epochs[0]["session_tokens_per_s"] == 2.5
    assert epochs_markdown(traces).count("\n| cost |") == 2


async def test_load_sweep_reports_both_modes_per_level(tmp_path) -> None:
    from specdec.tools.loadreport import markdown, plot, ratios
    from specdec.tools.loadsweep import sweep
    stack = await start_stack(draft_ref="tiny:seed=0,noise=0.02")
    try:
        levels, references = await sweep(stack.address, PROMPTS[:3], [1, 2], 1, 6, 60.0, repeats=2)
    finally:
        await stack.close()
    # Per level, the modes alternate ABBA over the repeats, so a drift in speed falls on both alike;
    # the order flips from one level to the next.
    assert [(lv.mode[0], lv.streams, lv.repeat) for lv in levels] == [
        ("s", 1, 0), ("t", 1, 0), ("t", 1, 1), ("s", 1, 1), ("t", 2, 0), ("s", 2, 0), ("s", 2, 1), ("t", 2, 1)]
    assert all(lv.errors == {} and lv.mismatches == 0 and lv.tokens == 6 * lv.streams for lv in levels)
    assert all(len(lv.ttft_ms) == lv.streams for lv in levels)
    # One gap per token after the first; target-only streams one token per chunk, a speculative round
    # several (the first chunk's extra tokens come with the first token and have no gap of their own).
    assert all(len(lv.itl_ms) == 5 * lv.streams for lv in levels if lv.mode == "target-only")
    assert all(0 < len(lv.itl_ms) <= 5 * lv.streams for lv in levels if lv.mode == "speculative")
    # The ITL reported is per chunk, the gap a client waits: a speculative round of n tokens is one
    # gap, not n gaps of a n-th of it (which understated the tail); spread per token, the same time.
    for lv in levels:
        assert len(lv.chunk_gap_ms) == len(lv.arrivals) - lv.streams  # every chunk after each request's first
        assert sum(lv.chunk_gap_ms) == pytest.approx(sum(lv.itl_ms))
        assert len(lv.tpot_ms) == lv.streams and all(t > 0 for t in lv.tpot_ms)
        summary = lv.summary()
        assert summary["itl_p99_ms"] >= summary["token_gap_p99_ms"] - 0.1 and summary["tpot_p50_ms"] > 0
    assert references == {i: reference_greedy(p, 6) for i, p in enumerate(PROMPTS[:3])}
    per_repeat, busy = ratios(levels), ratios(levels, busy=True)
    assert sorted(per_repeat) == [1, 2] and all(len(v) == 2 and min(v) > 0 for v in per_repeat.values())
    assert sorted(busy) == [1, 2] and all(len(v) == 2 and min(v) > 0 for v in busy.values())
    # The busy window ends when the first stream ran out of requests; its tokens are those that came by then.
    for lv in levels:
        assert len(lv.stream_ends) == lv.streams and max(lv.stream_ends) <= lv.wall_s
        until = min(lv.stream_ends)
        assert lv.busy_tokens_per_s() == pytest.approx(sum(n for at, n in lv.arrivals if at <= until) / until)
        assert sum(n for _, n in lv.arrivals) == lv.tokens
    table = markdown(levels)
    assert table.count("| speculative |") == 4 and "speculative / target-only at the same load" in table
    assert table.count("(repeats ") == 4
    plot(levels, tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").stat().st_size > 0


# ----------------------------------------------------------------------------- packed attention
# The packed path's kernel (torch's varlen flash attention) runs on CUDA only; on a CPU the same path
# runs with the plain-torch reference kernel, so the packing (sequence boundaries, key layout, grouped
# heads, output order) is tested here and the kernel's own semantics by the startup check on the GPU.

def top_left_causal(query, key, value, cu_q, cu_k, max_q, max_k, scale):  # a plausible kernel bug
    out = torch.empty_like(query)
    group = query.shape[1] // key.shape[1]
    for qs, qe, ks, ke in zip(cu_q.tolist(), cu_q[1:].tolist(), cu_k.tolist(), cu_k[1:].tolist()):
        q = query[qs:qe].transpose(0, 1)
        k = key[ks:ke].transpose(0, 1).repeat_interleave(group, dim=0)
        v = value[ks:ke].transpose(0, 1).repeat_interleave(group, dim=0)
        allowed = torch.arange(ke - ks)[None, :] <= torch.arange(qe - qs)[:, None]
        out[qs:qe] = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed,
                                                                      scale=scale).transpose(0, 1)
    return out


@pytest.mark.parametrize("ref", ["tiny:seed=0", "tiny:seed=3,layers=3,hidden=96"])
def test_packed_attention_computes_what_per_session_attention_does(ref: str) -> None:
    model = load_model(ref).model
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped heads are covered
    packed = RaggedForward(model, attention="packed", kernel=reference_packed_attention)
    per_session = RaggedForward(model, attention="per-session")
    assert (packed.attention_path, per_session.attention_path) == ("packed", "per-session")
    histories = [[[3, 4, 5, 6, 7], [8, 9], [10]], [[20], [21, 22, 23], [24, 25]], [[40, 41, 42, 43, 44, 45, 46, 47], [48], [49]]]
    caches = {name: [new_cache(model) for _ in histories] for name in ("packed", "per-session")}
    for step in range(3):
        a = packed([RaggedItem(c, h[step]) for c, h in zip(caches["packed"], histories)])
        b = per_session([RaggedItem(c, h[step]) for c, h in zip(caches["per-session"], histories)])
        for i, history in enumerate(histories):
            torch.testing.assert_close(a[i], b[i], rtol=1e-4, atol=1e-4)
            assert a[i].argmax(-1).tolist() == b[i].argmax(-1).tolist()
            assert caches["packed"][i].get_seq_length() == sum(len(c) for c in history[: step + 1])
    # and against the model's own forward, session by session
    for i, history in enumerate(histories):
        torch.testing.assert_close(a[i], hf_logits(model, history)[-1], rtol=1e-4, atol=1e-4)
    # one session alone (no concatenation of caches) on a cache of its own
    cache = new_cache(model)
    solo = [packed([RaggedItem(cache, chunk)])[0] for chunk in ([5, 6, 7], [8], [9, 10])]
    for mine, theirs in zip(solo, hf_logits(model, [[5, 6, 7], [8], [9, 10]])):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


def test_a_packed_kernel_that_disagrees_is_not_used() -> None:
    model = load_model("tiny:seed=0").model
    assert RaggedForward(model, kernel=top_left_causal).attention_path == "per-session"
    with pytest.raises(ValueError, match="differs from per-session attention"):
        RaggedForward(model, attention="packed", kernel=top_left_causal)
    assert RaggedForward(model, kernel=reference_packed_attention).attention_path == "packed"


def test_packed_attention_can_be_switched_off_and_is_refused_where_torch_cannot_run_it(monkeypatch) -> None:
    model = load_model("tiny:seed=0").model
    monkeypatch.setenv("SPECDEC_PACKED_ATTENTION", "0")
    assert RaggedForward(model, kernel=reference_packed_attention).attention_path == "per-session"
    monkeypatch.delenv("SPECDEC_PACKED_ATTENTION")
    assert RaggedForward(model).attention_path == "per-session"  # a CPU: no flash kernel is tried
    # torch's varlen flash attention is CUDA-only: on a CPU the check reports why, nothing crashes.
    kernel = torch_varlen_attention()
    if kernel is not None:
        assert packed_attention_agrees(kernel, torch.device("cpu"), torch.bfloat16, 4, 2, 16) is not None
    with pytest.raises(ValueError, match="packed attention unavailable"):
        RaggedForward(model, attention="packed")
    with pytest.raises(ValueError, match="attention must be"):
        RaggedForward(model, attention="fast")


def test_a_worker_batches_through_packed_attention_and_falls_back_when_the_kernel_fails() -> None:
    """WorkerCore.feed_many on the packed path (the reference kernel standing in for flash): the same
    logits as per session; a kernel that fails in service fails that forward, whose sessions are
    discarded (their caches part-updated), and hands later forwards to the per-session path."""
    loaded = load_model("tiny:seed=0")
    assert loaded.model.config.num_hidden_layers >= 2
    core = WorkerCore(loaded, "target")
    calls = {"n": 0, "armed": False}

    def fails_on_the_second_layer_once_armed(*args):
        calls["n"] += calls["armed"]
        if calls["n"] == 2:  # the first layer's cache has grown by then
            raise RuntimeError("no kernel image for this shape")
        return reference_packed_attention(*args)
    core._ragged = RaggedForward(loaded.model, attention="packed", kernel=reference_packed_attention)
    sessions = [WorkerSession(new_cache(loaded.model)) for _ in range(2)]
    out = core.feed_many([ForwardStep(sessions[0], [5, 6, 7], 2), ForwardStep(sessions[1], [9], 1)])
    torch.testing.assert_close(out[0], hf_logits(loaded.model, [[5, 6, 7]])[0][-2:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[1], hf_logits(loaded.model, [[9]])[0], rtol=1e-4, atol=1e-4)
    assert [s.tokens for s in sessions] == [[5, 6, 7], [9]]

    core._ragged = RaggedForward(loaded.model, attention="packed", kernel=fails_on_the_second_layer_once_armed)
    calls["armed"] = True  # after the startup check, which it passed
    with pytest.raises(RuntimeError, match="no kernel image"):
        core.feed_many([ForwardStep(sessions[0], [8], 1), ForwardStep(sessions[1], [10], 1)])
    assert all(s.tokens == [] and s.cache.get_seq_length() == 0 for s in sessions)  # discarded, not half-fed
    assert core._ragged.attention_path == "per-session"
    # Running out of memory is no kernel fault: the forward fails, the packed path stays.
    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    core._ragged = RaggedForward(loaded.model, attention="packed", kernel=reference_packed_attention)
    core._ragged._kernel = out_of_memory
    with pytest.raises(torch.OutOfMemoryError):
        core.feed_many([ForwardStep(sessions[0], [8], 1), ForwardStep(sessions[1], [10], 1)])
    assert core._ragged.attention_path == "packed"
    core._ragged = RaggedForward(loaded.model, attention="per-session")
    out = core.feed_many([ForwardStep(sessions[0], [5, 6], 1), ForwardStep(sessions[1], [9, 10], 1)])
    assert torch.equal(out[0], RaggedForward(loaded.model, attention="per-session")(
        [RaggedItem(new_cache(loaded.model), [5, 6], 1), RaggedItem(new_cache(loaded.model), [9, 10], 1)])[0])


def test_per_message_gaps_are_rebuilt_from_per_token_values(tmp_path, capsys) -> None:
    """scripts/itl_per_chunk.py: earlier loadtest.json files hold each message's gap once per token
    (divided by its tokens); runs of equal values give the messages back."""
    import json
    import runpy
    import sys
    from pathlib import Path

    messages = {("speculative", 1): [(100.0, 4), (30.0, 1), (93.0, 3)], ("speculative", 8): [(200.0, 2), (40.0, 1)]}
    raw = [{"mode": mode, "streams": streams, "repeat": 0, "requests": 1,
            "itl_ms": [gap / n for gap, n in chunks for _ in range(n)], "arrivals": [[0.0, 1]] * (len(chunks) + 1)}
           for (mode, streams), chunks in messages.items()]
    path = tmp_path / "loadtest.json"
    path.write_text(json.dumps({"raw": raw}))
    script = Path(__file__).resolve().parents[1] / "scripts" / "itl_per_chunk.py"
    argv = sys.argv
    sys.argv = [str(script), str(path)]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = argv
    out = capsys.readouterr().out
    assert "| speculative | 1 | 1 | 25 / 31 | 93 / 100 | 3 / 3 |" in out  # per token: 25 x4, 30, 31 x3
    assert "p99 per chunk at 8 streams / 1 stream = 200 / 100 = 2.00x" in out
