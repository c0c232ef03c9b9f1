"""Self-calibration at startup: a worker measures its own forward cost curve (torch).

The orchestrator seeds the k policy from it, so the first request of a fresh deployment already picks
a good k on whatever machine this is, instead of a prior tuned on another CPU. Bounded by a time
budget: token counts are measured in order of information (1, the largest, then the gaps), and what
the budget leaves out is interpolated by the orchestrator.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import torch

from specdec.contract import CostCurve
from specdec.models import crop_cache, new_cache, synchronize
from specdec.worker_core import WorkerCore

log = logging.getLogger(__name__)

BATCHED_PATH_ROWS = 16
# The share of the budget the GEMM path may take. A draft's is larger: its cost curve is two row
# counts and the load points (2.3-4.2 s on a Zen 4 core), while its GEMM path makes, checks and times
# copies shape by shape (9.2 s for the 0.5B draft on an idle Zen 4 core, 11.5-15.7 s in startups),
# so half of the default 20 s cut its last shapes off in some startups and not in others, and those
# ran on F.linear: a draft step of 76-95 ms instead of 41-55 (docs/adaptive-k.md, "GEMM path gets 0.7").
GEMM_SHARE = {"draft": 0.7, "target": 0.5}
# The reduced copies' check (reduced_overlap): one-token steps over the draft's own greedy continuation
# of a random prefix, and how much of the full-precision draft's distribution they must keep.
OVERLAP_PREFIX, OVERLAP_STEPS = 16, 32
MIN_REDUCED_OVERLAP = 0.9


def measurement_order(max_tokens: int) -> list[int]:
    """1 and max_tokens first, then the midpoints of the widest gaps: every prefix of this order
    brackets the whole range as well as it can."""
    order = [1] + ([max_tokens] if max_tokens > 1 else [])
    measured = sorted(order)
    while len(order) < max_tokens:
        gaps = [(b - a, a, b) for a, b in zip(measured, measured[1:]) if b - a > 1]
        _, _, a, b = max((gap, -a, a, b) for gap, a, b in gaps)  # ties: the smaller counts first
        mid = (a + b) // 2
        order.append(mid)
        measured = sorted(order)
    return order


@torch.inference_mode()
def measure_cost_curve(model: torch.nn.Module, vocab_size: int, max_tokens: int, contexts: tuple[int, ...],
                       budget_s: float, reps: int = 1, clock: Callable[[], float] = time.monotonic,
                       load_tokens: tuple[int, ...] = (), step_tokens: tuple[int, ...] = ()) -> CostCurve:
    """Median ms of a forward over t new tokens on top of c cached ones, for t in 1..max_tokens.

    `load_tokens`: larger row counts, measured at the first context only, right after its end points
    (the largest always, the rest within budget). A batch of B sessions at k drafts is a forward of about B*(k+1) rows, and the orchestrator prices
    load with them. `step_tokens`: row counts past max_tokens where the cost steps (a reduced GEMM
    path's last rows and the next), measured right after the largest load point, before the others."""
    if budget_s <= 0:
        return CostCurve()
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    started = clock()
    points: list[tuple[int, int, float]] = []
    for context in contexts:
        if points and clock() - started > budget_s / 2:
            break  # a further context needs its own prefill: only while half the budget is left
        cache = new_cache(model)
        prefix = torch.randint(0, vocab_size, (1, context), generator=gen).to(device)
        model(input_ids=prefix, past_key_values=cache, use_cache=True, logits_to_keep=1)
        order = measurement_order(max_tokens)
        if context == contexts[0]:
            # Right after the two end points, largest first: without them load cannot be priced.
            limit = getattr(getattr(model, "config", None), "max_position_embeddings", None) or 1 << 30
            def fitting(tokens: tuple[int, ...]) -> set[int]:
                return {t for t in tokens if t > max_tokens and context + t <= limit}
            load = sorted(fitting(load_tokens), reverse=True)
            steps = sorted(fitting(step_tokens) - set(load))
            order[2:2] = load[:1] + steps + load[1:]
        # 1, max_tokens and the largest load point are always measured (they bracket the curve).
        always = 3 if len(order) > 2 and order[2] > max_tokens else 2
        for i, tokens in enumerate(order):
            if clock() - started > budget_s and (i >= always or context != contexts[0]):
                break
            ids = torch.randint(0, vocab_size, (1, tokens), generator=gen).to(device)
            times = []
            for rep in range(reps + 1):  # the first run warms the kernels for this row count
                # Each run on a key length one longer: serving almost never repeats an attention
                # shape (the context grows every step), and a backend that sets up per shape must
                # show that here too (on the H200 a new shape cost 76.5 against 32 ms a step,
                # 2026-11-27; cuDNN attention's per-shape graphs, measured 2026-11-28). The GEMMs, set by
                # the row count alone, stay warm.
                crop_cache(cache, context + rep)
                start = time.perf_counter()
                # As in service: the logits of every fed row (a verify uses them all).
                model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=tokens)
                synchronize(device)
                times.append((time.perf_counter() - start) * 1000.0)
            crop_cache(cache, context)
            points.append((tokens, context, sorted(times[1:])[len(times[1:]) // 2]))
    curve = CostCurve(tuple(sorted(points)))
    log.info("cost curve (%.1fs): %s", clock() - started,
             ", ".join(f"{t}@{c}: {ms:.1f}ms" for t, c, ms in curve.points))
    return curve


GEMM_PATHS = ("auto", "library")


@torch.inference_mode()
def reduced_overlap(model: torch.nn.Module, vocab_size: int, copy_rows: int, prefix: int = OVERLAP_PREFIX,
                    steps: int = OVERLAP_STEPS) -> float:
    """How much of the draft's own distribution its reduced copies keep: the mean over `steps`
    one-token steps of sum_x min(p(x), q(x)), which is the acceptance the copies would get drafting for
    the full-precision draft. q: each step's distribution on the copies (the steps follow q's own greedy
    tokens from a seeded random prefix); p: the same positions' in one forward over the prefix and those
    tokens, more rows than any copy takes (`copy_rows`), so on the full-precision path."""
    if prefix + steps <= copy_rows:
        raise ValueError(f"the check's forward of {prefix + steps} rows would run on copies taking up to {copy_rows}")
    device = next(model.parameters()).device
    # From the lower half of the vocabulary: padded vocabularies put their untrained rows at the top.
    ids = torch.randint(0, max(1, vocab_size // 2), (1, prefix), generator=torch.Generator().manual_seed(1)).to(device)
    cache = new_cache(model)
    token = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1].argmax()
    fed, reduced = [], []
    for _ in range(steps):
        fed.append(token.view(1, 1))
        logits = model(input_ids=fed[-1], past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
        reduced.append(logits.float().softmax(-1))
        token = logits.argmax()
    full = model(input_ids=torch.cat([ids, *fed], dim=1), use_cache=False).logits[0, prefix:].float().softmax(-1)
    return torch.minimum(full, torch.stack(reduced)).sum(-1).mean().item()


def calibrate(core: WorkerCore, max_k: int, budget_s: float, gemm_path: str = "auto",
              reduced_kind: str | tuple[str, ...] | None = None) -> None:
    """At worker startup: choose the GEMM path (CPU), then measure the cost curve, within budget_s of
    measuring. Swapping the chosen paths in (packing the weights) comes on top: seconds for a 1.5B
    float32 model, more for larger ones. `gemm_path` "library" (--gemm-path) keeps F.linear everywhere,
    the kernels HF `generate` runs, and gives the whole budget to the cost curve. `reduced_kind`: the kind of
    copy (int4, bf16) a draft's few-row products may run on, or several in order of preference
    (models.reduced_copy_kinds); copies that keep less than MIN_REDUCED_OVERLAP of the draft's
    distributions (reduced_overlap), or that win no shape's timing, give way to the next kind (measured
    with the GEMM path's share of the budget again), then to each kind on fewer shapes (linear_path._fewer_shapes), else
    the draft runs without copies.

    The draft forwards 1 token per drafting step and up to 2 on catch-up; the target verifies up to
    max_k + 1. Contexts: a short and a longer prompt, the second only as far as the budget allows.
    """
    from specdec import linear_path
    if not math.isfinite(budget_s):  # NaN passed the skip check, then no `elapsed > budget` ever held
        raise ValueError(f"calibration budget must be a finite number of seconds (0 skips), got {budget_s}")
    if gemm_path not in GEMM_PATHS:
        raise ValueError(f"gemm_path must be one of {', '.join(GEMM_PATHS)}, got {gemm_path!r}")
    if budget_s <= 0:
        return
    kinds = (reduced_kind,) if isinstance(reduced_kind, str) else tuple(reduced_kind or ())
    max_tokens = 2 if core.role == "draft" else max_k + 1
    gemm_budget_s = budget_s * GEMM_SHARE.get(core.role, 0.5)
    if gemm_path == "library":
        paths = linear_path.PathChoice()
        core.gemm_path = "F.linear everywhere (--gemm-path library)"
        log.info("GEMM path: %s", core.gemm_path)
    else:
        # Row counts for the GEMM path: a session's own steps, and up to 16 rows of batched sessions.
        # The draft's copies, kind by kind, until one keeps enough of its distributions (reduced_overlap).
        paths = linear_path.choose_and_apply(
            core.model, max(max_tokens, BATCHED_PATH_ROWS), gemm_budget_s,
            reduced_kinds=kinds if core.role == "draft" else (),
            check=lambda rows: reduced_overlap(core.model, core.vocab_size, rows), min_score=MIN_REDUCED_OVERLAP)
        core.gemm_path = paths.summary()
        if paths.copy_checks and not any(kept for _, _, kept in paths.copy_checks):
            log.warning("the draft runs without weight copies: %s", core.gemm_path)
    # The budget bounds measuring. Swapping the chosen paths in (packing, owning the tensors) takes
    # what the model's size and the page cache make it (7.6-12.8 s measured for the 1.5B float32
    # target on 2 Zen 5 cores) and is not charged to the curve: charged, it left the curve little or
    # none of the budget in some startups, only its always-measured points (3 or 4 of 12; loadtest
    # runs 52, 55, 57). Nor is a second kind of copy's measurement (a fallback, choose_and_apply): the
    # curve keeps at least the share of the budget the GEMM path was not given.
    left = budget_s - min(paths.seconds, gemm_budget_s)
    # The orchestrator prices rounds at the short context; a longer one is measured (and reported for
    # operators) only with budget to spare. The end points of the short one are always measured.
    contexts = tuple(sorted({min(64, core.max_context // 4), min(256, core.max_context // 2)}))
    # Both also measure what batched forwards cost (rows of several sessions): the target's curve lets
    # the k policy price load, and each worker sizes its prompt chunks from its own (scheduler.prefill_chunk_for).
    load = (16, 32, 64)
    # Where shapes run a reduced copy up to r rows, the forward's cost steps up past r: measure r and
    # r + 1 for each such r (the curve is interpolated between its points, and 2 to 16 would smooth
    # the steps away).
    steps = tuple(sorted({t for plan in paths.plans.values() if plan.reduced_rows
                          for t in (plan.reduced_rows, plan.reduced_rows + 1)}))
    core.cost_curve = measure_cost_curve(core.model, core.vocab_size, max_tokens, contexts, max(left, 1e-9),
                                         load_tokens=load, step_tokens=steps)


def retime_decode_steps(core: WorkerCore, reps: int = 8) -> None:
    """Re-measure the curve's one-token points on the decode graph (specdec.decode_graph), which takes
    a session's drafting steps: the k policy prices drafting with them, and an eager step on a GPU
    costs 2-4x a replayed one (the orchestrator would otherwise price this draft as it runs eagerly).
    Also sets how many sessions' one-token steps run one after the other on the graph rather than as
    one eager forward (WorkerCore.graph_batch_limit): while that costs less by the eager curve."""
    from specdec.decode_graph import step_ms
    if core.decode_graph is None or not core.cost_curve.points:
        return
    eager = core.cost_curve
    points = []
    for tokens, context, ms in eager.points:
        if tokens == 1 and context + reps + 2 < core.decode_graph.max_len:
            replayed = step_ms(core.decode_graph, core.empty_session, core.vocab_size, context, reps)
            log.info("one-token step at context %d: %.2f ms on the decode graph, %.2f ms eager", context,
                     replayed, ms)
            ms = replayed
        points.append((tokens, context, ms))
    core.cost_curve = CostCurve(tuple(sorted(points)))
    context = min(c for _, c, _ in eager.points)
    if context + 2 * reps + 4 < core.decode_graph.max_len:
        turns = step_ms(core.decode_graph, core.empty_session, core.vocab_size, context, reps, sessions=2)
        limit = 1
        for sessions in range(2, BATCHED_PATH_ROWS + 1):
            rows_ms = eager.ms(sessions)
            if rows_ms is None or sessions * turns > rows_ms:
                break
            limit = sessions
        core.graph_batch_limit = limit
        log.info("decode graph: a step taking turns between sessions %.2f ms; up to %d sessions' one-token "
                 "steps run one after the other on it (an eager forward of 2 rows: %s ms)", turns, limit,
                 f"{eager.ms(2):.2f}" if eager.ms(2) is not None else "not measured")
