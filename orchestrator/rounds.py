"""One speculation round: propose on the draft, verify on the target, apply the outcome (no grpc here).

A `Round` runs the two worker calls, with their recovery (re-prefill from the canonical tokens, draft
fallback, target retry), cuts the output with the turn's stop conditions and returns one immutable
`RoundRecord`. Everything else (stats, metrics, traces, the k policy, stream events) observes records.

Prefill overlap (opt-in; `cost` and `bandit` policies; more than 16 new prompt tokens): the turn's
first round runs target-only while the draft prefills the prompt beside it and pre-drafts round 2 as
below, so that the first token does not wait for the draft's prefill.

Pipelining (opt-in): while the target verifies round n, the draft already drafts round n+1 on the
assumption that round n is fully accepted. It drafts k+2 tokens after round n's drafts (one deeper,
so k can grow along hits); the first is its guess of the target's bonus token. If the target accepts
everything and its bonus equals that guess (a hit), round n+1 verifies up to its k of the rest at once,
without waiting for the draft. The pre-draft conditions on exactly the prefix round n+1 has and was
sampled from the q that is sent, so the round stays lossless; with a float32 draft it even proposes the
very tokens a serial round would (docs/pipelining.md). A rejection cancels the pre-draft; on a miss
the next commit crops the draft's cache back to the canonical prefix.

Branches (`branches` > 0, with pipelining): beside that pre-draft, the draft also pre-drafts for
the likeliest rejections. At a position j where the draft's runner-up token is likely to be the
target's correction, a branch slot of the draft's session is forked from the session's cache at
canonical + drafts[:j] and drafts after the runner-up. If the verify rejects at j and corrects to
that token, the branch holds the next round's drafts and becomes the session's draft slot. Which
branch is used depends only on the verify's outcome, never on the branch's own draws, so the drafts
a round verifies are still drawn from q given exactly its prefix: lossless as before.

Over 300 lines: the serial calls, their recovery paths and the pre-draft share one round's state
(the session's views, the deadline, the draft's health); apart, one protocol would span three files.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from orchestrator.backends import SENT_BYTES, DraftBackend, DraftReply, TargetBackend, VerifyReply
from orchestrator.guard import GuardTicket, PairGuard, prompt_extra_ms, without_prompt_rows
from orchestrator.kpolicy import branch_budget, predraft_depth
from orchestrator.record import RoundRecord
from orchestrator.routing import bounded_entry
from orchestrator.sessions import OrchestratorSession, WorkerView
from orchestrator.stopping import StopConditions
from specdec.contract import MAX_K, SamplingConfig
from specdec.errors import (CacheMismatch, CapacityExceeded, DeadlineExceeded, InvalidRequest, SessionNotFound,
                            SpecdecError, WorkerInternalError, WorkerUnavailable)

log = logging.getLogger(__name__)

# Prefill overlap pays only with a prompt to hide: a follow-up of a few tokens keeps round 1 speculative.
OVERLAP_MIN_PREFILL = 16
# A draft call appending more tokens than this gets time for their prefill beyond draft_timeout_s:
# PREFILL_ALLOWANCE_FACTOR times the draft's expected prefill cost (TimingModel.draft_prefill_ms).
PREFILL_ALLOWANCE_FROM_ROWS = 16
PREFILL_ALLOWANCE_FACTOR = 3.0
# ... and at most this much: a draft that hangs in a prefill is found out within it (without a
# curve the estimate is a decode step per row, far above a prefill's cost).
PREFILL_ALLOWANCE_MAX_S = 60.0


class DraftHealth:
    """Backoff for a draft worker that failed: rounds fall back to k=0 until the next retry time."""

    def __init__(self, initial_s: float = 0.5, max_s: float = 30.0) -> None:
        self.initial_s, self.max_s = initial_s, max_s
        self._backoff = 0.0
        self._retry_at = 0.0
        self.failures = 0

    @property
    def degraded(self) -> bool:
        return self._backoff > 0

    def usable(self) -> bool:
        return time.monotonic() >= self._retry_at

    def failed(self) -> None:
        """A call failed. While in backoff another failure is the same outage (the calls of every
        session in flight when it began), not a failed retry: eight sessions would otherwise take a
        blip to the longest backoff at once."""
        self.failures += 1
        if self.degraded and time.monotonic() < self._retry_at:
            return
        self._backoff = min(self.max_s, self._backoff * 2 if self._backoff else self.initial_s)
        self._retry_at = time.monotonic() + self._backoff

    def succeeded(self) -> None:
        self._backoff = 0.0
        self._retry_at = 0.0


class DraftHealthBoard:
    """A DraftHealth per draft replica (one dead replica must not stop speculation for the others),
    and the one health entry they make together: degraded while a replica that sessions are routed
    to is in backoff. A replica gone from discovery (a replaced pod) no longer counts."""

    def __init__(self, replica_of: Callable[[str], str], current_replicas: Callable[[], set[str]]) -> None:
        self._replica_of, self._current = replica_of, current_replicas
        self.entries: dict[str, DraftHealth] = {}
        # Called with True when the draft becomes unusable and False when it recovers.
        self.on_change: Callable[[bool], Awaitable[None]] | None = None
        self._reported = False

    def for_session(self, session_id: str) -> DraftHealth:
        """The health of the replica the session's draft calls go to now."""
        return bounded_entry(self.entries, self._replica_of(session_id), DraftHealth)

    @property
    def degraded(self) -> bool:
        current = self._current()
        return any(h.degraded for replica, h in self.entries.items() if replica in current)

    async def report(self) -> None:
        """After a draft call: tell on_change if the state changed (never fails the caller)."""
        degraded = self.degraded
        if degraded == self._reported:
            return
        self._reported = degraded
        if self.on_change is not None:
            try:
                await self.on_change(degraded)
            except Exception:  # noqa: BLE001 - health reporting must never fail a request
                log.exception("reporting draft health failed")


