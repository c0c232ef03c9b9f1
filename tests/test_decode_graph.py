"""The decode graph's path (specdec.decode_graph) on the CPU: the same steps without capture ("static")
must compute what plain steps do, through session switches, crops, forks, failures and sessions
longer than the buffer; a decoder that disagrees is refused at startup. CUDA capture itself runs only
on a GPU (scripts/gpu_session.sh); what it replays is this path."""
from __future__ import annotations

import pytest
import torch

from draft_worker.engine import DraftEngine, ProposeParams
from specdec.contract import Commit, SamplingConfig, prefix_hash
from specdec.decode_graph import GraphDecoder, check_against_eager, resolve_mode
from specdec.models import copy_cache, load_model, new_cache
from specdec.worker_core import WorkerCore, WorkerSession

REF = "tiny:seed=3,layers=2"


@pytest.fixture(scope="module")
def loaded():
    return load_model(REF)


def _plain_step(core: WorkerCore, session: WorkerSession, token: int) -> torch.Tensor:
    """A plain one-token forward on a copy of the session's cache, its rows written back first."""
    core.sync(session)
    cache = copy_cache(session.cache, len(session.tokens))
    with torch.inference_mode():
        return core.model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True,
                     logits_to_keep=1).logits[0, -1:].float()


def test_static_steps_match_plain_steps_across_switches_crops_and_forks(loaded) -> None:
    core = WorkerCore(loaded, "draft")
    core.enable_decode_graph(capture=False, max_len=64)
    assert core.decode_graph is not None, core.decode_path
    assert core.decode_path.startswith("static buffer")
    model = loaded.model
    a = WorkerSession(cache=new_cache(model))
    b = WorkerSession(cache=new_cache(model))
    core.feed(a, list(range(10, 30)), logits_rows=1)
    core.feed(b, list(range(40, 45)), logits_rows=1)

    def check(session: WorkerSession, token: int) -> None:
        expected = _plain_step(core, session, token)
        before = core.counters.graph_steps
        got = core.feed(session, [token], logits_rows=1)
        assert core.counters.graph_steps == before + 1  # taken by the decoder, not the eager path
        assert got.shape == expected.shape and torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
        # The token's row waits in the buffer until something else needs the session's own cache.
        assert GraphDecoder.cached_len(session) < len(session.tokens)
        core.sync(session)
        assert all(layer.keys.shape[-2] == len(session.tokens) for layer in session.cache.layers)

    for token in (5, 6, 7):
        check(a, token)
    check(b, 8)            # another session: its whole prefix copied in
    check(a, 9)            # and back
    core.truncate(a, 12)   # cropped, then other tokens: the buffer's later rows are stale
    core.feed(a, [100, 101], logits_rows=1)
    check(a, 102)
    fork = WorkerSession(copy_cache(a.cache, 14), list(a.tokens[:14]))  # a branch: a new session object
    check(fork, 103)
    check(a, 104)


def test_eager_feeds_between_steps_and_multi_row_feeds_stay_eager(loaded) -> None:
    core = WorkerCore(loaded, "draft")
    core.enable_decode_graph(capture=False, max_len=64)
    session = WorkerSession(cache=new_cache(loaded.model))
    core.feed(session, [1, 2, 3, 4], logits_rows=1)
    assert core.counters.graph_steps == 0  # several rows: eager
    core.feed(session, [5], logits_rows=1)
    core.feed(session, [6, 7], logits_rows=2)  # eager rows after a graph step (a catch-up)
    expected = _plain_step(core, session, 8)
    assert torch.allclose(core.feed(session, [8], logits_rows=1), expected, atol=1e-4)
    assert core.counters.graph_steps == 2


def test_sessions_longer_than_the_buffer_step_eagerly(loaded) -> None:
    core = WorkerCore(loaded, "draft")
    core.enable_decode_graph(capture=False, max_len=16)
    session = WorkerSession(cache=new_cache(loaded.model))
    core.feed(session, list(range(3, 17)), logits_rows=1)  # 14 tokens
    core.feed(session, [20], logits_rows=1)                 # position 14: in the buffer
    assert core.counters.graph_steps == 1
    expected = _plain_step(core, session, 21)
    assert torch.allclose(core.feed(session, [21], logits_rows=1), expected, atol=1e-4)  # position 15: last row
    assert core.counters.graph_steps == 2
    expected = _plain_step(core, session, 22)
    assert torch.allclose(core.feed(session, [22], logits_rows=1), expected, atol=1e-4)  # past it: eager
    assert core.counters.graph_steps == 2


