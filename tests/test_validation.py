"""Invalid requests get INVALID_ARGUMENT (or the fitting code) with a clear message; never INTERNAL."""
from __future__ import annotations

import grpc
import pytest

from specdec.contract import prefix_hash
from specdec.v1 import common_pb2, worker_pb2
from tests.stack import draft_stub, target_stub

BAD_REQUESTS = [
    (dict(prompt=""), "prompt is empty"),
    (dict(), "exactly one of prompt"),
    (dict(prompt_ids=[]), "prompt_ids is empty"),
    (dict(prompt_ids=[1, 99999]), "outside the vocabulary"),
    (dict(prompt="x", max_new_tokens=10**6), "above the limit"),
    (dict(prompt="x", temperature=-0.5), "temperature must be >= 0"),
    (dict(prompt="x", temperature=float("inf")), "temperature must be >= 0 and finite"),
    (dict(prompt="x", temperature=float("nan")), "temperature must be >= 0 and finite"),
    (dict(prompt="x", temperature=1.0, top_p=0.0), "top_p must be in (0, 1]"),
    (dict(prompt="x", temperature=1.0, top_p=1.5), "top_p must be in (0, 1]"),
    (dict(prompt="x", speculation={"policy": "nope"}), "unknown k policy 'nope'"),
    (dict(prompt="x", speculation={"min_k": 5, "max_k": 2}), "min_k <= max_k"),
    (dict(prompt="x", speculation={"fixed_k": 1000}), "fixed_k must be in"),
    (dict(prompt="x", session_id=""), "session_id must be"),
    (dict(prompt="x", session_id="a" * 1000), "session_id must be"),
    (dict(prompt="x", stop=[""]), "stop strings must be non-empty"),
    (dict(prompt="x", stop=["y" * 1025]), "at most 1024 characters"),
    (dict(prompt="x", stop=["ok\ufffd"]), "must not contain U+FFFD"),
    (dict(messages=[("robot", "hi")]), "unknown message role"),
    (dict(prompt_ids=[1] * 5000), "exceeds the model context"),
    # Counted before the ids are scanned (millions of them held the event loop for the scan).
    (dict(prompt_ids=[99999] * 5000), "prompt_ids has 5000 tokens, which exceeds the model context"),
    (dict(prompt="x" * 1_000_001), "prompt has 1000001 characters"),
    # Checked before a chat template renders and the tokenizer reads the text, as a plain prompt is.
    (dict(messages=[("system", "x" * 500_000), ("user", "y" * 500_001)]), "prompt has 1000001 characters"),
]


