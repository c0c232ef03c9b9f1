"""The round loop: draft proposes, target verifies, the orchestrator commits (no grpc here)."""
from __future__ import annotations

import asyncio
import copy
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar

from orchestrator.backends import DraftBackend, TargetBackend, WorkerDescription
from orchestrator.sessions import OrchestratorSession, OrchestratorSessions, WorkerView
from orchestrator.text import TextAssembler
from orchestrator.traces import RoundTrace, TraceWriter
from specdec.errors import (CacheMismatch, CapacityExceeded, DeadlineExceeded, InvalidRequest, SessionBusy,
                            SessionNotFound, SpecdecError, WorkerInternalError, WorkerUnavailable)
from specdec.kpolicy import POLICY_NAMES, KPolicy, PolicyParams, SessionStats, make_policy
from specdec.models import Tokenizer
from specdec.sampling import SamplingConfig
from specdec.worker_core import MAX_SESSION_ID_LEN

log = logging.getLogger(__name__)

MAX_K = 32


@dataclass(frozen=True)
class SpeculationConfig:
    """Server defaults for the adaptive-k policy (a TOML [speculation] table); a request may
    override policy, k bounds, fixed k and min_draft_prob."""
    policy: str = "cost"
    min_k: int = 0
    max_k: int = 8
    # Within-round early stop: the draft stops when its probability of its own token is below this.
    min_draft_prob: float = 0.0
    # Policy parameters, flat for the TOML table; their defaults live in PolicyParams.
    fixed_k: int = PolicyParams.fixed_k
    heuristic_initial_k: int = PolicyParams.heuristic_initial_k
    probe_every: int = PolicyParams.probe_every
    bandit_exploration: float = PolicyParams.bandit_exploration
    bandit_prior_weight: float = PolicyParams.bandit_prior_weight

    def policy_params(self, fixed_k: int | None = None) -> PolicyParams:
        params = PolicyParams(**{f.name: getattr(self, f.name) for f in fields(PolicyParams)})
        return params if fixed_k is None else replace(params, fixed_k=fixed_k)


@dataclass(frozen=True)
class SpeculationOverride:
    policy: str | None = None
    min_k: int | None = None
    max_k: int | None = None
    fixed_k: int | None = None
    min_draft_prob: float | None = None


@dataclass(frozen=True)
class GenerateParams:
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    session_id: str | None = None
    max_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    speculation: SpeculationOverride = SpeculationOverride()


@dataclass
class GenerationStats:
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    k_per_round: list[int] = field(default_factory=list)
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    total_ms: float = 0.0
    new_tokens: int = 0
    reprefills: int = 0
    bytes_to_draft: int = 0
    bytes_to_target: int = 0
    bytes_from_draft: int = 0
    bytes_from_target: int = 0
    seed: int = 0
    fallback_rounds: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def overhead_ms(self) -> float:
        return max(0.0, self.total_ms - self.draft_ms - self.verify_ms)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / (self.total_ms / 1000.0) if self.total_ms > 0 else 0.0


@dataclass
class GenerationEvent:
    """A chunk of output. The last event has finish_reason and stats set."""
    text_delta: str
    token_ids: list[int]
    finish_reason: str | None = None   # "length" | "stop" | "eos" | "context"
    stats: GenerationStats | None = None
    session_id: str = ""


@dataclass(frozen=True)
class EngineLimits:
    max_new_tokens: int = 4096
    max_prompt_chars: int = 1_000_000
    max_stop_strings: int = 16
    max_sessions: int = 10_000
    session_ttl_s: float = 600.0
    # How long a round keeps retrying an unreachable target (a restart) before UNAVAILABLE.
    target_retry_s: float = 10.0
    # A draft call slower than this is abandoned and the round runs target-only.
    draft_timeout_s: float = 10.0