def test_a_failed_step_discards_the_session_and_the_buffer_forgets_it(loaded, monkeypatch) -> None:
    core = WorkerCore(loaded, "draft")
    core.enable_decode_graph(capture=False, max_len=64)
    session = WorkerSession(cache=new_cache(loaded.model))
    core.feed(session, list(range(3, 13)), logits_rows=1)
    core.feed(session, [5], logits_rows=1)

    def broken() -> torch.Tensor:
        raise RuntimeError("device fault")
    monkeypatch.setattr(core.decode_graph.decoders[0], "_forward", broken)
    with pytest.raises(RuntimeError, match="device fault"):
        core.feed(session, [6], logits_rows=1)
    assert session.tokens == [] and core.decode_graph.decoders[0]._held == []  # re-prefilled by its next commit
    monkeypatch.undo()
    core.feed(session, [7, 8, 9], logits_rows=1)
    expected = _plain_step(core, session, 10)
    assert torch.allclose(core.feed(session, [10], logits_rows=1), expected, atol=1e-4)


def test_a_decoder_that_disagrees_with_eager_steps_is_refused(loaded, monkeypatch) -> None:
    original = GraphDecoder._forward

    def off_by_a_little(self: GraphDecoder) -> torch.Tensor:
        return original(self) + 0.5
    monkeypatch.setattr(GraphDecoder, "_forward", off_by_a_little)
    core = WorkerCore(loaded, "draft")
    core.enable_decode_graph(capture=False, max_len=64)
    assert core.decode_graph is None
    assert core.decode_path.startswith("eager (static buffer, not captured refused: step 0: logits differ by")
    monkeypatch.undo()
    decoder = GraphDecoder(loaded.model, 64, capture=False)
    assert check_against_eager(decoder, lambda: WorkerSession(cache=new_cache(loaded.model)), loaded.vocab_size) is None


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_proposals_are_the_same_with_the_static_decoder(loaded, temperature: float) -> None:
    plain_core = WorkerCore(loaded, "draft")
    plain = DraftEngine(plain_core)
    one_row_feeds = []
    eager_feed = plain_core.feed

    def counted(session: WorkerSession, tokens, logits_rows: int = 0) -> torch.Tensor:
        one_row_feeds.append(len(tokens) == 1)
        return eager_feed(session, tokens, logits_rows)
    plain_core.feed = counted  # type: ignore[method-assign]
    static_core = WorkerCore(loaded, "draft")
    static_core.enable_decode_graph(capture=False, max_len=128)
    static = DraftEngine(static_core)
    sampling = SamplingConfig(temperature=temperature, seed=5)
    tokens = [(11 * i) % 200 + 3 for i in range(24)]
    cache_len = 0
    for round_ in range(4):
        params = ProposeParams("s", Commit(cache_len, prefix_hash(tokens[:cache_len]), tuple(tokens[cache_len:])),
                               5, sampling)
        a, b = plain.propose(params), static.propose(params)
        assert a.tokens == b.tokens, round_
        for qa, qb in zip(a.q, b.q):
            assert qa.token_ids.tolist() == qb.token_ids.tolist()
            assert torch.allclose(qa.probs, qb.probs, atol=1e-4)
        # The target accepted two of them and corrected the third.
        cache_len = len(tokens)
        tokens = tokens + a.tokens[:2] + [(a.tokens[2] + 1) % 200]
    # A pre-draft's branch: slot 1 forked from slot 0's committed prefix, whose last drafts' rows
    # are still only in the buffer (written back before the copy).
    branch = ProposeParams("s", Commit(cache_len, prefix_hash(tokens[:cache_len]), tuple(tokens[cache_len:]) + (7,)),
                           3, sampling, slot=1, fork_from=0)
    a, b = plain.propose(branch), static.propose(branch)
    assert a.tokens == b.tokens and len(a.tokens) == 3
    # Every one-token forward (the drafting steps, and a catch-up of one token) went to the decoder.
    assert static_core.counters.graph_steps == sum(one_row_feeds) >= 4 * 4