class Deadline:
    def __init__(self, timeout_s: float | None) -> None:
        self.at = None if timeout_s is None else time.monotonic() + timeout_s

    def remaining(self) -> float | None:
        if self.at is None:
            return None
        left = self.at - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("deadline exceeded while generating")
        return left

    def cap(self, limit_s: float, past_ok: bool = False) -> float:
        """A call's timeout: limit_s, or what is left of the deadline if less. Past the deadline it
        raises, or with past_ok (optional work, which must not fail the turn) gives 0."""
        if past_ok and self.at is not None and self.at <= time.monotonic():
            return 0.0
        left = self.remaining()
        return limit_s if left is None else min(left, limit_s)


@dataclass
class Workers:
    """The two backends and what the engine keeps about them across sessions."""
    draft: DraftBackend
    target: TargetBackend
    draft_timeout_s: float
    target_retry_s: float
    draft_health: DraftHealthBoard
    disable_branches: Callable[[], None] = lambda: None  # the draft turned out to have no branch slots
    target_timeout_s: float = 600.0  # one Verify's longest (EngineLimits.target_timeout_s)


@dataclass
class _PreDraft:
    """A draft call made during a verify, on the assumption that the verify accepts everything."""
    assumed: list[int]              # canonical + the drafts under verification
    calls: "_Calls"
    task: "asyncio.Task[DraftReply | None]"
    started: float
    rejected: bool = False          # the verify rejected a draft: the assumption failed, call cancelled


@dataclass
class _Branch:
    """A pre-draft on a branch slot, for the outcome 'rejected at `position`, corrected to `token`'."""
    assumed: list[int]              # canonical + drafts[:position] + [token]: the prefix it drafts after
    position: int                   # the rejection it assumes (index into the round's drafts)
    token: int                      # the correction it assumes (the draft's runner-up there)
    slot: int
    calls: "_Calls"
    task: "asyncio.Task[DraftReply | None]"
    started: float


@dataclass
class _Calls:
    """What the worker calls of one round add up to."""
    reprefills: int = 0
    bytes_to_draft: int = 0
    bytes_from_draft: int = 0
    bytes_to_target: int = 0
    bytes_from_target: int = 0
    target_cached: int = 0

    @contextlib.contextmanager
    def counting_sent(self) -> Iterator[None]:
        """Requests sent inside count here (orchestrator.backends.SENT_BYTES), replied to or not."""
        token = SENT_BYTES.set(self._sent)
        try:
            yield
        finally:
            SENT_BYTES.reset(token)

    def _sent(self, role: str, size: int) -> None:
        if role == "draft":
            self.bytes_to_draft += size
        else:
            self.bytes_to_target += size


def hit_saved_ms(predraft_wall_ms: float, drafted: int, used: int, draft_ms_per_token: float,
                 waited_ms: float) -> float:
    """What a pre-draft hit saved: the draft call a serial round would have made (its round trip
    and one forward per token the round uses) less what the round still waited for the pre-draft.
    The pre-draft's whole wall time overstates it: it also drafted the bonus guess and tokens past
    this round's k, a forward each (priced at the pre-draft's own cost per step: Round._saved_ms);
    counted whole, a hit at k = 3 claimed about 5/3 of the drafting it hid."""
    serial_call_ms = predraft_wall_ms - max(0, drafted - used) * draft_ms_per_token
    return max(0.0, serial_call_ms - waited_ms)


