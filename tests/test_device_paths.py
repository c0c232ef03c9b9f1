"""The GPU code paths, guarded on the CPU: device and dtype resolution, sampling that stays where the
logits are (only ids and sparse probabilities cross to the host), and the bench anchors' device."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
import torch
from torch.overrides import TorchFunctionMode

from draft_worker.engine import DraftEngine, ProposeParams
from specdec.contract import Commit, SamplingConfig, prefix_hash
from specdec.model_refs import ModelRefError
from specdec.models import load_model, resolve_device, resolve_dtype
from specdec.worker_core import WorkerCore
from target_worker.engine import TargetEngine, VerifyParams

VOCAB = 4096
MAX_Q_ENTRIES = 16

# Every way a tensor's contents reach Python or host memory.
_HOST_TRANSFERS = {torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.numpy,
                   torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__bool__,
                   torch.Tensor.__index__}


@dataclass
class TransferLog(TorchFunctionMode):
    """Records the element count of every host transfer (on the CPU, .cpu() is a no-op, but the
    call is what would copy on a GPU, so it is what is counted)."""
    sizes: list[tuple[str, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in _HOST_TRANSFERS and args and isinstance(args[0], torch.Tensor):
            self.sizes.append((func.__name__, args[0].numel()))
        elif func is torch.Tensor.to and args and isinstance(args[0], torch.Tensor):
            target = kwargs.get("device", args[1] if len(args) > 1 else None)
            if isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu":
                self.sizes.append(("to(cpu)", args[0].numel()))
        return func(*args, **kwargs)

    def largest(self) -> int:
        return max(n for _, n in self.sizes)


@contextmanager
def transfers() -> Iterator[TransferLog]:
    log = TransferLog()
    with log:
        yield log


@pytest.fixture(scope="module")
def engines() -> tuple[DraftEngine, TargetEngine]:
    target = WorkerCore(load_model(f"tiny:seed=0,vocab={VOCAB}"), "target")
    draft = WorkerCore(load_model(f"tiny:seed=0,noise=0.05,vocab={VOCAB}"), "draft")
    return DraftEngine(draft, max_q_entries=MAX_Q_ENTRIES), TargetEngine(target)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_only_ids_and_sparse_probabilities_cross_to_the_host(engines, temperature: float) -> None:
    draft, target = engines
    prompt = [(7 * i) % 250 + 3 for i in range(40)]
    sampling = SamplingConfig(temperature=temperature, seed=11)
    k = 6
    session = f"s-{temperature}"
    with transfers() as log:
        proposal = draft.propose(ProposeParams(session, Commit(0, prefix_hash([]), tuple(prompt)), k, sampling))
        verdict = target.verify(VerifyParams(session, Commit(0, prefix_hash([]), tuple(prompt)),
                                             tuple(proposal.tokens), tuple(proposal.q), sampling))
    assert len(proposal.tokens) == k and 0 <= verdict.accepted_len <= k
    assert log.sizes, "the recorder saw nothing: it would not catch a full-logits copy either"
    # Bounded by k and the sparse q size, never by the vocabulary or the prompt length.
    assert log.largest() <= max(k + 1, MAX_Q_ENTRIES), log.sizes


def test_the_recorder_sees_a_full_logits_copy(engines) -> None:
    """Negative control: the old worker core copied [rows, V] logits to the host every forward."""
    _, target = engines
    logits = torch.randn(3, VOCAB)
    with transfers() as log:
        logits.float().cpu()
    assert log.largest() == 3 * VOCAB


def test_feed_returns_only_the_rows_asked_for(engines) -> None:
    _, target = engines
    core = target.core
    session = core._checkout("rows", Commit(0, prefix_hash([]), ()))
    logits = core.feed(session, list(range(3, 23)), logits_rows=1)
    assert logits.shape == (1, VOCAB) and logits.dtype == torch.float32
    assert logits.device == next(core.model.parameters()).device
    everything = core.feed(session, [5, 6, 7])
    assert everything.shape == (3, VOCAB)


# ----------------------------------------------------------------------------- device and dtype

def test_auto_dtype_is_bf16_on_cuda_and_keeps_the_cpu_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_dtype("auto", "target", "cuda") == torch.bfloat16
    assert resolve_dtype("auto", "draft", torch.device("cuda:1")) == torch.bfloat16
    assert resolve_dtype("auto", "target", "cpu") == torch.float32  # the CPU target stays exact
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False, raising=False)
    assert resolve_dtype("auto", "draft", "cpu") == torch.float32
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True, raising=False)
    assert resolve_dtype("auto", "draft", "cpu") == torch.bfloat16
    for exact in ("exact", "float32", "fp32"):
        assert resolve_dtype(exact, "target", "cuda") == torch.float32
    assert resolve_dtype("bfloat16", "target", "cpu") == torch.bfloat16
    with pytest.raises(ModelRefError, match="unknown dtype"):
        resolve_dtype("float8", "target", "cpu")


def test_device_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ModelRefError, match="no CUDA device"):
        resolve_device("cuda:0")
    with pytest.raises(ModelRefError, match="unknown device"):
        resolve_device("gpu please")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ModelRefError, match="sees 2 CUDA device"):
        resolve_device("cuda:2")


def test_bench_anchors_load_on_the_workers_device_in_their_dtypes() -> None:
    from specdec.tools.bench import HFRunner
    runner = HFRunner("tiny:seed=0", "tiny:seed=0,noise=0.02", torch.bfloat16, torch.float32, torch.device("cpu"))
    target_param = next(runner.target.model.parameters())
    draft_param = next(runner.draft.model.parameters())
    assert target_param.dtype == torch.bfloat16 and draft_param.dtype == torch.float32
    assert target_param.device.type == draft_param.device.type == "cpu"


# ----------------------------------------------------------------------------- bf16 near-tie flips

def test_flip_counter_counts_every_position_and_sees_a_flip() -> None:
    from specdec.tools.flips import count_flips
    model = load_model("tiny:seed=0").model
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    clean = count_flips(model, prompts, new_tokens=10, k=3, dtype_name="float32", device=torch.device("cpu"))
    assert clean.positions == 20 and clean.flips == 0

    class Perturbed(torch.nn.Module):
        """Negative control: a multi-token forward whose second row prefers another token."""
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner
            self.config = inner.config

        def forward(self, input_ids: torch.Tensor, **kwargs):  # type: ignore[no-untyped-def]
            out = self.inner(input_ids=input_ids, **kwargs)
            if input_ids.shape[1] > 1 and out.logits.shape[1] > 1:
                row = out.logits[0, 1]
                row[torch.argmin(row)] = row.max() + 1.0
            return out

    flipped = count_flips(Perturbed(model), prompts, new_tokens=10, k=3, dtype_name="float32",
                          device=torch.device("cpu"))
    assert flipped.positions == 20 and flipped.flips >= 4 and all(m > 0 for m in flipped.margins)


def test_flip_counter_runs_the_verify_on_the_workers_gemm_path() -> None:
    """`specdec flips` compares HF's one-at-a-time decode with the verify as the workers run it: the
    path switch happens between the two phases, and the tiny float32 model flips nothing either way."""
    from specdec import linear_path
    from specdec.tools.flips import count_flips
    model = load_model("tiny:seed=0").model
    shapes = {(m.out_features, m.in_features) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    packs = linear_path.packing_supported(torch.float32)
    plan = linear_path.ShapePlan(packed=True) if packs else linear_path.ShapePlan(False, (1, 2), (False, True))
    calls: list[int] = []

    def prepare() -> str:
        assert not any(isinstance(m, linear_path.PathLinear) for m in model.modules())  # decode ran on F.linear
        calls.append(linear_path.apply(model, linear_path.PathChoice({s: plan for s in shapes})))
        return "switched"

    result = count_flips(model, [[5, 6, 7], [9, 10, 11, 12]], new_tokens=10, k=3, dtype_name="float32",
                         device=torch.device("cpu"), prepare_verify=prepare)
    assert calls and calls[0] > 0 and result.gemm_path == "switched"
    assert result.positions == 20 and result.flips == 0