class EngineObserver:
    """Hooks for metrics (no-op by default; specdec.metrics.OrchestratorMetrics implements them)."""

    def round(self, k: int, drafted: int, accepted: int, draft_ms: float, verify_ms: float, round_ms: float,
              fallback: bool, acceptance_ewma: float) -> None: ...

    def reprefill(self) -> None: ...


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
        self.failures += 1
        self._backoff = min(self.max_s, self._backoff * 2 if self._backoff else self.initial_s)
        self._retry_at = time.monotonic() + self._backoff

    def succeeded(self) -> None:
        self._backoff = 0.0
        self._retry_at = 0.0


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


V = TypeVar("V")
MAX_REPLICA_ENTRIES = 1024  # per-replica state is bounded: replicas come and go with scaling


def _bounded_entry(entries: dict[str, V], key: str, make: Callable[[], V]) -> V:
    """entries[key], created on first use; the oldest entry goes when the map is full."""
    if key not in entries:
        if len(entries) >= MAX_REPLICA_ENTRIES:
            entries.pop(next(iter(entries)))
        entries[key] = make()
    return entries[key]


class GenerationEngine:
    def __init__(self, draft: DraftBackend, target: TargetBackend, tokenizer: Tokenizer,
                 target_info: WorkerDescription, speculation: SpeculationConfig = SpeculationConfig(),
                 limits: EngineLimits = EngineLimits(), tracer: "TraceWriter | None" = None,
                 observer: EngineObserver | None = None, draft_info: WorkerDescription | None = None) -> None:
        self.draft = draft
        # A draft with a shorter context than the target cannot draft past it: those rounds run target-only.
        self.draft_max_context = draft_info.max_context if draft_info else target_info.max_context
        self.tracer = tracer
        self.observer = observer or EngineObserver()
        self.target = target
        self.tokenizer = tokenizer
        self.target_info = target_info
        self.eos_ids = set(target_info.eos_token_ids)
        self.speculation = speculation
        self.limits = limits
        # Backoff per draft replica: one dead replica must not stop speculation for the others.
        self.draft_health: dict[str, DraftHealth] = {}
        # Called with True when the draft becomes unusable and False when it recovers.
        self.on_draft_health: Callable[[bool], Awaitable[None]] | None = None
        # Priors per (draft replica, target replica) pair: a new session starts from what recent
        # sessions measured on the same pair (speeds and acceptance differ between pairs).
        self.priors: dict[str, SessionStats] = {}
        self.sessions = OrchestratorSessions(limits.max_sessions, limits.session_ttl_s, self._end_on_workers)
        self._background: set[asyncio.Task[Any]] = set()
        make_policy(speculation.policy, speculation.policy_params())  # fail fast on a bad server default

    # ------------------------------------------------------------------ validation
    def validate(self, params: GenerateParams) -> None:
        inputs = [x for x in (params.prompt, params.prompt_ids, params.messages) if x is not None]
        if len(inputs) != 1:
            raise InvalidRequest("exactly one of prompt, prompt_ids or messages is required")
        if params.prompt is not None and not params.prompt:
            raise InvalidRequest("prompt is empty")
        if params.prompt is not None and len(params.prompt) > self.limits.max_prompt_chars:
            raise InvalidRequest(f"prompt has {len(params.prompt)} characters; the limit is {self.limits.max_prompt_chars}")
        if params.prompt_ids is not None:
            if not params.prompt_ids:
                raise InvalidRequest("prompt_ids is empty")
            bad = [t for t in params.prompt_ids if not 0 <= t < self.target_info.vocab_size]
            if bad:
                raise InvalidRequest(f"prompt_ids contains {bad[0]}, outside the vocabulary [0, {self.target_info.vocab_size})")
        if params.messages is not None:
            if not params.messages:
                raise InvalidRequest("messages is empty")
            for role, _ in params.messages:
                if role not in ("system", "user", "assistant", "tool"):
                    raise InvalidRequest(f"unknown message role {role!r}")
        if params.session_id is not None:
            sid = params.session_id
            if not sid or len(sid) > MAX_SESSION_ID_LEN or not sid.isprintable():
                raise InvalidRequest(f"session_id must be 1-{MAX_SESSION_ID_LEN} printable characters")
        if params.max_new_tokens <= 0:
            raise InvalidRequest("max_new_tokens must be > 0")
        if params.max_new_tokens > self.limits.max_new_tokens:
            raise InvalidRequest(f"max_new_tokens={params.max_new_tokens} is above the limit of {self.limits.max_new_tokens}")
        if len(params.stop) > self.limits.max_stop_strings:
            raise InvalidRequest(f"at most {self.limits.max_stop_strings} stop strings")
        if any(not s for s in params.stop):
            raise InvalidRequest("stop strings must be non-empty")
        try:
            SamplingConfig(params.temperature, params.top_k, params.top_p).validate()
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        self._resolve_policy(params.speculation)

    def _resolve_policy(self, override: SpeculationOverride) -> tuple[KPolicy, int, int]:
        """Precedence: request fixed_k > request policy > server default; bounds likewise."""
        spec = self.speculation
        min_k = spec.min_k if override.min_k is None else override.min_k
        max_k = spec.max_k if override.max_k is None else override.max_k
        if override.min_draft_prob is not None and not 0.0 <= override.min_draft_prob <= 1.0:
            raise InvalidRequest("min_draft_prob must be in [0, 1]")
        if override.fixed_k is not None:
            if not 0 <= override.fixed_k <= MAX_K:
                raise InvalidRequest(f"fixed_k must be in [0, {MAX_K}]")
            return make_policy("fixed", spec.policy_params(override.fixed_k)), override.fixed_k, override.fixed_k
        if not 0 <= min_k <= max_k <= MAX_K:
            raise InvalidRequest(f"need 0 <= min_k <= max_k <= {MAX_K}, got min_k={min_k} max_k={max_k}")
        name = override.policy or spec.policy
        if name not in POLICY_NAMES:
            raise InvalidRequest(f"unknown k policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
        return make_policy(name, spec.policy_params()), min_k, max_k

    # ------------------------------------------------------------------ sessions
    def _end_on_workers(self, session: OrchestratorSession) -> None:
        async def end() -> None:
            for backend in (self.draft, self.target):
                try:
                    await backend.end_session(session.session_id)
                except SpecdecError as exc:
                    log.debug("end_session on a worker failed: %s", exc)
        try:
            task = asyncio.get_running_loop().create_task(end())
        except RuntimeError:
            return
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def end_session(self, session_id: str) -> bool:
        session = self.sessions.get(session_id)
        if session is not None:
            # Wait for a generation in flight on this session: ending it mid-round would let that
            # round re-create worker caches for a session that no longer exists.
            async with session.lock:
                self.sessions.remove(session_id)
        existed = session is not None
        for backend in (self.draft, self.target):
            try:
                existed = await backend.end_session(session_id) or existed
            except SpecdecError as exc:
                log.warning("end_session %s: %s", session_id, exc)
        return existed

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
        return _bounded_entry(self.priors, self.pair_key(session_id), SessionStats)

    def _input_tokens(self, session: OrchestratorSession, params: GenerateParams) -> list[int]:
        """Canonical token list after appending this request's input to the session."""
        if params.prompt_ids is not None:
            return session.tokens + list(params.prompt_ids)
        if params.prompt is not None:
            return session.tokens + self.tokenizer.encode(params.prompt)
        assert params.messages is not None
        history = session.messages + [{"role": r, "content": c} for r, c in params.messages]
        rendered = self.tokenizer.apply_chat_template(history, add_generation_prompt=True)
        session.messages = history
        return rendered

    # ------------------------------------------------------------------ generation
    async def generate(self, params: GenerateParams, timeout_s: float | None = None) -> AsyncIterator[GenerationEvent]:
        self.validate(params)
        deadline = Deadline(timeout_s)
        ephemeral = params.session_id is None
        session_id = params.session_id or f"tmp-{uuid.uuid4().hex}"
        session = self.sessions.get_or_create(session_id, ephemeral,
                                              lambda: copy.deepcopy(self.prior_for(session_id)))
        if session.lock.locked():
            raise SessionBusy(f"session {session_id!r} is busy with another request; retry when it finishes")
        async with session.lock:
            try:
                async for event in self._generate_locked(session, params, deadline):
                    yield event
            finally:
                if ephemeral:
                    self.sessions.remove(session_id)
                    self._end_on_workers(session)

    async def _generate_locked(self, session: OrchestratorSession, params: GenerateParams,
                               deadline: Deadline) -> AsyncIterator[GenerationEvent]:
        """Runs one turn. If it fails or is cancelled, the session's canonical tokens and chat history
        are left exactly as they were before the call, so a retry never sees the prompt twice."""
        saved_tokens, saved_messages = list(session.tokens), list(session.messages)
        completed = False
        try:
            async for event in self._run_turn(session, params, deadline):
                if event.finish_reason is not None:
                    completed = True
                yield event
        finally:
            if not completed:
                session.tokens, session.messages = saved_tokens, saved_messages

    async def _run_turn(self, session: OrchestratorSession, params: GenerateParams,
                        deadline: Deadline) -> AsyncIterator[GenerationEvent]:
        started = time.perf_counter()
        prior = self.prior_for(session.session_id)
        policy, min_k, max_k = self._resolve_policy(params.speculation)
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        sampling = SamplingConfig(params.temperature, params.top_k, params.top_p, seed)
        canonical = self._input_tokens(session, params)
        prompt_len = len(canonical)
        if prompt_len + params.max_new_tokens > self.target_info.max_context:
            raise InvalidRequest(f"prompt ({prompt_len} tokens) + max_new_tokens ({params.max_new_tokens}) "
                                 f"exceeds the model context of {self.target_info.max_context}")
        stats = GenerationStats(seed=seed, prompt_tokens=prompt_len)
        session.tokens = canonical
        text = TextAssembler(self.tokenizer.decode, params.stop)
        generated: list[int] = []
        finish: str | None = None
        sid = session.session_id

        min_draft_prob = (self.speculation.min_draft_prob if params.speculation.min_draft_prob is None
                          else params.speculation.min_draft_prob)
        policy_name = policy.name
        while finish is None:
            round_start = time.perf_counter()
            position = len(canonical)
            remaining = params.max_new_tokens - len(generated)
            # A round yields up to k+1 tokens: never draft past the budget.
            k = max(0, min(policy.next_k(session.stats, min_k, max_k), remaining - 1))
            # Nor past the draft's context (a draft may have a shorter one than the target).
            k = min(k, max(0, self.draft_max_context - position))
            use_draft = k > 0 and self._draft_health_for(session.session_id).usable()
            drafts: list[int] = []
            draft_probs: list[float] = []
            q_payload = None
            draft_ms = draft_token_ms = 0.0
            draft_prefilled = 0
            fallback = k > 0 and not use_draft
            if use_draft:
                reply = await self._propose(session, canonical, k, sampling, min_draft_prob, deadline, stats)
                if reply is None:
                    fallback = True
                else:
                    drafts, q_payload, draft_probs = reply.tokens, reply.q_payload, reply.token_probs
                    draft_ms, draft_prefilled = reply.compute_ms, reply.prefilled_tokens
                    stats.draft_ms += reply.compute_ms
                    draft_token_ms = self._observe_draft_timing(session.stats.timing, reply)
            stats.fallback_rounds += int(fallback)
            verify = await self._verify(session, canonical, drafts, q_payload, sampling, deadline, stats)
            stats.verify_ms += verify.compute_ms
            steady = verify.prefilled_tokens <= 1 and draft_prefilled <= 1
            if verify.prefilled_tokens <= 1:
                session.stats.timing.observe_verify(len(drafts), verify.compute_ms)
            session.stats.timing.observe_rtt(verify.wall_ms - verify.compute_ms)
            round_ms = (time.perf_counter() - round_start) * 1000.0

            accepted = verify.accepted_len
            stats.rounds += 1
            stats.k_per_round.append(len(drafts))
            stats.draft_tokens += len(drafts)
            stats.accepted_tokens += accepted
            if len(stats.accepted_per_position) < len(drafts):
                stats.accepted_per_position.extend([0] * (len(drafts) - len(stats.accepted_per_position)))
            for i in range(accepted):
                stats.accepted_per_position[i] += 1
            # Rounds that prefilled a prompt say nothing about a k's steady-state speed.
            session.stats.observe_round(len(drafts), accepted, round_ms if steady else None)
            prior.observe_round(len(drafts), accepted, round_ms if steady else None)
            self.observer.round(k, len(drafts), accepted, draft_ms, verify.compute_ms, round_ms, fallback,
                                prior.acceptance.value)
            if self.tracer is not None:
                self.tracer.write(RoundTrace(
                    session=sid, round=stats.rounds, position=position, policy=policy_name, k=k,
                    drafted=len(drafts), accepted=accepted, draft_probs=[round(p, 5) for p in draft_probs],
                    draft_ms=round(draft_ms, 3), verify_ms=round(verify.compute_ms, 3), round_ms=round(round_ms, 3),
                    draft_prefilled=draft_prefilled, target_prefilled=verify.prefilled_tokens,
                    greedy=sampling.greedy, fallback=fallback,
                    draft_token_ms=round(draft_token_ms, 3)))

            new_tokens = (drafts[:accepted] + [verify.next_token])[:remaining]
            for i, token in enumerate(new_tokens):
                if token in self.eos_ids:
                    new_tokens = new_tokens[:i + 1]
                    finish = "eos"
                    break
            delta, keep = text.add(new_tokens)
            if text.stopped:
                new_tokens = new_tokens[:keep]
                finish = "stop"
            canonical.extend(new_tokens)
            generated.extend(new_tokens)
            if finish is None and len(generated) >= params.max_new_tokens:
                finish = "length"
            if finish is None and len(canonical) >= self.target_info.max_context:
                finish = "context"
            if finish is not None:
                delta += text.flush()
                break
            if delta or new_tokens:
                yield GenerationEvent(delta, new_tokens, session_id="" if session.ephemeral else sid)

        stats.new_tokens = len(generated)
        stats.total_ms = (time.perf_counter() - started) * 1000.0
        self._carry_timing_to_prior(prior, session.stats, stats)
        if session.messages and params.messages is not None:
            session.messages.append({"role": "assistant", "content": text.emitted})
        yield GenerationEvent(delta, new_tokens, finish, stats, session_id="" if session.ephemeral else sid)

    @staticmethod
    def _observe_draft_timing(timing: Any, reply: Any) -> float:
        """Per-token drafting cost from the forwards after the commit's catch-up forward, so a round
        that prefilled, or caught up two tokens after a fully accepted round, still measures it.
        Returns that cost (0 when the round had no drafting forward)."""
        if reply.draft_steps > 0:
            per_token = max(0.0, reply.compute_ms - reply.catchup_ms) / reply.draft_steps
            timing.observe_draft(1, per_token)
            return per_token
        if reply.catchup_ms == 0.0 and reply.prefilled_tokens <= 1 and reply.tokens:
            # A worker that predates the split: the whole call, steady-state rounds only.
            timing.observe_draft(len(reply.tokens), reply.compute_ms)
        return 0.0

    @staticmethod
    def _carry_timing_to_prior(prior: SessionStats, session_stats: SessionStats, stats: GenerationStats) -> None:
        # The latest session's timings become the prior of new sessions on this worker pair.
        if stats.rounds:
            prior.timing = copy.deepcopy(session_stats.timing)

    async def _propose(self, session: OrchestratorSession, canonical: list[int], k: int,
                       sampling: SamplingConfig, min_draft_prob: float, deadline: Deadline,
                       stats: GenerationStats):
        """Ask the draft for k tokens; None if the draft cannot serve this round (it runs target-only).

        Speculation is optional, so a draft failure never fails the request: it costs this round its
        drafts. Only an outage (UNAVAILABLE, a draft timeout) puts the draft replica into backoff.
        """
        view = session.draft_view
        for attempt in range(2):
            commit = view.commit_for(canonical)
            left = deadline.remaining()
            timeout = self.limits.draft_timeout_s if left is None else min(left, self.limits.draft_timeout_s)
            try:
                reply = await self.draft.propose(session.session_id, commit, k, sampling, min_draft_prob, timeout)
            except (SessionNotFound, CacheMismatch) as exc:
                if attempt:
                    raise
                log.info("draft lost session %s (%s): re-prefilling", session.session_id, type(exc).__name__)
                stats.reprefills += 1
                self.observer.reprefill()
                view.reset()
                continue
            except (WorkerUnavailable, DeadlineExceeded) as exc:
                deadline.remaining()  # our own deadline passing is the caller's error, not a fallback
                log.warning("draft worker unavailable (%s); falling back to target-only", exc)
                was_degraded = self.draft_degraded
                self._draft_health_for(session.session_id).failed()
                # Whether or not the call ran, the draft still holds the committed prefix: keep it, so
                # one slow round does not cost a re-prefill of the whole prefix.
                view.keep(commit.cache_len)
                if not was_degraded:
                    await self._report_draft_health(True)
                return None
            except (CapacityExceeded, InvalidRequest, WorkerInternalError) as exc:
                # Over its KV budget, a request this draft cannot serve (e.g. its context is shorter),
                # or a bug in the draft: this round runs target-only. Not an outage: no backoff.
                level = logging.ERROR if isinstance(exc, WorkerInternalError) else logging.WARNING
                log.log(level, "draft cannot serve this round (%s); it runs target-only", exc)
                view.keep(commit.cache_len)
                return None
            health = self._draft_health_for(session.session_id)
            recovered = health.degraded
            health.succeeded()
            if recovered and not self.draft_degraded:
                await self._report_draft_health(False)
            stats.bytes_to_draft += reply.bytes_sent
            stats.bytes_from_draft += reply.bytes_received
            view.after_call(canonical[:commit.cache_len] + list(commit.append_tokens), reply.tokens, reply.cache_len)
            return reply
        return None

    @property
    def draft_degraded(self) -> bool:
        """True while any draft replica is in backoff (reported as the health entry .../draft)."""
        return any(h.degraded for h in self.draft_health.values())

    def _draft_health_for(self, session_id: str) -> DraftHealth:
        return _bounded_entry(self.draft_health, self._replica(self.draft, "draft", session_id), DraftHealth)

    async def _report_draft_health(self, degraded: bool) -> None:
        if self.on_draft_health is not None:
            try:
                await self.on_draft_health(degraded)
            except Exception:  # noqa: BLE001 - health reporting must never fail a request
                log.exception("reporting draft health failed")

    async def _verify(self, session: OrchestratorSession, canonical: list[int], drafts: list[int],
                      q_payload: Any, sampling: SamplingConfig, deadline: Deadline, stats: GenerationStats):
        view: WorkerView = session.target_view
        retry_until = time.monotonic() + self.limits.target_retry_s
        backoff = 0.1
        reprefilled = False
        while True:
            commit = view.commit_for(canonical)
            try:
                reply = await self.target.verify(session.session_id, commit, drafts, q_payload, sampling,
                                                 deadline.remaining())
            except (SessionNotFound, CacheMismatch) as exc:
                if reprefilled:
                    raise
                log.info("target lost session %s (%s): re-prefilling", session.session_id, type(exc).__name__)
                stats.reprefills += 1
                self.observer.reprefill()
                reprefilled = True
                view.reset()
                continue
            except WorkerUnavailable as exc:
                # A restart comes back empty (then NOT_FOUND re-prefills); a blip keeps the cache.
                # Either way the committed prefix is the most the target can hold for us.
                view.keep(commit.cache_len)
                left = deadline.remaining()
                if time.monotonic() + backoff > retry_until or (left is not None and left <= backoff):
                    raise WorkerUnavailable(f"target worker unavailable for {self.limits.target_retry_s:.0f}s: {exc}") from exc
                await asyncio.sleep(backoff)
                backoff = min(1.0, backoff * 2)
                continue
            stats.bytes_to_target += reply.bytes_sent
            stats.bytes_from_target += reply.bytes_received
            if stats.rounds == 0:
                # What the target really reused of this turn's prompt (0 after a re-prefill).
                stats.cached_prompt_tokens = commit.cache_len
            view.after_call(canonical[:commit.cache_len] + list(commit.append_tokens), drafts, reply.cache_len)
            return reply