class Round:
    """The rounds of one turn share its session, sampling, deadline and stop conditions."""

    def __init__(self, workers: Workers, session: OrchestratorSession, sampling: SamplingConfig,
                 deadline: Deadline, stop: StopConditions, min_draft_prob: float, policy_name: str,
                 pipeline: bool = False, max_k: int = 8, overlap_prefill: str = "off", branches: int = 0,
                 overlap_pays: Callable[[int], bool] | None = None) -> None:
        self.workers = workers
        self.pipeline = pipeline
        self.branches = branches if pipeline else 0
        self._branches: list[_Branch] = []
        self._hit_shared_draft = False  # this round's drafts came from a pre-draft made beside branches
        self.overlap_prefill = overlap_prefill  # "on", "auto" (overlap_pays decides per turn) or "off"
        self.overlap_pays = overlap_pays
        self._overlap_choice: tuple[int, int, bool] | None = None  # (round index, rows, overlaps): priced once
        self.max_k = max_k
        self._ahead: _PreDraft | None = None
        self.session = session
        self.sampling = sampling
        self.deadline = deadline
        self.stop = stop
        self.min_draft_prob = min_draft_prob
        self.policy_name = policy_name
        self.index = 0
        self.turn_tokens = 0  # emitted so far in the turn (guarded rounds)

    def target_prefill_rows(self) -> int:
        """Tokens the target would take in the next round's forward besides its drafts (its commit's
        appended tokens: a turn's new prompt, or 1 in a steady round). 0 where the prefill overlap
        will run that round target-only: its k is then the depth of round 2's pre-draft."""
        rows = self.session.target_view.appended_for(self.session.tokens)
        return 0 if self._overlaps(self.index + 1, rows) else rows

    def _overlaps(self, index: int, prefill_rows: int) -> bool:
        """Whether round `index`, with this many tokens for the target to take, runs the prefill overlap:
        "on", for a prompt of more than OVERLAP_MIN_PREFILL tokens; "auto", where `overlap_pays` prices
        it below the serial first round (kpolicy.prefill_overlap_price), asked once per round."""
        if self.overlap_prefill == "off" or index != 1 or self.stop.remaining < 3 or prefill_rows <= 1:
            return False
        if self.overlap_prefill == "on":
            return prefill_rows > OVERLAP_MIN_PREFILL
        if self.overlap_pays is None:
            return False
        if self._overlap_choice is None or self._overlap_choice[:2] != (index, prefill_rows):
            self._overlap_choice = (index, prefill_rows, self.overlap_pays(prefill_rows))
        return self._overlap_choice[2]

    async def run_guarded(self, k: int, guard: PairGuard | None, ticket: GuardTicket | None) -> RoundRecord:
        """run(k), with the worker pair's guard told what the round made (or that it measured nothing)."""
        if guard is None or ticket is None:
            return await self.run(k)
        try:
            record = await self.run(k)
        except BaseException:
            guard.abandon(ticket)
            raise
        # A turn's first round is taken whole, paired with its target call (wall time, queue included).
        # Any other round: other sessions' prompts in the verify's forward are not this mode's cost
        # (see the guard's doc).
        first = record.index == 1
        forward_ms = self.session.stats.timing.load.forward_ms
        round_ms = record.round_ms if first else without_prompt_rows(
            record.round_ms, record.verify_ms, record.target_rows, record.target_prompt_rows, forward_ms)
        self.turn_tokens += len(record.emitted)
        guard.observe(ticket, len(record.emitted), round_ms, record.steady,
                      record.drafted > 0, first=first, target_ms=record.verify_wall_ms,
                      catching_up=record.draft_prefilled > record.target_prefilled + 2,
                      turn_tokens=self.turn_tokens if record.finish is not None else None,
                      prompt_ms=prompt_extra_ms(record.target_prefilled, record.target_batch, forward_ms)
                      if first else None)
        return dataclasses.replace(record, guard=ticket.mode)

    async def run(self, k: int) -> RoundRecord:
        """Propose k tokens (k = 0: target-only), verify them, append the outcome to the canonical list."""
        started = time.perf_counter()
        self.index += 1
        canonical = self.session.tokens
        position = len(canonical)
        calls = _Calls()
        prefill_rows = self.session.target_view.appended_for(canonical)
        reply, hit, saved_ms, branch_hit = await self._take_predraft(k, calls)
        # After the pre-draft settled: a pre-draft that found the draft down put it in backoff.
        use_draft = k > 0 and self.workers.draft_health.for_session(self.session.session_id).usable()
        overlapped = reply is None and use_draft and self._overlaps(self.index, prefill_rows)
        if overlapped:
            # The turn's first round has a prompt to prefill on both workers. Serially the target
            # would wait for the draft's prefill; instead the target prefills and answers the first
            # token alone (k = 0) while the draft prefills and pre-drafts the next round, its first
            # token a guess of the target's (as a pipelined pre-draft). The first token then comes as
            # soon as target-only's would, and a hit gives round 2 its drafts at once.
            self._start_predraft(list(canonical), min(k, self.stop.remaining - 2) + 1)
            k = 0
        elif reply is None and use_draft:
            reply = await self._propose(k, calls)
        drafts = reply.tokens if reply else []
        # A pre-draft pays only if a round can follow this one: at least 2 tokens left after a
        # fully accepted round (its drafts and the bonus).
        if (self.pipeline and drafts and self.stop.remaining - (len(drafts) + 1) >= 2
                and self.workers.draft_health.for_session(self.session.session_id).usable()):
            # The bonus guess, then this round's k and one more where it fits in the verify's
            # shadow, so k can grow along a run of hits (kpolicy.predraft_depth); the next round
            # uses at most its own k of them. A prompt's round drafts few (kpolicy.prefill_round_k)
            # but verifies long: its pre-draft goes to max_k, so the rounds after it are not held
            # to that small k.
            depth = (predraft_depth(self.max_k, self.max_k) if prefill_rows > 1
                     else predraft_depth(len(drafts), self.max_k, self.session.stats.timing))
            depth = min(depth, self.stop.remaining - len(drafts) - 1)
            self._start_predraft(canonical + drafts, depth)
            if self.branches and reply is not None:
                self._start_branches(canonical, drafts, reply, depth)
        verify = await self._verify(drafts, reply.q_payload if reply else None, calls)
        if self._ahead is not None and verify.accepted_len < len(drafts):
            # A rejection: the pre-draft's assumption failed. Stop it now rather than wait for it.
            self._ahead.rejected = True
            self._ahead.task.cancel()
        for branch in self._branches:  # keep only the branch whose guess came true (if any)
            if (branch.position, branch.token) != (verify.accepted_len, verify.next_token):
                branch.task.cancel()
        out = self.stop.apply((drafts[:verify.accepted_len] + [verify.next_token])[:self.stop.remaining])
        canonical.extend(out.tokens)
        return RoundRecord(
            session_id=self.session.session_id, index=self.index, position=position, policy=self.policy_name,
            k=k, drafts=tuple(drafts), draft_probs=tuple(reply.token_probs) if reply else (),
            draft_confidences=tuple(reply.confidences) if reply else (),
            accepted=verify.accepted_len, emitted=out.tokens, text_delta=out.text_delta, finish=out.finish,
            fallback=k > 0 and reply is None, greedy=self.sampling.greedy, overlapped=overlapped,
            draft_ms=reply.compute_ms if reply else 0.0,
            draft_token_ms=0.0 if hit and self._hit_shared_draft else _draft_token_ms(reply),
            verify_ms=verify.compute_ms, verify_wall_ms=verify.wall_ms,
            round_ms=(time.perf_counter() - started) * 1000.0,
            draft_prefilled=reply.prefilled_tokens if reply else 0, target_prefilled=verify.prefilled_tokens,
            target_cached=calls.target_cached, reprefills=calls.reprefills,
            bytes_to_draft=calls.bytes_to_draft, bytes_from_draft=calls.bytes_from_draft,
            bytes_to_target=calls.bytes_to_target, bytes_from_target=calls.bytes_from_target,
            predraft_hit=hit, predraft_saved_ms=saved_ms, predraft_branch_hit=branch_hit,
            draft_wall_ms=reply.wall_ms if reply else 0.0,
            target_batch=verify.batch_sessions, target_rows=verify.batch_rows, target_waiting=verify.worker_waiting,
            target_prompt_rows=verify.batch_prompt_rows, target_queue_ms=verify.queue_ms)

    # ------------------------------------------------------------------ pipelining
    def _start_predraft(self, assumed: list[int], k: int) -> None:
        calls = _Calls()
        # (one more than the round's k, so at max_k = MAX_K capped: the worker refuses more)
        task = asyncio.create_task(self._propose(min(k, MAX_K), calls, canonical=assumed))
        self._ahead = _PreDraft(assumed, calls, task, time.perf_counter())

    async def _take_predraft(self, k: int, calls: _Calls
                             ) -> tuple[DraftReply | None, bool | None, float, bool | None]:
        """Settle the pending pre-drafts: (this round's drafts if one hit, hit / miss / None, ms
        saved, and whether a branch for the previous round's rejection hit (None: none was made)).

        hit: the target accepted everything and its bonus was the draft's guess, or it rejected
        where a branch was made and corrected to that branch's token; miss: pre-drafts were made
        and none came true; None: nothing was tested (no pre-draft, k = 0 now, or the pre-drafts
        failed or stopped early). A pre-draft still running is waited for only when it may hit;
        the others are cancelled. Either way the draft's caches are in a state the views account
        for before the next call.
        """
        # They stay on self until settled: if this turn is cancelled while waiting, settle() stops them.
        ahead, branches = self._ahead, self._branches
        self._hit_shared_draft = False
        if ahead is None and not branches:
            return None, None, 0.0, None
        # The previous round's outcome is what its verify appended: the branch made for that
        # rejection (if any) is the only one not cancelled.
        branch = next((b for b in branches if not b.task.cancelled() and self.session.tokens == b.assumed), None)
        tested_branch = next((b for b in branches if len(self.session.tokens) == len(b.assumed)
                              and self.session.tokens[:-1] == b.assumed[:-1]), None)
        for b in branches:
            if b is not branch or k == 0:
                b.task.cancel()
        if ahead is not None and k == 0 and not ahead.task.done():
            ahead.task.cancel()
        waited_from = time.perf_counter()
        pre = await self._outcome(ahead) if ahead is not None else None
        if branches:
            await asyncio.wait({b.task for b in branches})
        self._ahead, self._branches = None, []
        waited_ms = (time.perf_counter() - waited_from) * 1000.0
        # Drafts made beside branches ran in forwards of several rows: not a measure of one token's cost.
        self._hit_shared_draft = bool(branches)
        if ahead is not None:
            self._add_calls(calls, ahead.calls)
        for b in branches:
            self._add_calls(calls, b.calls)
        branch_hit = None if tested_branch is None else tested_branch is branch
        if k == 0:
            return None, None, 0.0, branch_hit
        if branch is not None:
            got = self._branch_outcome(branch)
            if got is not None and got.tokens:
                # The branch's slot holds the session's text now: the next calls go there.
                self.session.draft_slot = branch.slot
                used = got.window(0, k)
                return used, True, self._saved_ms(got, used, waited_ms), True
            branch_hit = None  # it failed or drafted nothing: nothing was tested
        if ahead is not None and ahead.rejected:
            # A pre-draft that had failed (an error, or _propose's None) tested nothing.
            failed = (ahead.task.done() and not ahead.task.cancelled()
                      and (ahead.task.exception() is not None or ahead.task.result() is None))
            return None, None if failed else False, 0.0, branch_hit
        if ahead is None or pre is None or len(pre.tokens) < 2:
            return None, None, 0.0, branch_hit
        if self.session.tokens != ahead.assumed + [pre.tokens[0]]:
            return None, False, 0.0, branch_hit
        used = pre.window(1, 1 + k)
        return used, True, self._saved_ms(pre, used, waited_ms), branch_hit

    def _saved_ms(self, predraft: DraftReply, used: DraftReply, waited_ms: float) -> float:
        # The tokens past this round's are priced at the pre-draft's own steps, measured in the same
        # call; the session's running estimate only where the call has none. (The estimate starts
        # from the draft's startup curve and lags: with a tiny draft it stayed at several times a
        # step's real cost for a turn, and every hit's saving came out 0.)
        per_token = _draft_token_ms(predraft) or self.session.stats.timing.draft_ms_per_token.value
        return hit_saved_ms(predraft.wall_ms, len(predraft.tokens), len(used.tokens), per_token, waited_ms)

    @staticmethod
    def _add_calls(total: _Calls, part: _Calls) -> None:
        for name in ("reprefills", "bytes_to_draft", "bytes_from_draft"):
            setattr(total, name, getattr(total, name) + getattr(part, name))

    @staticmethod
    def _branch_outcome(branch: _Branch) -> DraftReply | None:
        task = branch.task
        if not task.done() or task.cancelled() or task.exception() is not None:
            return None
        return task.result()

    def _start_branches(self, canonical: list[int], drafts: list[int], reply: DraftReply, main_depth: int) -> None:
        """Pre-draft on up to `branches` free slots, as many as the draft can run beside the main
        pre-draft within the verify (kpolicy.branch_budget), at the likeliest rejections
        (branch_points), each as deep as the main pre-draft."""
        free = [slot for slot in range(self.branches + 1) if slot != self.session.draft_slot]
        source = self.session.draft_slot
        budget = branch_budget(self.session.stats.timing, len(drafts), main_depth, self.branches)
        points = branch_points(drafts, reply.token_probs, reply.alternatives, self.stop.remaining, budget)
        for (j, alt), slot in zip(points, free):
            assumed = canonical + drafts[:j] + [alt]
            depth = min(len(drafts) + 1, self.max_k, self.stop.remaining - (j + 1) - 1)
            calls = _Calls()
            task = asyncio.create_task(self._propose_branch(assumed, depth, slot, source, calls))
            self._branches.append(_Branch(assumed, j, alt, slot, calls, task, time.perf_counter()))

    async def _propose_branch(self, assumed: list[int], k: int, slot: int, source: int,
                              calls: _Calls) -> DraftReply | None:
        """One branch pre-draft: fork `slot` from the session's draft slot at assumed[:-1], then draft
        k tokens after assumed[-1]. Optional work: any failure only means no branch this round."""
        w, session = self.workers, self.session
        view = session.draft_views.setdefault(slot, WorkerView())
        view.reset()  # whatever the slot held, the fork replaces it
        commit = session.draft_views[source].commit_for(assumed)
        if commit.cache_len != len(assumed) - 1:
            return None  # the draft does not hold the branch point (its slot was cropped meanwhile)
        try:
            with calls.counting_sent():
                reply = await w.draft.propose(session.session_id, commit, k, self.sampling, self.min_draft_prob,
                                              self.deadline.cap(w.draft_timeout_s, past_ok=True), slot=slot,
                                              fork_from=source)
        except SpecdecError as exc:
            log.debug("branch pre-draft on slot %d failed: %s", slot, exc)
            return None
        except Exception:  # noqa: BLE001 - optional work never fails the round, but a bug must show
            log.exception("branch pre-draft on slot %d failed", slot)
            return None
        calls.bytes_from_draft += reply.bytes_received
        if reply.slot != slot:
            # A draft worker without slots (an older one behind the same address) ran this on the
            # session's own cache: no branches from it again, and that cache is no longer what the
            # view says (the next commit's hash check would find out; a reset saves the round trip).
            log.warning("draft worker ignored branch slot %d (an older worker?): no more branch pre-drafts", slot)
            w.disable_branches()  # for the turns to come
            self.branches = 0  # and for the rest of this one
            session.draft_views[source].reset()
            return None
        view.after_call(assumed, reply.tokens, reply.cache_len)
        return reply

    async def _outcome(self, ahead: _PreDraft) -> DraftReply | None:
        """The pre-draft's reply, or None if it was cancelled or failed. Waits with asyncio.wait, so
        a cancellation of the turn itself still propagates."""
        await asyncio.wait({ahead.task})
        if ahead.task.cancelled():
            return None
        exc = ahead.task.exception()
        if exc is None:
            return ahead.task.result()
        if isinstance(exc, DeadlineExceeded):
            raise exc
        if isinstance(exc, (SessionNotFound, CacheMismatch)):
            # The pre-draft lost the session twice: optional work, so this round drafts serially.
            self.session.draft_view.reset()
        _log_predraft_failure("pre-draft failed; drafting serially", exc)
        return None

    async def settle(self) -> None:
        """End of a turn (finished, failed or cancelled): drop a pending pre-draft, so that no draft
        call outlives its turn and the reply is not held back by it. A cancelled call leaves the view
        at the prefix the draft surely holds (see _propose); the next commit re-sends the rest."""
        ahead, self._ahead = self._ahead, None
        branches, self._branches = self._branches, []
        # Every call cancelled before the first await: a second cancellation of the turn during the
        # wait (a client's, at shutdown) left the main pre-draft running past its turn.
        tasks = {b.task for b in branches} | ({ahead.task} if ahead is not None else set())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        if ahead is not None and not ahead.task.cancelled() and ahead.task.exception() is not None:
            _log_predraft_failure("pre-draft failed at the end of a turn", ahead.task.exception())

    @property
    def predraft_pending(self) -> bool:
        return self._ahead is not None or bool(self._branches)

    def _prefill_allowance_s(self, rows: int) -> float:
        """Time a draft call gets beyond draft_timeout_s for the tokens its commit appends: a long
        prompt's prefill is work, not an outage. Three times its expected cost: timed out, a
        prefill was abandoned and resent whole every round, each time for the whole timeout."""
        if rows <= PREFILL_ALLOWANCE_FROM_ROWS:
            return 0.0
        timing = self.session.stats.timing
        # Never below the curve; without one, a decode step per row (far above a prefill's cost).
        expected_ms = timing.draft_prefill_ms(rows, slowdown=(1.0, 4.0))
        if expected_ms is None:
            expected_ms = rows * timing.draft_ms_per_token.value
        return min(PREFILL_ALLOWANCE_MAX_S, PREFILL_ALLOWANCE_FACTOR * expected_ms / 1000.0)

    async def _propose(self, k: int, calls: _Calls, canonical: list[int] | None = None) -> DraftReply | None:
        """Ask the draft for k tokens; None if the draft cannot serve this round (it runs target-only).

        Speculation is optional, so a draft failure never fails the request: it costs this round its
        drafts. Only an outage (UNAVAILABLE, a draft timeout) puts the draft replica into backoff.
        """
        w, session = self.workers, self.session
        canonical = self.session.tokens if canonical is None else canonical
        # The slot is fixed for the call: a branch may become the draft slot while it runs.
        slot = session.draft_slot
        view = session.draft_views[slot]
        for attempt in range(2):
            commit = view.commit_for(canonical)
            own_timeout = w.draft_timeout_s + self._prefill_allowance_s(len(commit.append_tokens))
            timeout = self.deadline.cap(own_timeout)
            # The replica the call goes to: a failure is its own, even if the replica leaves the
            # ring meanwhile (its channel closed mid-call) and the session maps to another.
            health = w.draft_health.for_session(session.session_id)
            replica = _replica_of(w.draft, session.session_id)
            try:
                with calls.counting_sent():
                    reply = await w.draft.propose(session.session_id, commit, k, self.sampling, self.min_draft_prob,
                                                  timeout, slot=slot)
            except asyncio.CancelledError:
                # Cancelled mid-call (a cancelled turn, a dropped pre-draft): the worker applied the
                # commit or never ran it; either way it holds the kept prefix.
                view.keep(commit.cache_len)
                raise
            except (SessionNotFound, CacheMismatch) as exc:
                view.reset()
                if attempt:
                    # Even the re-prefill was refused: a draft bug, not the caller's error. The round
                    # runs target-only (a draft failure never fails a turn); the next re-prefills.
                    log.error("draft refused session %s's re-prefill too (%s); this round runs target-only",
                              session.session_id, exc)
                    return None
                log.info("draft lost session %s (%s): re-prefilling", session.session_id, type(exc).__name__)
                calls.reprefills += 1
                continue
            except (WorkerUnavailable, DeadlineExceeded) as exc:
                self.deadline.remaining()  # our own deadline passing is the caller's error, not a fallback
                log.warning("draft worker unavailable (%s); falling back to target-only", exc)
                health.failed()
                if isinstance(exc, DeadlineExceeded) and replica is not None and timeout >= own_timeout:
                    # Our own timeout (the caller's deadline raised above): a replica that hangs is
                    # failing, as the target's does, and its sessions go to another (a live process
                    # that answers pings but not Propose was never passed over).
                    w.draft.call_timed_out(replica, timeout)
                # Whether or not the call ran, the draft still holds the committed prefix: keep it, so
                # one slow round does not cost a re-prefill of the whole prefix.
                view.keep(commit.cache_len)
                await w.draft_health.report()
                return None
            except (CapacityExceeded, InvalidRequest, WorkerInternalError) as exc:
                # Over its KV budget, a request this draft cannot serve (e.g. its context is shorter),
                # or a bug in the draft: this round runs target-only. Not an outage: no backoff.
                level = logging.ERROR if isinstance(exc, WorkerInternalError) else logging.WARNING
                log.log(level, "draft cannot serve this round (%s); it runs target-only", exc)
                view.keep(commit.cache_len)
                return None
            # The view first: report() may suspend, and a cancel there (a pre-draft stopped by a
            # rejection) must not leave the view behind what the worker already applied.
            view.after_call(canonical[:commit.cache_len] + list(commit.append_tokens), reply.tokens, reply.cache_len)
            calls.bytes_from_draft += reply.bytes_received
            health.succeeded()
            await w.draft_health.report()
            return reply
        return None

    async def _verify(self, drafts: list[int], q_payload: Any, calls: _Calls) -> VerifyReply:
        w, session, canonical = self.workers, self.session, self.session.tokens
        view = session.target_view
        retry_until = time.monotonic() + w.target_retry_s
        backoff = 0.1
        reprefilled = False
        while True:
            commit = view.commit_for(canonical)
            timeout = self.deadline.cap(w.target_timeout_s)
            replica = _replica_of(w.target, session.session_id)
            try:
                with calls.counting_sent():
                    reply = await w.target.verify(session.session_id, commit, drafts, q_payload, self.sampling, timeout)
            except DeadlineExceeded as exc:
                if timeout < w.target_timeout_s:  # the client's deadline: its DEADLINE_EXCEEDED
                    raise
                if replica is not None:
                    w.target.call_timed_out(replica, timeout)
                raise WorkerUnavailable(f"target worker did not answer within {w.target_timeout_s:g} s") from exc
            except (SessionNotFound, CacheMismatch) as exc:
                if reprefilled:
                    raise
                log.info("target lost session %s (%s): re-prefilling", session.session_id, type(exc).__name__)
                calls.reprefills += 1
                reprefilled = True
                view.reset()
                continue
            except CapacityExceeded as exc:
                # A full target queue or a forward out of memory, mid-turn: waited out as its retry
                # hint says, within target_retry_s and the deadline, since failing would drop what the
                # turn has streamed. Before the turn's first token the caller gets it at once: load
                # shedding, which a client retries with its own backoff. The KV budget full of
                # sessions in use carries a hint too (they are held only for their calls); without
                # one (a message over the size limit) waiting is not known to help: it fails.
                hint_ms = getattr(exc, "retry_after_ms", None)
                wait = max(0.05, (hint_ms or 0) / 1000.0)
                left = self.deadline.remaining()
                if (hint_ms is None or self.stop.generated == 0 or time.monotonic() + wait > retry_until
                        or (left is not None and left <= wait)):
                    raise
                log.info("target over capacity mid-turn for session %s; retrying in %.0f ms: %s",
                         session.session_id, wait * 1000, exc)
                view.keep(commit.cache_len)  # refused, or its caches reset (then NOT_FOUND re-prefills)
                await asyncio.sleep(wait)
                continue
            except WorkerUnavailable as exc:
                # A restart comes back empty (then NOT_FOUND re-prefills); a blip keeps the cache.
                # Either way the committed prefix is the most the target can hold for us.
                view.keep(commit.cache_len)
                left = self.deadline.remaining()
                if time.monotonic() + backoff > retry_until or (left is not None and left <= backoff):
                    raise WorkerUnavailable(f"target worker unavailable for {w.target_retry_s:.0f}s: {exc}") from exc
                await asyncio.sleep(backoff)
                backoff = min(1.0, backoff * 2)
                continue
            calls.bytes_from_target += reply.bytes_received
            calls.target_cached = commit.cache_len
            view.after_call(canonical[:commit.cache_len] + list(commit.append_tokens), drafts, reply.cache_len)
            return reply