def test_mode_resolution() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_mode("auto", "draft", cuda) == "on"
    assert resolve_mode("auto", "target", cuda) == "off"  # the target's greedy output stays eager generate's
    assert resolve_mode("auto", "draft", cpu) == "off"
    assert resolve_mode("static", "target", cpu) == "static"
    assert resolve_mode("off", "draft", cuda) == "off"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_mode("on", "draft", cpu)
    with pytest.raises(ValueError, match="must be one of"):
        resolve_mode("yes", "draft", cpu)


async def test_a_worker_started_with_the_static_decoder_reports_it_and_serves(tmp_path) -> None:
    """The flag through a real worker process: GetInfo names the path, the one-token cost it priced
    is the decoder's, Propose serves from it, and its metric counts the steps."""
    import urllib.request

    import grpc

    from specdec.v1 import common_pb2, worker_pb2, worker_pb2_grpc
    from tests.procs import aspawn, stop
    proc, port = await aspawn("draft_worker", ["--model", REF, "--port", "0", "--threads", "1", "--calibration-s", "1",
                                               "--decode-graph", "static", "--decode-graph-len", "1024",
                                               "--metrics-port", "0"], tmp_path, log_level="INFO")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = worker_pb2_grpc.DraftWorkerStub(channel)
            info = await stub.GetInfo(common_pb2.GetInfoRequest(), timeout=30)
            assert info.decode_path.startswith("static buffer, not captured, 3 buffer(s) of 256, 512, 1024 positions"), info.decode_path
            assert any(cost.tokens == 1 for cost in info.forward_costs)
            reply = await stub.Propose(worker_pb2.ProposeRequest(
                session_id="s", commit={"cache_len": 0, "append_tokens": list(range(3, 20))}, k=4), timeout=30)
            assert len(reply.tokens) == 4
        log_text = (tmp_path / "draft_worker.log").read_text()
        assert "on the decode graph" in log_text  # the one-token points were re-timed on it
        import re
        metrics_port = int(re.search(r"metrics on http://\S+:(\d+)/metrics", log_text).group(1))
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        steps = re.search(r"^specdec_worker_graph_steps(?:_total)?\{[^}]*\} (\S+)$", body, re.M)
        assert steps and float(steps.group(1)) >= 3, body  # k = 4: the drafting steps after the prefill
    finally:
        stop(proc)


