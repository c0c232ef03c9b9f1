"""The generation engine: checks a request, then runs its turn on a session, round after round (no grpc).

One turn: validate (once) -> session -> canonical tokens -> loop { k from the policy -> Round.run ->
every observer sees the RoundRecord -> stream event } -> final event. Worker calls and their recovery
live in orchestrator.rounds, stop rules in orchestrator.stopping, k policies in orchestrator.kpolicy.

Over 300 lines: a turn's life on its session (taken, rolled back, dropped, ended on the workers, and
a new session on the same id kept from racing the old one's end) is one sequence, read in one place.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any

from orchestrator.api import EngineLimits, GenerateParams, GenerationEvent, GenerationStats
from orchestrator.backends import DraftBackend, TargetBackend, WorkerDescription
from orchestrator.config import SpeculationConfig
from orchestrator.guard import TARGET_ONLY, PairGuard
from orchestrator.kpolicy import CostModelPolicy, SessionStats, TargetLoad, prefill_overlap_price
from orchestrator.record import RoundObserver, RoundRecord
from orchestrator.rounds import Deadline, DraftHealthBoard, Round, Workers
from orchestrator.routing import bounded_entry
from orchestrator.sessions import OrchestratorSession, OrchestratorSessions
from orchestrator.stopping import StopConditions
from specdec.contract import SamplingConfig, validate_session_id
from specdec.errors import CapacityExceeded, InvalidRequest, SessionBusy, SpecdecError
from specdec.tokenizers import Tokenizer

log = logging.getLogger(__name__)

ENDING_WAIT_S = 2.0  # how long a session's next request waits for its last turn to finish cleaning up
CONCURRENT_ENDS = 8  # EndSession calls in flight to the workers at once, at most
PENDING_ENDS_HEADROOM = 1024  # ends queued for the workers beyond max_sessions before new ones are refused or dropped
ENDS_RETRY_AFTER_MS = 1000  # the retry hint of an EndSession refused for a full backlog
INLINE_TOKENIZE_CHARS = 8_192  # shorter input is tokenised on the event loop (well under a millisecond)


class GenerationEngine:
    def __init__(self, draft: DraftBackend, target: TargetBackend, tokenizer: Tokenizer,
                 target_info: WorkerDescription, speculation: SpeculationConfig = SpeculationConfig(),
                 limits: EngineLimits = EngineLimits(), observers: Sequence[RoundObserver] = (),
                 draft_info: WorkerDescription | None = None, draft_rtt_ms: float | None = None,
                 target_rtt_ms: float | None = None) -> None:
        self.draft = draft
        self.target = target
        self.tokenizer = tokenizer
        self.target_info = target_info
        # A draft cannot draft past its context (target-only rounds); branches need its branch slots.
        self.draft_max_context = draft_info.max_context if draft_info else target_info.max_context
        self.draft_branch_slots = draft_info.branch_slots if draft_info else 0
        self.speculation = speculation.validate()  # fail fast on a bad server default
        self.limits = limits
        # Server-wide observers of every round (metrics, traces).
        self.observers = list(observers)
        pool = getattr(draft, "pool", None)
        self.draft_health = DraftHealthBoard(lambda session_id: self._replica(self.draft, "draft", session_id),
                                             pool.in_use if pool is not None else lambda: {"draft"})
        # Priors per (draft replica, target replica) pair: a new session starts from what recent
        # sessions measured on the same pair (speeds and acceptance differ between pairs).
        self.priors: dict[str, SessionStats] = {}
        # Where a new pair's prior starts: the workers' own cost curves, measured at their startup.
        self.seed_stats = seeded_stats(draft_info, target_info, self.speculation.max_k)
        self.seed_stats.timing.seed_rtt(draft_rtt_ms, target_rtt_ms)  # pinged at startup (app.measure_rtt_ms)
        # One guard per worker pair: it measures whether the pair as a whole gains by speculating.
        self.guards: dict[str, PairGuard] = {}
        self.sessions = OrchestratorSessions(limits.max_sessions, limits.session_ttl_s,
                                             lambda evicted: self._end_on_workers(evicted.session_id),
                                             max_tokens=limits.max_session_tokens)
        self._background: set[asyncio.Task[Any]] = set()
        self._ending: dict[str, asyncio.Task[Any]] = {}  # session id -> its worker sessions being ended
        # ... of which still waiting for a slot (an end asked again joins it), with the log level of
        # a failure: the highest any of its askers wanted (a client's EndSession: WARNING).
        self._queued_ends: dict[str, int] = {}
        # The backlog is bounded: an EndSession loop (a caller that gives up at once leaves its end
        # running) or workers slow to end grew it without limit. Every held session can expire at once.
        self._max_pending_ends = limits.max_sessions + PENDING_ENDS_HEADROOM
        # Ends go to the workers a few at a time: when thousands of sessions expire together (the
        # first request after a lull longer than the TTL), all their calls at once held up every
        # stream (8 requests took 3.7 s instead of 0.15 with 5,000 sessions ending).
        self._end_slots = asyncio.Semaphore(CONCURRENT_ENDS)
        self.workers = Workers(draft, target, limits.draft_timeout_s, limits.target_retry_s, self.draft_health,
                               lambda: setattr(self, "draft_branch_slots", 0), limits.target_timeout_s)

    # ------------------------------------------------------------------ validation
    def validate(self, params: GenerateParams) -> SpeculationConfig:
        """Check a request once; returns the speculation config it runs with."""
        inputs = [x for x in (params.prompt, params.prompt_ids, params.messages) if x is not None]
        if len(inputs) != 1:
            raise InvalidRequest("exactly one of prompt, prompt_ids or messages is required")
        if params.prompt is not None and not params.prompt:
            raise InvalidRequest("prompt is empty")
        if params.resume_session and params.session_id is None:
            raise InvalidRequest("resume_session needs a session_id")
        chars = len(params.prompt or "") + sum(len(content) for _, content in params.messages or ())  # messages too
        if chars > self.limits.max_prompt_chars:
            raise InvalidRequest(f"prompt has {chars} characters; the limit is {self.limits.max_prompt_chars}")
        if params.prompt_ids is not None:
            if not params.prompt_ids:
                raise InvalidRequest("prompt_ids is empty")
            if len(params.prompt_ids) > self.target_info.max_context:  # before a scan of millions of ids
                raise InvalidRequest(f"prompt_ids has {len(params.prompt_ids)} tokens, which exceeds the model "
                                     f"context of {self.target_info.max_context}")
            bad = [t for t in params.prompt_ids if not 0 <= t < self.target_info.vocab_size]
            if bad:
                raise InvalidRequest(f"prompt_ids contains {bad[0]}, outside the vocabulary [0, {self.target_info.vocab_size})")
        if params.messages is not None:
            if not params.messages:
                raise InvalidRequest("messages is empty")
            if bad_roles := [r for r, _ in params.messages if r not in ("system", "user", "assistant", "tool")]:
                raise InvalidRequest(f"unknown message role {bad_roles[0]!r}")
            if len(params.messages) > self.limits.max_messages:  # 100k empty ones rendered for 1.85 s
                raise InvalidRequest(f"{len(params.messages)} messages; the limit is {self.limits.max_messages}")
        if params.session_id is not None:
            validate_session_id(params.session_id)
        # 0 (unset): as many as the context and --max-new-tokens-limit allow (_run_turn).
        if params.max_new_tokens < 0:
            raise InvalidRequest("max_new_tokens must be >= 0")
        if params.max_new_tokens > self.limits.max_new_tokens:
            raise InvalidRequest(f"max_new_tokens={params.max_new_tokens} is above the limit of {self.limits.max_new_tokens}")
        if len(params.stop) > self.limits.max_stop_strings:
            raise InvalidRequest(f"at most {self.limits.max_stop_strings} stop strings")
        if any(not s or len(s) > self.limits.max_stop_chars for s in params.stop):
            raise InvalidRequest(f"stop strings must be non-empty and at most {self.limits.max_stop_chars} characters")
        if any("\ufffd" in s for s in params.stop):
            # U+FFFD is what decoding shows for an incomplete character: text ending in one is held back
            # until it resolves, so a stop string with it matched late or never.
            raise InvalidRequest("stop strings must not contain U+FFFD (the replacement character)")
        try:
            SamplingConfig(params.temperature, params.top_k, params.top_p).validate()
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        return self.speculation.with_override(params.speculation)

    # ------------------------------------------------------------------ sessions
    def _end_on_workers(self, session_id: str, failure_level: int = logging.DEBUG,
                        asked: bool = False) -> asyncio.Task[bool] | None:
        """End the id's sessions on the workers in the background (a task a new session on the id
        waits for). An end of the same id still waiting for its slot serves this one too: it has
        not run yet. With the backlog full, a tidy-up (an evicted or stand-alone session) is left to
        the workers' own TTL and LRU, and an end the caller `asked` for is refused RESOURCE_EXHAUSTED."""
        if session_id in self._queued_ends and (queued := self._ending.get(session_id)) is not None:
            self._queued_ends[session_id] = max(self._queued_ends[session_id], failure_level)
            return queued
        if self._ends_backlog_full():
            if asked:
                raise self._ends_refused()
            log.debug("end backlog full: session %s left to the workers' TTL", session_id)
            return None
        try:
            task = asyncio.get_running_loop().create_task(self._end_on_backends(session_id, failure_level))
        except RuntimeError:  # no loop: nothing to end them with
            return None
        self._background.add(task)
        self._ending[session_id] = task  # a new session on the id waits for it (generate)
        self._queued_ends[session_id] = failure_level
        task.add_done_callback(functools.partial(self._ended, session_id))
        return task

    def _refuse_end_if_full(self, session_id: str) -> None:
        """An EndSession is refused before it changes anything, and with no await between this check
        and its end's creation (_end_on_workers)."""
        if session_id not in self._queued_ends and self._ends_backlog_full():
            raise self._ends_refused()

    def _ends_backlog_full(self) -> bool:
        return len(self._background) >= self._max_pending_ends

    def _ends_refused(self) -> CapacityExceeded:
        return CapacityExceeded(f"{len(self._background)} sessions are being ended on the workers; retry later",
                                ENDS_RETRY_AFTER_MS)

    def _ended(self, session_id: str, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if self._ending.get(session_id) is task:
            del self._ending[session_id]
            self._queued_ends.pop(session_id, None)

    async def _end_on_backends(self, session_id: str, failure_level: int) -> bool:
        async with self._end_slots:
            # Running now: a later end of the id needs its own.
            failure_level = self._queued_ends.pop(session_id, failure_level)
            return await self._end_on_each(session_id, failure_level)

    async def _end_on_each(self, session_id: str, failure_level: int) -> bool:
        existed = False
        for backend in (self.draft, self.target):
            try:
                existed = await backend.end_session(session_id) or existed
            except SpecdecError as exc:
                log.log(failure_level, "end_session %s on a worker: %s", session_id, exc)
            except Exception:  # noqa: BLE001 - a background task: nobody else would see it
                log.exception("end_session %s on a worker failed", session_id)
        return existed

    async def settle(self, timeout_s: float) -> None:
        """Wait (bounded) for the sessions being ended on the workers: at shutdown, before the worker
        channels close (the turns cut at the end of the grace end theirs as they unwind)."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout_s)

    async def end_session(self, session_id: str) -> bool:
        self._refuse_end_if_full(session_id)
        found = False
        while (session := self.sessions.get(session_id)) is not None:
            # Wait for a generation in flight on this session: ending it mid-round would let that
            # round re-create worker caches for a session that no longer exists. By then the id may
            # hold another session (a waiting request took it over from a failed first turn): that one too.
            async with session.lock:
                if found := self.sessions.get(session_id) is session:
                    self._refuse_end_if_full(session_id)  # (again: the backlog may have filled meanwhile)
                    self.sessions.remove(session_id)
                    break
        else:
            self.sessions.remove(session_id)  # an evicted session's id may start afresh now
        ending = self._end_on_workers(session_id, logging.WARNING, asked=True)  # a new session waits for it
        return bool(ending is not None and await asyncio.shield(ending)) or found

    @staticmethod
    def _replica(backend: Any, role: str, session_id: str) -> str:
        """The replica a session is routed to (the role name for an unrouted backend)."""
        try:
            return getattr(backend, "node_for", lambda _: role)(session_id)
        except SpecdecError:
            return "unrouted"

    def pair_key(self, session_id: str) -> str:
        return f"{self._replica(self.draft, 'draft', session_id)}|{self._replica(self.target, 'target', session_id)}"

    def prior_for(self, session_id: str) -> SessionStats:
        return bounded_entry(self.priors, self.pair_key(session_id), self._new_prior)

    def guard_for(self, session_id: str) -> PairGuard:
        key = self.pair_key(session_id)
        return bounded_entry(self.guards, key, lambda: PairGuard(self.speculation.guard_settings(), key))

    def _new_prior(self) -> SessionStats:
        prior = self.seed_stats.as_pair_prior()
        prior.timing.load = self.seed_stats.timing.load.fresh()  # one live load per worker pair
        return prior

    async def _input_tokens(self, session: OrchestratorSession, params: GenerateParams) -> list[int]:
        """Canonical token list after appending this request's input to the session. Long text is
        tokenised off the event loop: a prompt of 1M characters took about 1 s, and every other
        stream and the health checks waited that long."""
        session.check_input(chat=params.messages is not None)
        if params.prompt_ids is not None:
            return session.tokens + list(params.prompt_ids)
        if params.prompt is not None:
            # A session's first text gets the tokenizer's special tokens (a BOS), as HF generate on
            # tokenizer(prompt), vLLM and TGI give it; text that continues a session does not.
            return session.tokens + await self._off_loop(len(params.prompt), self.tokenizer.encode, params.prompt,
                                                         add_special_tokens=not session.tokens)
        assert params.messages is not None
        history = session.messages + [{"role": r, "content": c} for r, c in params.messages]
        chars = sum(len(m["content"]) + 16 for m in history)  # + what a template adds per message
        rendered = await self._off_loop(chars, self.tokenizer.apply_chat_template, history, add_generation_prompt=True)
        session.messages = history
        return rendered

    @staticmethod
    async def _off_loop(chars: int, work: Callable[..., list[int]], *args: Any, **kwargs: Any) -> list[int]:
        if chars < INLINE_TOKENIZE_CHARS:  # a thread hop costs more than short text
            return work(*args, **kwargs)
        return await asyncio.to_thread(work, *args, **kwargs)

    @staticmethod
    async def _wait_for_arrivals(guard: PairGuard, round_: Round, session: OrchestratorSession,
                                 deadline: Deadline) -> None:
        """Before a turn's first round on a speculating pair: a moment for turns arriving with it to
        count in the pair's load (PairGuard.arrival_wait_ms), priced on the target's rows curve.
        None where the round runs target-only anyway (the prefill overlap: no rows to price)."""
        rows = round_.target_prefill_rows()
        wait_ms = guard.arrival_wait_ms(session.stats.timing.load.forward_ms(rows)) if rows > 0 else 0.0
        if wait_ms > 0:
            await asyncio.sleep(deadline.cap(wait_ms / 1000.0))

    @property
    def draft_degraded(self) -> bool:
        """True while a draft replica in use is in backoff (the health entry .../draft)."""
        return self.draft_health.degraded

    # ------------------------------------------------------------------ generation
    async def generate(self, params: GenerateParams, timeout_s: float | None = None,
                       speculation: SpeculationConfig | None = None) -> AsyncIterator[GenerationEvent]:
        """Run one turn. `speculation` is what validate() returned, when the caller validated already."""
        if speculation is None:
            speculation = self.validate(params)
        deadline = Deadline(timeout_s)
        ephemeral = params.session_id is None
        session_id = params.session_id or f"tmp-{uuid.uuid4().hex}"
        # The turn counts in its pair's load from now, not from its first round (guard.arrive).
        arrival = Arrival(self.guard_for(session_id) if speculation.guarded else None)
        try:
            try:
                session = await self.sessions.take(session_id, ephemeral,
                                                   lambda: self.prior_for(session_id).new_session(),
                                                   deadline.cap(ENDING_WAIT_S), must_exist=params.resume_session)
            except SessionBusy:
                deadline.remaining()  # DeadlineExceeded where the caller's deadline ran out first
                raise
            try:
                # The statistics too: a retry of the turn with the same seed reuses its uniforms, so the
                # failed attempt's acceptances must not choose the retry's k (docs/correctness.md).
                saved_tokens, saved_messages = list(session.tokens), list(session.messages)
                saved_stats = session.stats.snapshot()
                completed = False
                try:
                    if not session.tokens and (ending := self._ending.get(session_id)) is not None:
                        # The workers are still ending this id's last session: let them, before this one starts.
                        await asyncio.wait([ending], timeout=deadline.cap(ENDING_WAIT_S))
                    # aclosing: a consumer that stops early closes the turn (and its pending pre-draft)
                    # here, before the session lock is released, not whenever the generator is collected.
                    async with contextlib.aclosing(self._run_turn(session, params, speculation, deadline,
                                                                   arrival)) as events:
                        async for event in events:
                            completed = event.finish_reason is not None
                            yield event
                finally:
                    # All or nothing: a failed or cancelled turn leaves the session as it was (no prompt twice).
                    if not completed:
                        session.tokens, session.messages = saved_tokens, saved_messages
                        saved_stats.timing.load = session.stats.timing.load  # the pair's live load, kept
                        session.stats = saved_stats
                    # A named session whose first turn failed is left as it was before: not there at all.
                    # Discarded before touch() counts its tokens: an ephemeral turn's tokens, freed at
                    # once, evicted named sessions' histories to make room for them.
                    if (ephemeral or not session.tokens) and self.sessions.discard(session):
                        self._end_on_workers(session_id)
                    else:
                        self.sessions.touch(session)
            finally:
                session.lock.release()
        finally:
            arrival.leave()

    async def _run_turn(self, session: OrchestratorSession, params: GenerateParams, spec: SpeculationConfig,
                        deadline: Deadline, arrival: "Arrival") -> AsyncIterator[GenerationEvent]:
        started = time.perf_counter()
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        session.tokens = await self._input_tokens(session, params)
        prompt_len = len(session.tokens)
        context = self.target_info.max_context
        if prompt_len + max(params.max_new_tokens, 1) > context:
            asked = f"max_new_tokens ({params.max_new_tokens})" if params.max_new_tokens else "one new token"
            raise InvalidRequest(f"prompt ({prompt_len} tokens) + {asked} exceeds the model context of {context}")
        # An explicit max_new_tokens that does not fit is refused above (as OpenAI-style servers do);
        # unset, the turn runs until EOS, a stop string, the service's limit ("length") or a full
        # context window ("context").
        max_new_tokens = params.max_new_tokens or self.limits.max_new_tokens
        spec = replace(spec, pipeline_branches=min(spec.pipeline_branches, self.draft_branch_slots))
        policy = spec.make_policy()  # (the policy counts only branches the draft can run)
        stop = StopConditions.for_turn(self.target_info.eos_token_ids, max_new_tokens, context - prompt_len,
                                       params.stop, self.tokenizer.decode, prompt=session.tokens)
        round_ = Round(self.workers, session, SamplingConfig(params.temperature, params.top_k, params.top_p, seed),
                       deadline, stop, spec.min_draft_prob, policy.name, pipeline=spec.pipeline, max_k=spec.max_k,
                       overlap_prefill=spec.prefill_overlap_mode(devices_apart=self.speculation.pipeline),
                       branches=spec.pipeline_branches,
                       overlap_pays=lambda rows: overlap_pays(session.stats, rows, spec, stop.remaining))
        stats = GenerationStats(seed=seed, prompt_tokens=prompt_len)
        prior = self.prior_for(session.session_id)
        # The load of the pair the session is on now: after a scale-out moved it, its verifies must
        # not update the old pair's load (and carry_turn_into must not hand that to the new pair).
        session.stats.timing.load = prior.timing.load
        guard = self.guard_for(session.session_id) if spec.guarded else None
        observers: list[Any] = [stats, *self.observers]
        # What the policies know. The pair's prior learns the turn's rounds only once it completes,
        # for the same reason the session's statistics are put back when it fails.
        prior_learner = _PriorObserver(prior, spec.picks_target_only)
        learners: list[Any] = [session.stats, prior_learner]
        label = "" if session.ephemeral else session.session_id

        def draft_room() -> int:
            # A round yields up to k+1 tokens: never draft past the budget, nor past the draft's
            # context. The policy chooses within that room; where there is none it is not asked
            # (a probe it would count would draft nothing).
            return max(0, min(spec.max_k, stop.remaining - 1, self.draft_max_context - len(session.tokens)))

        try:
            if guard is not None and draft_room() > 0:
                await self._wait_for_arrivals(guard, round_, session, deadline)
            arrival.leave()  # (its first round is decided now, with no await before it)
            while True:
                ticket = guard.decide() if guard is not None else None
                forced_off = ticket is not None and ticket.mode == TARGET_ONLY
                room = draft_room()
                try:
                    k = 0 if forced_off or room == 0 else policy.next_k(
                        session.stats, min(spec.min_k, room), room, round_.target_prefill_rows())
                except BaseException:
                    if ticket is not None:  # a ticket never handed back counts as in flight for good
                        guard.abandon(ticket)
                    raise
                log.debug("session %s: k=%d %s", session.session_id, k, session.stats.described(spec.max_k))
                record = await round_.run_guarded(min(k, room), guard, ticket)
                if room == 0 and spec.max_k > 0 and not forced_off:
                    record = dataclasses.replace(record, budget_capped=True)
                # A round the guard forced to k = 0 is not the policy's choice: its cost, with the whole
                # pair off, is not what a k = 0 of this session alone costs. The policy does not learn it.
                for observer in observers + ([] if forced_off else learners):
                    observer.observe(record)
                if record.finish is not None:
                    break
                if record.text_delta or record.emitted:
                    yield GenerationEvent(record.text_delta, list(record.emitted), session_id=label)
        finally:
            session.ending = True  # the turn is over (ended, failed or cancelled): only cleaning up now
            await round_.settle()  # no pre-draft outlives its turn
        stats.total_ms = (time.perf_counter() - started) * 1000.0
        prior_learner.commit()
        # Rounds not forced off by the guard: the policy chose their k.
        session.stats.carry_turn_into(prior, isinstance(policy, CostModelPolicy) and stats.rounds > stats.guard_off_rounds)
        if session.messages and params.messages is not None:
            session.messages.append({"role": "assistant", "content": stop.full_text})
        yield GenerationEvent(record.text_delta, list(record.emitted), record.finish, stats, label)


class Arrival:
    """A turn counted in its pair guard's load from its arrival until its first round is decided
    (guard.arrive / depart); leave() is idempotent."""

    def __init__(self, guard: PairGuard | None) -> None:
        self.guard = guard
        if guard is not None:
            guard.arrive()

    def leave(self) -> None:
        if self.guard is not None:
            self.guard.depart()
            self.guard = None


def overlap_pays(stats: SessionStats, prompt_rows: int, spec: SpeculationConfig, remaining: int) -> bool:
    """The prefill overlap's per-turn choice ("auto"): priced by the cost model, with the pipelining
    and branches the turn runs and its token budget (kpolicy.prefill_overlap_price). Under the
    bandit too, whose prior the cost model is."""
    price = prefill_overlap_price(stats, prompt_rows, spec.min_k, spec.max_k, spec.pipeline,
                                  spec.pipeline_branches, remaining)
    if price is None:
        return False
    log.debug("prefill overlap over %d prompt rows: %.0f ms + %.0f ms to make up against %.0f ms serial (k=%d): %s",
              prompt_rows, price.overlap, price.make_up, price.serial, price.k_serial,
              "overlap" if price.pays else "serial")
    return price.pays


def seeded_stats(draft: WorkerDescription | None, target: WorkerDescription, max_k: int) -> SessionStats:
    """Policy state before any round: verifying k drafts costs one target forward over k + 1 tokens,
    drafting one token one draft forward over 1 token, as the workers measured them at startup."""
    stats = SessionStats()
    verify = {k: ms for k in range(0, max_k + 1) if (ms := target.forward_costs.ms(k + 1)) is not None}
    stats.timing.seed(draft.forward_costs.ms(1) if draft is not None else None, verify)
    stats.timing.load = TargetLoad(target.forward_costs.rows_curve())
    stats.timing.draft_curve = draft.forward_costs.rows_curve() if draft is not None else ()
    return stats


class _PriorObserver:
    """The pair's prior learns from every round but a caller's pinned k = 0 (no sign that drafting
    loses), of turns that complete: held until commit(), so a failed turn's rounds never reach it."""

    def __init__(self, prior: SessionStats, policy_picks_target_only: bool) -> None:
        self.prior, self.policy_picks_target_only = prior, policy_picks_target_only
        self._held: list[RoundRecord] = []

    def observe(self, record: RoundRecord) -> None:
        if record.k > 0 or self.policy_picks_target_only:
            self._held.append(record)

    def commit(self) -> None:
        for record in self._held:
            self.prior.observe(record, timing=False)
        self._held.clear()