def branch_points(drafts: list[int], token_probs: list[float], alternatives: list[tuple[int, float]],
                  remaining: int, budget: int) -> list[tuple[int, int]]:
    """Where to pre-draft on a branch: up to `budget` (position, runner-up) pairs, likeliest first.

    The path 'drafts[:j] accepted, then the runner-up at j' has about the draft's own probability
    prod(p_i, i < j) * p_alt(j). A branch needs a round after it: at least 2 tokens left once the
    round has emitted its j + 1."""
    scored: list[tuple[float, int, int]] = []
    reach = 1.0
    for j, token in enumerate(drafts):
        alt, alt_prob = alternatives[j] if j < len(alternatives) else (-1, 0.0)
        if alt >= 0 and alt != token and remaining - (j + 1) >= 2:
            scored.append((reach * alt_prob, j, alt))
        reach *= token_probs[j] if j < len(token_probs) else 0.0
    scored.sort(key=lambda item: (-item[0], item[1]))
    return [(j, alt) for _, j, alt in scored[:budget]]


def _draft_token_ms(reply: DraftReply | None) -> float:
    """Per-token drafting cost from the forwards after the commit's catch-up forward, so a round that
    prefilled, or caught up two tokens after a fully accepted round, still measures it. A call with
    no forward after catch-up (k = 1, or a worker that predates the split) counts its whole time when
    the catch-up was a single token. 0: not measurable this round."""
    if reply is None or not reply.tokens:
        return 0.0
    if reply.draft_steps > 0:
        return max(0.0, reply.compute_ms - reply.catchup_ms) / reply.draft_steps
    return reply.compute_ms / len(reply.tokens) if reply.prefilled_tokens <= 1 else 0.0


def _replica_of(backend: Any, session_id: str) -> str | None:
    """The replica a routed backend sends the session's calls to, taken before a call (by its end the
    session may map elsewhere); None for an unrouted backend or where no replica is discovered (the
    call itself then fails UNAVAILABLE, handled as such)."""
    try:
        return getattr(backend, "node_for", lambda session_id: None)(session_id)
    except SpecdecError:
        return None


def _log_predraft_failure(what: str, exc: BaseException) -> None:
    """A pre-draft is optional work: a service error (the draft lost the session, was busy or gone)
    is expected and logged briefly; anything else is a bug, and must show with its traceback."""
    if isinstance(exc, SpecdecError):
        log.info("%s: %s", what, exc)
    else:
        log.error("%s: %s", what, exc, exc_info=exc)