async def test_a_worker_refuses_a_graph_it_cannot_have_before_loading() -> None:
    import argparse

    from specdec.worker_server import add_worker_args, check_worker_flags
    parser = argparse.ArgumentParser()
    add_worker_args(parser, "tiny:seed=0")
    with pytest.raises(SystemExit, match="--decode-graph-len must be >= 2"):
        check_worker_flags(parser.parse_args(["--decode-graph-len", "1"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--decode-graph", "maybe"])


class EagerReplay:
    """Stands in for a captured CUDA graph on the CPU: replay() runs the captured step's kernels, or,
    `frozen_at` a position, what a capture that froze the position as a constant would run."""

    def __init__(self, decoder: GraphDecoder, frozen_at: int | None = None) -> None:
        self.decoder, self.frozen_at = decoder, frozen_at

    def replay(self) -> None:
        if self.frozen_at is not None:
            self.decoder.position.fill_(self.frozen_at)
            self.decoder._set_length(self.frozen_at)
        self.decoder._logits = self.decoder._forward()


def test_the_startup_check_refuses_a_replay_that_froze_the_position(loaded) -> None:
    def new_session() -> WorkerSession:
        return WorkerSession(cache=new_cache(loaded.model))
    decoder = GraphDecoder(loaded.model, 64, capture=False)
    decoder._graph = EagerReplay(decoder)  # type: ignore[assignment]
    assert check_against_eager(decoder, new_session, loaded.vocab_size) is None
    session = new_session()
    core = WorkerCore(loaded, "draft")
    core.decode_graph = decoder
    core.feed(session, list(range(3, 15)), logits_rows=1)
    expected = _plain_step(core, session, 9)
    assert torch.allclose(core.feed(session, [9], logits_rows=1), expected, atol=1e-4)  # through replay()

    frozen = GraphDecoder(loaded.model, 64, capture=False)
    frozen._graph = EagerReplay(frozen, frozen_at=3)  # type: ignore[assignment]
    problem = check_against_eager(frozen, new_session, loaded.vocab_size)
    assert problem is not None and "the replayed graph differs from the same step run eagerly" in problem


def test_rows_kept_in_the_buffer_survive_a_crop_and_reach_the_cache_before_an_eager_forward(loaded) -> None:
    core = WorkerCore(loaded, "draft")
    core.enable_decode_graph(capture=False, max_len=64)
    session = WorkerSession(cache=new_cache(loaded.model))
    core.feed(session, list(range(3, 13)), logits_rows=1)
    for token in (20, 21, 22):  # three drafts, their rows in the buffer only
        core.feed(session, [token], logits_rows=1)
    assert GraphDecoder.cached_len(session) == 10 and len(session.tokens) == 13
    core.truncate(session, 11)  # the target took the first draft: its row is still only in the buffer
    assert session.tokens[-1] == 20 and GraphDecoder.cached_len(session) == 10
    reference = WorkerSession(cache=new_cache(loaded.model))
    plain = WorkerCore(loaded, "draft")
    plain.feed(reference, session.tokens, logits_rows=1)
    expected = plain.feed(reference, [30, 31], logits_rows=2)
    got = core.feed(session, [30, 31], logits_rows=2)  # eager catch-up: the row written back first
    assert torch.allclose(got, expected, atol=1e-4)
    assert GraphDecoder.cached_len(session) == len(session.tokens) == 13


def test_a_batch_of_one_token_steps_runs_on_the_graph_within_the_measured_limit(loaded) -> None:
    from specdec.worker_core import ForwardStep
    core = WorkerCore(loaded, "draft")
    core.enable_decode_graph(capture=False, max_len=64)
    sessions = [WorkerSession(cache=new_cache(loaded.model)) for _ in range(3)]
    for i, session in enumerate(sessions):
        core.feed(session, list(range(3 + i, 12 + 2 * i)), logits_rows=1)
        core.feed(session, [40 + i], logits_rows=1)  # the last one resident, with a row pending
    expected = [_plain_step(core, s, 50 + i) for i, s in enumerate(sessions)]
    before = core.counters.graph_steps
    core.graph_batch_limit = 3
    got = core.feed_many([ForwardStep(s, [50 + i], 1) for i, s in enumerate(sessions)])
    assert core.counters.graph_steps == before + 3
    for g, e in zip(got, expected):
        assert torch.allclose(g, e, atol=1e-4)
    core.graph_batch_limit = 2  # over the limit: one ragged eager forward (rows written back first)
    expected = [_plain_step(core, s, 60 + i) for i, s in enumerate(sessions)]
    got = core.feed_many([ForwardStep(s, [60 + i], 1) for i, s in enumerate(sessions)])
    assert core.counters.graph_steps == before + 3
    for g, e in zip(got, expected):
        assert torch.allclose(g, e, atol=1e-4)


@pytest.mark.parametrize("eager_ms, limit", [(1e-3, 1), (1e4, 16)])
def test_startup_retimes_one_token_points_and_sets_the_batch_limit_from_the_eager_curve(loaded, eager_ms, limit) -> None:
    from specdec.calibration import retime_decode_steps
    from specdec.contract import CostCurve
    core = WorkerCore(loaded, "draft")
    core.enable_decode_graph(capture=False, max_len=256)
    core.cost_curve = CostCurve(((1, 16, eager_ms), (2, 16, eager_ms), (16, 16, eager_ms), (1, 64, eager_ms)))
    retime_decode_steps(core, reps=3)
    ones = {c: ms for t, c, ms in core.cost_curve.points if t == 1}
    assert set(ones) == {16, 64} and all(ms != eager_ms for ms in ones.values())  # measured on the decoder
    assert [(t, c, ms) for t, c, ms in core.cost_curve.points if t > 1] == [(2, 16, eager_ms), (16, 16, eager_ms)]
    assert core.graph_batch_limit == limit  # B steps in turn against one eager forward of B rows


def test_sessions_step_on_the_shortest_buffer_they_fit_and_move_up_as_they_grow(loaded) -> None:
    from specdec.decode_graph import buffer_lengths
    assert buffer_lengths(8192) == [256, 512, 1024, 2048, 4096, 8192]
    assert buffer_lengths(100) == [100] and buffer_lengths(300) == [256, 300]
    core = WorkerCore(loaded, "draft")
    core.enable_decode_graph(capture=False, max_len=64, smallest=8)  # checked per buffer and across each boundary
    assert [d.max_len for d in core.decode_graph.decoders] == [8, 16, 32, 64], core.decode_path
    assert "4 buffer(s) of 8 to 64 positions" in core.decode_path
    short, long_ = WorkerSession(cache=new_cache(loaded.model)), WorkerSession(cache=new_cache(loaded.model))
    core.feed(short, [3, 4, 5], logits_rows=1)
    core.feed(long_, list(range(3, 23)), logits_rows=1)
    residents = []
    for token in range(30, 45):  # short grows from 3 to 18 tokens: buffers of 8, then 16, then 32
        for session in (short, long_):
            expected = _plain_step(core, session, token)
            assert torch.allclose(core.feed(session, [token], logits_rows=1), expected, atol=1e-4)
        residents.append([d.max_len for d in core.decode_graph.decoders if d.resident() is short])
    assert residents[0] == [8] and residents[-1] == [32] and [16] in residents
    core.truncate(short, 6)  # back under the first boundary, its rows in the 32-row buffer cut
    expected = _plain_step(core, short, 50)
    assert torch.allclose(core.feed(short, [50], logits_rows=1), expected, atol=1e-4)
    assert core.decode_graph.decoders[0].resident() is short


def test_steps_with_rows_still_in_the_buffer_match_a_plain_core_step_for_step(loaded) -> None:
    """No write-back between the steps (the helper above syncs before each): what a round of
    drafting does, compared with a core without the decoder fed the same tokens."""
    core, plain = WorkerCore(loaded, "draft"), WorkerCore(loaded, "draft")
    core.enable_decode_graph(capture=False, max_len=64, smallest=8)
    a, b = WorkerSession(cache=new_cache(loaded.model)), WorkerSession(cache=new_cache(loaded.model))
    prompt = list(range(3, 9))
    core.feed(a, prompt, logits_rows=1)
    plain.feed(b, prompt, logits_rows=1)
    for token in range(20, 30):  # from the 8-row buffer into the 16-row one, rows pending throughout
        got, expected = core.feed(a, [token], logits_rows=1), plain.feed(b, [token], logits_rows=1)
        assert torch.allclose(got, expected, atol=1e-4), token
    assert GraphDecoder.cached_len(a) < len(a.tokens) == len(b.tokens)


def _buffered_session(loaded) -> tuple[WorkerCore, WorkerSession]:
    """A draft core on the static decode path and a session fed a 10-token prompt, then 3 one-token
    steps whose rows only the decode graph's buffer holds."""
    core = WorkerCore(loaded, "draft")
    core.enable_decode_graph(capture=False, max_len=64)
    session = WorkerSession(cache=new_cache(loaded.model))
    core.feed(session, list(range(3, 13)), logits_rows=1)
    for token in (20, 21, 22):
        core.feed(session, [token], logits_rows=1)
    return core, session


def test_a_sessions_size_counts_the_rows_only_the_buffer_holds(loaded) -> None:
    """Measured at the end of a call with its drafts' rows still in the buffer, an idle session's
    size went stale when they were written back (another session taking the buffer)."""
    from specdec.models import cache_nbytes
    core, session = _buffered_session(loaded)
    assert GraphDecoder.cached_len(session) == 10 and len(session.tokens) == 13
    before = session.nbytes()
    assert before == cache_nbytes(session.cache) * 13 // 10
    core.sync(session)
    assert GraphDecoder.cached_len(session) == 13 and session.nbytes() == cache_nbytes(session.cache) == before


def test_a_sliding_window_sessions_size_is_its_caches() -> None:
    """A sliding-window layer keeps about a window of rows: none of the rest is pending anywhere."""
    from transformers import MistralConfig, MistralForCausalLM

    from specdec.models import cache_nbytes
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=16, max_position_embeddings=128)
    model = MistralForCausalLM(config).eval()
    session = WorkerSession(cache=new_cache(model))
    tokens = [5 + i % 50 for i in range(60)]
    with torch.inference_mode():
        model(input_ids=torch.tensor([tokens]), past_key_values=session.cache, use_cache=True)
    session.tokens.extend(tokens)
    assert GraphDecoder.cached_len(session) < 60
    assert session.nbytes() == cache_nbytes(session.cache)


def test_a_write_back_that_fails_for_another_reason_than_memory_discards_the_session(loaded, monkeypatch) -> None:
    """Out of memory a write-back changes nothing and the session goes on; any other failure is a
    broken invariant, after which the session must re-prefill rather than fail every call."""
    core = WorkerCore(loaded, "draft")
    core.enable_decode_graph(capture=False, max_len=64)
    session = WorkerSession(cache=new_cache(loaded.model))
    core.feed(session, list(range(3, 13)), logits_rows=1)
    core.feed(session, [20], logits_rows=1)

    def broken(session, upto=None):
        raise RuntimeError("the buffer does not hold rows it should (test)")
    monkeypatch.setattr(core.decode_graph, "write_back", broken)
    with pytest.raises(RuntimeError, match="test"):
        core.feed(session, [30, 31], logits_rows=2)
    monkeypatch.undo()
    assert session.tokens == [] and GraphDecoder.cached_len(session) == 0


def test_a_failed_write_back_leaves_every_layer_as_it_was_and_the_session_as_it_was(loaded, monkeypatch) -> None:
    import specdec.decode_graph as decode_graph
    core, session = _buffered_session(loaded)
    calls = []
    real_cat = torch.cat

    def cat_failing_on_the_third(*args, **kwargs):  # the second layer's keys: out of memory
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return real_cat(*args, **kwargs)
    monkeypatch.setattr(decode_graph.torch, "cat", cat_failing_on_the_third)
    layers_before = [id(layer.keys) for layer in session.cache.layers]
    with pytest.raises(torch.OutOfMemoryError):
        decode_graph.GraphDecoder.write_back(core.decode_graph.decoders[0], session)
    assert [id(layer.keys) for layer in session.cache.layers] == layers_before  # not some layers grown
    calls.clear()
    with pytest.raises(torch.OutOfMemoryError):
        core.feed(session, [30, 31], logits_rows=2)  # the eager forward's write-back fails
    monkeypatch.undo()
    # Nothing ran and nothing changed: the session goes on as it was, its rows still buffered, with
    # no re-prefill (a session emptied here must re-prefill just when memory is short).
    assert session.tokens == list(range(3, 13)) + [20, 21, 22]
    assert GraphDecoder.cached_len(session) < len(session.tokens)
    expected = _plain_step(core, session, 9)
    assert torch.allclose(core.feed(session, [9], logits_rows=1), expected, atol=1e-4)


def test_a_failed_write_back_in_a_batched_forward_fails_only_its_own_session(loaded, monkeypatch) -> None:
    """Three sessions share a ragged forward; the write-back of the one whose rows wait in the
    decode graph's buffer runs out of memory. Its step's output is the error and it stays as it
    was; the other two run, as a plain core computes them (they were all discarded before)."""
    from specdec.worker_core import ForwardStep
    core, plain = WorkerCore(loaded, "draft"), WorkerCore(loaded, "draft")
    core.enable_decode_graph(capture=False, max_len=64)
    assert core._ragged is not None
    sessions = [WorkerSession(cache=new_cache(loaded.model)) for _ in range(3)]
    twins = [WorkerSession(cache=new_cache(loaded.model)) for _ in range(3)]
    for i, (session, twin) in enumerate(zip(sessions, twins)):
        prompt = list(range(3 + i, 11 + i))
        core.feed(session, prompt, logits_rows=1)
        plain.feed(twin, prompt, logits_rows=1)
    resident = sessions[0]
    for token in (20, 21):  # its rows now only in the buffer
        core.feed(resident, [token], logits_rows=1)
        plain.feed(twins[0], [token], logits_rows=1)
    assert GraphDecoder.cached_len(resident) < len(resident.tokens)
    held = list(resident.tokens)

    write_back = core.decode_graph.write_back

    def write_back_failing_for_the_resident(session, upto=None):
        # (a failed write-back changes nothing: test_a_failed_write_back_leaves_every_layer_...)
        if session is resident:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return write_back(session, upto)
    monkeypatch.setattr(core.decode_graph, "write_back", write_back_failing_for_the_resident)
    out = core.feed_many([ForwardStep(s, [30 + i, 40 + i], 2) for i, s in enumerate(sessions)])
    monkeypatch.undo()
    assert isinstance(out[0], torch.OutOfMemoryError) and resident.tokens == held
    for i in (1, 2):
        expected = plain.feed(twins[i], [30 + i, 40 + i], logits_rows=2)
        assert torch.allclose(out[i], expected, atol=1e-4), i
        assert sessions[i].tokens == twins[i].tokens
    # The failed one goes on from where it was.
    assert torch.allclose(core.feed(resident, [30, 40], logits_rows=2),
                          plain.feed(twins[0], [30, 40], logits_rows=2), atol=1e-4)


def test_a_neighbours_failed_move_in_leaves_the_resident_session_whole(loaded, monkeypatch) -> None:
    """Q's step moves Q into the buffer, writing back P's pending rows first; that write-back runs out
    of memory. P, which a call of its own may be stepping in the same forward, keeps its tokens, its
    rows and the buffer (trimming P there fed its next token at a shorter position: a wrong token
    from a one-token verify), and Q's step runs eagerly instead of failing."""
    core, plain = WorkerCore(loaded, "target"), WorkerCore(loaded, "target")
    core.enable_decode_graph(capture=False, max_len=64)
    p, q, q_plain = core.empty_session(), core.empty_session(), plain.empty_session()
    core.feed(p, list(range(3, 13)), logits_rows=1)
    core.feed(q, list(range(40, 47)), logits_rows=1)
    plain.feed(q_plain, list(range(40, 47)), logits_rows=1)
    for token in (20, 21, 22):
        core.feed(p, [token], logits_rows=1)  # P resident, three rows pending in the buffer
    p_tokens = list(p.tokens)
    assert GraphDecoder.cached_len(p) < len(p_tokens)
    real_write_back = GraphDecoder.write_back

    def out_of_memory_for_p(self, session, upto=None):
        if session is p:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return real_write_back(self, session, upto)
    monkeypatch.setattr(GraphDecoder, "write_back", out_of_memory_for_p)
    steps = core.counters.graph_steps
    got = core.feed(q, [50], logits_rows=1)
    assert core.counters.graph_steps == steps  # eager
    assert torch.allclose(got, plain.feed(q_plain, [50], logits_rows=1), atol=1e-4)
    assert p.tokens == p_tokens and core.decode_graph.decoders[0].resident() is p
    monkeypatch.undo()
    expected = _plain_step(core, p, 23)  # (writes P's rows back, then a plain step on a copy)
    assert torch.allclose(core.feed(p, [23], logits_rows=1), expected, atol=1e-4)


def test_a_failed_fork_leaves_its_source_as_it_was(loaded, monkeypatch) -> None:
    """A branch forks from slot 0 while slot 0's own call may be stepping it: a write-back that fails
    fails the fork, and the source keeps its tokens and pending rows (it was emptied before)."""
    import specdec.decode_graph as decode_graph
    from specdec.contract import slot_key
    core = WorkerCore(loaded, "draft")
    core.enable_decode_graph(capture=False, max_len=64)
    source = core.empty_session()
    core.feed(source, list(range(3, 13)), logits_rows=1)
    for token in (20, 21):
        core.feed(source, [token], logits_rows=1)
    core.store.put(slot_key("s", 0), source)
    tokens = list(source.tokens)
    monkeypatch.setattr(decode_graph.torch, "cat",
                        lambda *a, **k: (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA out of memory (test)")))
    with pytest.raises(torch.OutOfMemoryError):
        core.fork("s", 0, 1, Commit(len(tokens), prefix_hash(tokens), ()), grow_by=3)
    monkeypatch.undo()
    assert source.tokens == tokens and GraphDecoder.cached_len(source) < len(tokens)
    expected = _plain_step(core, source, 22)
    assert torch.allclose(core.feed(source, [22], logits_rows=1), expected, atol=1e-4)