@pytest.mark.parametrize("fields,message", BAD_REQUESTS, ids=[m for _, m in BAD_REQUESTS])
async def test_invalid_requests(stack, fields: dict, message: str) -> None:
    fields.setdefault("max_new_tokens", 8)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.generate(**fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    # Still healthy afterwards.
    ok = await stack.generate(prompt="ok", max_new_tokens=4)
    assert ok.stats.new_tokens == 4


async def test_invalid_stream_request(stack) -> None:
    from tests.stack import request
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stack.stub.GenerateStream(request(prompt="", max_new_tokens=5)):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def commit(tokens: list[int], cache_len: int, append: list[int]) -> common_pb2.CacheCommit:
    return common_pb2.CacheCommit(cache_len=cache_len, prefix_hash=prefix_hash(tokens[:cache_len]),
                                  append_tokens=append)


async def test_worker_rpcs_check_cache_and_tokens(stack) -> None:
    target, draft = target_stub(stack), draft_stub(stack)
    # Unknown session with cache_len > 0: NOT_FOUND.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await target.Verify(worker_pb2.VerifyRequest(session_id="s", commit=commit([1, 2, 3], 2, [3])))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    # Create it, then claim a longer or different cache than it holds: FAILED_PRECONDITION.
    reply = await target.Verify(worker_pb2.VerifyRequest(session_id="s", commit=commit([], 0, [1, 2, 3])))
    assert reply.cache_len == 3
    for bad in (commit([1, 2, 3, 4, 5], 5, [6]), commit([9, 9, 9], 2, [3])):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await target.Verify(worker_pb2.VerifyRequest(session_id="s", commit=bad))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # Out-of-vocabulary ids: INVALID_ARGUMENT, on both workers.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await target.Verify(worker_pb2.VerifyRequest(session_id="s", commit=commit([], 0, [1, 5000])))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside the vocabulary" in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await draft.Propose(worker_pb2.ProposeRequest(session_id="d", commit=commit([], 0, [-1]), k=2))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await draft.Propose(worker_pb2.ProposeRequest(session_id="d", commit=commit([], 0, [1]), k=1000))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Sampling verify without q: INVALID_ARGUMENT.
    sampling = common_pb2.SamplingParams(temperature=1.0)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await target.Verify(worker_pb2.VerifyRequest(session_id="s2", commit=commit([], 0, [1]),
                                                     draft_tokens=[4], sampling=sampling))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "one q per draft token" in err.value.details()
    # A draft token outside its own q: INVALID_ARGUMENT.
    q = worker_pb2.SparseDistribution(token_ids=[7], probs=[1.0])
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await target.Verify(worker_pb2.VerifyRequest(session_id="s2", commit=commit([], 0, [1]),
                                                     draft_tokens=[4], q=[q], sampling=sampling))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "zero probability" in err.value.details()


async def test_worker_propose_then_verify_round(stack) -> None:
    """One round by hand: Propose then Verify with the worker's q, and the caches line up."""
    target, draft = target_stub(stack), draft_stub(stack)
    sampling = common_pb2.SamplingParams(temperature=0.8, seed=3)
    prompt = [10, 20, 30]
    proposal = await draft.Propose(worker_pb2.ProposeRequest(session_id="r", commit=commit([], 0, prompt), k=4,
                                                            sampling=sampling))
    assert len(proposal.tokens) == 4 and len(proposal.q) == 4 and proposal.cache_len == len(prompt) + 3
    verdict = await target.Verify(worker_pb2.VerifyRequest(session_id="r", commit=commit([], 0, prompt),
                                                           draft_tokens=proposal.tokens, q=proposal.q,
                                                           sampling=sampling))
    assert verdict.accepted_len == 4  # identical models: everything accepted
    assert verdict.cache_len == len(prompt) + 4
    info = await target.GetInfo(common_pb2.GetInfoRequest())
    assert info.role == "target" and info.sessions == 1 and info.cache_bytes > 0


def test_workers_take_only_an_exact_zero_top_p_as_unset() -> None:
    """proto3's 0 means unset (no top-p); -1 and NaN were also read as 1.0 and ran without top-p on
    the workers, where the orchestrator refuses them."""
    from specdec.contract import SamplingConfig
    from specdec.v1 import common_pb2
    assert SamplingConfig.from_pb(common_pb2.SamplingParams(top_p=0.0)).top_p == 1.0
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="top_p"):
            SamplingConfig.from_pb(common_pb2.SamplingParams(top_p=bad)).validate()


def test_a_config_file_outside_its_table_or_a_bad_flag_is_refused_clearly(tmp_path) -> None:
    """Keys outside [speculation] (no header, or a misspelled one) loaded as the defaults without a
    word; a bad or missing --config, a zero --session-ttl-s (every session expired), a zero
    --max-new-tokens-limit (every request refused) or a negative --grace-s were taken, or crashed
    with a traceback."""
    import argparse

    from orchestrator.app import add_args, config_from_args
    from orchestrator.config import SpeculationConfig, SpeculationConfigError

    for text, match in (("max_k = 3\n", "unknown top-level key"), ("[speculaton]\nmax_k = 3\n", "speculaton"),
                        ("speculation = 3\n", "must be a table"), ("[[speculation]]\nmax_k = 3\n", "must be a table"),
                        # a bad value or bad TOML names the file it is in
                        ("[speculation]\nmax_k = 6.0\n", "c.toml: max_k must be an integer"),
                        ("[speculation]\nmax_k = [3\n", "c.toml: not valid TOML")):
        path = tmp_path / "c.toml"
        path.write_text(text)
        with pytest.raises(SpeculationConfigError, match=match):
            SpeculationConfig.from_toml(str(path))
    with pytest.raises(SpeculationConfigError, match="^flags: need 0 <= min_k"):
        SpeculationConfig().with_values({"max_k": 99}, "flags")
    parser = argparse.ArgumentParser()
    add_args(parser)
    base = ["--draft", "127.0.0.1:1", "--target", "127.0.0.1:2"]
    for flags, match in ((["--config", str(tmp_path / "missing.toml")], "speculation config"),
                         (["--config", str(tmp_path / "c.toml")], "speculation config"),
                         (["--max-k", "99"], "speculation config"), (["--session-ttl-s", "0"], "session-ttl-s"),
                         (["--max-new-tokens-limit", "0"], "max-new-tokens-limit"), (["--grace-s", "-1"], "grace-s"),
                         (["--drain-delay-s", "nan"], "drain-delay-s"),
                         (["--target", "dns:///workers"], "--target: .*dns:///NAME:PORT"),
                         (["--draft", " , "], "--draft: .*no worker address")):
        with pytest.raises(SystemExit, match=match):
            config_from_args(parser.parse_args(base + flags))
    assert config_from_args(parser.parse_args(base)).limits.session_ttl_s == 600.0
