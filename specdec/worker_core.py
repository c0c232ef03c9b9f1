"""What draft and target workers share: session KV caches, commit application, validation.

No grpc here: the engines (draft_worker.engine, target_worker.engine) build on WorkerCore and the
shared servicer plumbing in specdec.worker_server maps protobuf <-> these dataclasses.

Over 300 lines: the session (tokens, cache, the draft's context keys) and every way it changes
(commits, forks, crops, batched forward steps) stay in one place, so that none misses one of them.
"""
from __future__ import annotations

import logging
from array import array
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.contract import (EMPTY_CONTEXT_KEY, MAX_BRANCH_SLOTS, CallStats, CallTimer, Commit, CostCurve,
                              common_prefix_len, extend_context_key, prefix_hash, session_of, slot_key,
                              validate_session_id)
from specdec.errors import CacheMismatch, CapacityExceeded, InvalidRequest, SessionNotFound, SpecdecError
from specdec.models import LoadedModel, cache_nbytes, copy_cache, crop_cache, estimate_kv_bytes_per_token, new_cache
from specdec.scheduler import out_of_memory
from specdec.session_store import SessionStore

log = logging.getLogger(__name__)

@dataclass
class WorkerSession:
    cache: Any
    tokens: list[int] = field(default_factory=list)
    # context_key of tokens[:i + 1] at i: filled on demand (the draft's draws, the target's when
    # sampling), cut with the tokens.
    prefix_keys: array = field(default_factory=lambda: array("Q"))
    # A copy the session has moved on from: a pre-draft's branch not (yet) taken, or the slot a taken
    # branch replaced. Evicted before live caches (begin_steps marks the slots of its session).
    stale: bool = False

    def context_key(self, length: int | None = None) -> int:
        """The key of the session's first `length` tokens (all: None), contract.extend_context_key
        chained over them: what its random draws are keyed by."""
        keys = self.prefix_keys
        key = keys[-1] if keys else EMPTY_CONTEXT_KEY
        for token in self.tokens[len(keys):]:
            key = extend_context_key(key, token)
            keys.append(key)
        if length is None or length == len(self.tokens):
            return key
        return keys[length - 1] if length > 0 else EMPTY_CONTEXT_KEY

    def nbytes(self) -> int:
        """The bytes its cache holds, with the rows that only the decode graph's buffer holds yet
        counted at the cache's own bytes per row: those land in the cache later, maybe while the
        session is idle (another session takes the buffer), where nothing measures it again."""
        held = cache_nbytes(self.cache)
        layers = getattr(self.cache, "layers", None) or []
        if any(getattr(layer, "is_sliding", False) for layer in layers):
            return held  # a sliding-window layer keeps a length of its own (and no decode graph runs them)
        keys = getattr(layers[0], "keys", None) if layers else None
        cached = 0 if keys is None else keys.shape[-2]
        pending = len(self.tokens) - cached
        return held + held * pending // cached if cached > 0 and pending > 0 else held


@dataclass
class ForwardStep:
    """One forward an engine call needs: feed `tokens` on top of the session's cache and get the
    float32 logits of the last `logits_rows` of them (0: all). The batch scheduler runs the steps of
    several calls as one forward (WorkerCore.feed_many)."""
    session: WorkerSession
    tokens: list[int]
    logits_rows: int = 0
    # Crop the session's cache to this many tokens right before the forward (-1: keep it). Done at
    # forward time, not at admission, so that a call cancelled while it waits leaves the cache as it
    # was: a commit is applied together with its forward or not at all.
    crop_to: int = -1

    def split(self, rows: int) -> tuple["ForwardStep", "ForwardStep"] | None:
        """A prefill chunk: the first `rows` tokens (at most those before the logits rows) as a step
        of their own, whose logits nobody reads, and the rest. The head carries the crop, so the two
        run in order feed exactly what the whole step would. None where no token can go first."""
        if self.logits_rows <= 0:
            return None  # every row's logits are wanted
        rows = min(rows, len(self.tokens) - self.logits_rows)
        if rows < 1:
            return None
        # One logits row (not zero, which would mean all of them): the LM head over one row is noise.
        head = ForwardStep(self.session, self.tokens[:rows], 1, self.crop_to)
        return head, ForwardStep(self.session, self.tokens[rows:], self.logits_rows)


# What an engine call is: a generator of forward steps that returns the call's result.
CallSteps = Generator[ForwardStep, torch.Tensor, Any]


@dataclass(frozen=True)
class StoreLimits:
    max_bytes: int = 2 << 30
    ttl_s: float = 600.0
    max_sessions: int = 10_000


@dataclass
class WorkerCounters:
    calls: int = 0
    fed_tokens: int = 0
    prefilled_tokens: int = 0
    session_misses: int = 0
    cache_mismatches: int = 0
    graph_steps: int = 0  # one-token steps taken by the decode graph (specdec.decode_graph)


class WorkerCore:
    def __init__(self, loaded: LoadedModel, role: str, limits: StoreLimits = StoreLimits()) -> None:
        self.loaded = loaded
        self.role = role
        self.model = loaded.model
        self.device = next(loaded.model.parameters()).device
        self.vocab_size = loaded.vocab_size
        self.max_context = loaded.max_context
        self.store: SessionStore[WorkerSession] = SessionStore(limits.max_bytes, limits.ttl_s,
                                                               limits.max_sessions)
        self.counters = WorkerCounters()
        # Set by startup calibration (specdec.calibration); reported in GetInfo.
        self.cost_curve = CostCurve()
        self.gemm_path = ""
        # One-token steps of a session alone replayed from a CUDA graph (enable_decode_graph).
        self.decode_graph: Any = None
        self.decode_path = "eager"
        # Up to this many sessions' one-token steps run one after the other on it rather than as one
        # eager forward (1: never; set where startup measured it pays).
        self.graph_batch_limit = 1
        # Estimated from the config so that even the first request is checked against the budget;
        # replaced by the measured value after the first forward.
        self._bytes_per_token = estimate_kv_bytes_per_token(loaded.model)
        self._measured_bytes = False
        # Several sessions per forward where the architecture allows (specdec.ragged); else each
        # step of a batch runs as its own forward.
        from specdec.ragged import RaggedForward, unsupported_reason
        self.ragged_unsupported = unsupported_reason(loaded.model)
        self._ragged = None if self.ragged_unsupported else RaggedForward(loaded.model)
        if self.ragged_unsupported:
            log.warning("%s worker: no cross-session batching (%s); batched calls run one forward each",
                        role, self.ragged_unsupported)

    @property
    def attention_path(self) -> str:
        """How batched forwards attend (specdec.ragged): "packed" or "per-session"; "" without batching."""
        return self._ragged.attention_path if self._ragged else ""

    # ------------------------------------------------------------------ validation
    def check_tokens(self, tokens: Sequence[int], what: str) -> None:
        for t in tokens:
            if not 0 <= t < self.vocab_size:
                raise InvalidRequest(f"{what} contains token id {t} outside the vocabulary [0, {self.vocab_size})")

    # ------------------------------------------------------------------ sessions
    def end_session(self, session_id: str) -> bool:  # with its branch slots
        return any([self.store.pop(slot_key(session_id, slot)) is not None for slot in range(MAX_BRANCH_SLOTS + 1)])

    def session_count(self) -> int:
        """Sessions held, however many slots each has (any thread)."""
        return len({session_of(key) for key in self.store.keys()})

    def _mark_live_slot(self, session_id: str, live: int) -> None:
        """The session's text is on slot `live` (the slot of a call that does not fork; the source of
        one that does): its other slots are stale copies. Eviction went by 'is a branch key', which
        after a taken branch evicted the live cache and kept the stale one on slot 0."""
        for slot in range(MAX_BRANCH_SLOTS + 1):
            session = self.store.peek(slot_key(session_id, slot))
            if session is not None:
                session.stale = slot != live

    def _stale(self, key: str) -> bool:
        session = self.store.peek(key)
        return session is not None and session.stale

    def session_tokens(self, session_id: str) -> list[int] | None:
        session = self.store.get(session_id)
        return list(session.tokens) if session else None

    def _checkout(self, session_id: str, commit: Commit) -> WorkerSession:
        """The session (a slot key) with its cache checked against the commit's prefix."""
        if commit.cache_len < 0:
            raise InvalidRequest("commit.cache_len must be >= 0")
        session = self.store.get(session_id)
        if commit.cache_len == 0:
            if session is None:
                session = self.empty_session()
                self.store.put(session_id, session)
            return session
        if session is None:
            self.counters.session_misses += 1
            raise SessionNotFound(f"session {session_id!r} is not held by this {self.role} worker "
                                  f"(expired, evicted or restarted); re-send the full prefix with cache_len=0")
        if len(session.tokens) < commit.cache_len or prefix_hash(session.tokens[:commit.cache_len]) != commit.prefix_hash:
            self.counters.cache_mismatches += 1
            raise CacheMismatch(f"session {session_id!r}: cache holds {len(session.tokens)} tokens that do not "
                                f"match the expected prefix of {commit.cache_len}; re-send with cache_len=0")
        return session

    def fork(self, session_id: str, source_slot: int, slot: int, commit: Commit, grow_by: int = 0) -> None:
        """Make `slot` a copy of `source_slot`'s first commit.cache_len tokens (checked like a commit),
        replacing what it held. On the model thread, between forwards: the source is never mid-forward.
        Refused before the copy where the branch could not grow by `grow_by` tokens past that."""
        # A fork of nothing needs no source: looked up, an absent one was created empty (and then
        # marked the live slot, the real branch a stale copy, first to be evicted). A negative
        # cache_len goes to _checkout, which refuses it.
        source = self._checkout(slot_key(session_id, source_slot), commit) if commit.cache_len else None
        # As begin_steps: the tokens fed must fit the context; the room reserved stops at it (a
        # call drafts no further than the context, so a branch near its end is no error).
        self._check_room(slot_key(session_id, slot), min(commit.cache_len + grow_by, self.max_context))
        if source is not None:
            # A failed write-back changes nothing (decode_graph.write_back): the source is left as it
            # was, not discarded, since a call of its own may be stepping it between forwards.
            self.sync(source, commit.cache_len)
        branch = (self.empty_session() if source is None else
                  WorkerSession(copy_cache(source.cache, commit.cache_len), list(source.tokens[:commit.cache_len]),
                                source.prefix_keys[:commit.cache_len]))
        key = slot_key(session_id, slot)
        self.store.put(key, branch)  # its room in the budget: the call's reservation (begin_steps)

    def empty_session(self) -> WorkerSession:
        return WorkerSession(cache=new_cache(self.model))

    def enable_decode_graph(self, capture: bool, max_len: int, smallest: int | None = None) -> None:
        """Take one-token steps of a session alone on static buffers (specdec.decode_graph), replayed
        from CUDA graphs where `capture`. Each buffer is checked against plain steps first, and so is a
        session moving from one to the next: where one cannot be built or does not agree, the worker
        stays on eager steps and says why (decode_path)."""
        from specdec.decode_graph import SMALLEST_BUFFER, DecodeGraphs, check_against_eager
        max_len = max(2, min(max_len, self.max_context))
        kind = "CUDA graph" if capture else "static buffer, not captured"
        try:
            graphs = DecodeGraphs(self.model, max_len, capture, smallest or SMALLEST_BUFFER)
            problem = None
            starts = [0] + [d.max_len for d in graphs.decoders[:-1]]
            checks = [(start + 12, start + 7) for start in starts]
            checks += [(start - 2, start - 3) for start in starts[1:]]  # sessions stepping across a boundary
            for prefixes in checks:
                if max(prefixes) + 4 < max_len and min(prefixes) > 0:
                    problem = check_against_eager(graphs, self.empty_session, self.vocab_size, prefixes=prefixes)
                    if problem:
                        problem = f"{problem} (sessions of {prefixes[0]} and {prefixes[1]} tokens)"
                        break
        except Exception as exc:  # noqa: BLE001 - any failure to build or capture: eager steps, said why
            log.exception("%s worker: decode graph failed", self.role)
            problem = f"{type(exc).__name__}: {str(exc)[:200]}"
        if problem:
            self.decode_path = f"eager ({kind} refused: {problem})"
            log.warning("%s worker: one-token steps stay eager: %s", self.role, problem)
            return
        self.decode_graph = graphs
        self.decode_path = f"{kind}, {graphs.describe()}"
        log.info("%s worker: one-token steps of a session alone: %s", self.role, self.decode_path)

    # ------------------------------------------------------------------ compute
    @torch.inference_mode()
    def feed(self, session: WorkerSession, tokens: Sequence[int], logits_rows: int = 0) -> torch.Tensor:
        """Run tokens through the model on top of the session cache, alone.

        Returns float32 logits of the last `logits_rows` fed positions (0: all), [rows, V], on the
        model's device: warping, drawing and the verify rule run where the logits are, and only
        ids and a few probabilities cross to the host. Asking for the rows that are used only also
        skips the LM head (a [V, hidden] GEMM) for the rest of a prefill.
        """
        if self.decode_graph is not None and len(tokens) == 1 and logits_rows in (0, 1):
            try:
                logits = self.decode_graph.step(session, tokens[0])
            except BaseException:
                self._discard(session)
                raise
            if logits is not None:
                self.counters.graph_steps += 1
                self._fed(session, tokens)
                return logits
        input_ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        self._sync_or_discard(session)
        try:
            out = self.model(input_ids=input_ids, past_key_values=session.cache, use_cache=True,
                             logits_to_keep=logits_rows)
        except BaseException:
            self._discard(session)
            raise
        self._fed(session, tokens)
        return out.logits[0].float()

    def feed_many(self, steps: Sequence[ForwardStep]) -> list[torch.Tensor | Exception]:
        """Run several sessions' steps as one ragged forward (one step, or no ragged support: alone;
        then a step's failure is its output, for its own call). Each session at most once."""
        for step in steps:
            if step.crop_to >= 0:
                self.truncate(step.session, step.crop_to)
        if len(steps) == 1:
            return [self.feed(steps[0].session, steps[0].tokens, steps[0].logits_rows)]
        # A few one-token steps cost less one after the other on the decode graph than as one eager
        # forward (measured at startup: calibration.retime_decode_steps).
        taking_turns = self.decode_graph is not None and len(steps) <= self.graph_batch_limit and all(
            len(s.tokens) == 1 and s.logits_rows in (0, 1) and len(s.session.tokens) < self.decode_graph.max_len
            for s in steps)
        if taking_turns or self._ragged is None:
            return [self._feed_or_error(s) for s in steps]
        from specdec.ragged import RaggedItem
        failed: dict[int, Exception] = {}
        for index, step in enumerate(steps):
            # One session's failed write-back (out of memory) is its own call's error: it changes
            # nothing (decode_graph.write_back), and the other sessions' caches are intact.
            try:
                self._sync_or_discard(step.session)
            except Exception as exc:  # noqa: BLE001 - handed to the step's own call by the scheduler
                log.warning("writing back a session's buffered rows failed; only its call fails: %s", exc)
                failed[index] = exc
        running = [step for index, step in enumerate(steps) if index not in failed]
        try:
            results = iter(self._ragged([RaggedItem(s.session.cache, s.tokens, s.logits_rows) for s in running])
                           if running else [])
        except BaseException:
            for step in running:
                self._discard(step.session)
            raise
        for step in running:
            self._fed(step.session, step.tokens)
        return [failed[index] if index in failed else next(results) for index in range(len(steps))]

    def _feed_or_error(self, step: ForwardStep) -> torch.Tensor | Exception:
        try:
            return self.feed(step.session, step.tokens, step.logits_rows)
        except Exception as exc:  # noqa: BLE001 - handed to the step's own call by the scheduler
            log.exception("forward of one step failed")
            return exc

    def sync(self, session: WorkerSession, upto: int | None = None) -> None:
        """The session's own cache holds the rows of its first `upto` tokens (all: None): those only
        the decode graph's buffer held are written back (specdec.decode_graph). Before anything but
        a decode-graph step reads or copies the cache."""
        if self.decode_graph is not None:
            self.decode_graph.write_back(session, upto)

    def _sync_or_discard(self, session: WorkerSession) -> None:
        """sync() before a forward. Out of memory, a write-back changes nothing (decode_graph.write_back):
        the session stays as it was, its rows still in the buffer, and only its call fails, with no
        re-prefill for it. Any other failure is a broken invariant: the session is discarded (its next
        commit re-prefills) rather than failing every call until its TTL."""
        try:
            self.sync(session)
        except BaseException as exc:
            if not out_of_memory(exc):
                self._discard(session)
            raise

    def _discard(self, session: WorkerSession) -> None:
        # Some layers may have appended to the cache before a failure: nothing in it can be trusted.
        # An empty session makes the next commit fail its check and re-prefill.
        if self.decode_graph is not None:
            self.decode_graph.discard(session)
        session.cache = new_cache(self.model)
        session.tokens.clear()
        del session.prefix_keys[:]

    def budget_tokens(self) -> int:
        """The most tokens one session's cache can hold in the whole KV budget (bytes per token as
        estimated from the model config until measured)."""
        return self.store.max_bytes // max(1, self._bytes_per_token)

    def _fed(self, session: WorkerSession, tokens: Sequence[int]) -> None:
        session.tokens.extend(tokens)
        self.counters.fed_tokens += len(tokens)
        if not self._measured_bytes and session.tokens and session.nbytes():
            self._bytes_per_token = max(1, session.nbytes() // len(session.tokens))
            self._measured_bytes = True

    def truncate(self, session: WorkerSession, length: int) -> None:
        # Rows past `length` that only the decode graph's buffer holds are dropped with the tokens;
        # crop_cache leaves a cache shorter than `length` as it is (the buffer holds the rest).
        if length < len(session.tokens):
            if length == 0:
                session.cache = new_cache(self.model)
            else:
                crop_cache(session.cache, length)
            del session.tokens[length:]
            del session.prefix_keys[length:]

    def begin_steps(self, session_id: str, commit: Commit, extra_tokens: Sequence[int], stats: CallStats,
                    slot: int = 0, fork_from: int | None = None, grow_by: int = 0,
                    ) -> Generator[ForwardStep, torch.Tensor, tuple[WorkerSession, torch.Tensor]]:
        """Apply a commit, then feed `extra_tokens` after it in the same forward step.

        Returns the session and the logits of the last len(extra_tokens) + 1 fed positions (those
        that predict the first extra token onwards), on the model's device. At least one committed
        token is always fed, because the logits of the last committed token predict the next one.

        The call runs on `slot` of the session (0: its own cache; a branch slot otherwise), which
        fork_from, if given, first makes a copy of that slot's committed prefix (fork). The slot
        stays pinned (never evicted) until the caller calls release(session_id, slot), since other
        calls' steps run between this call's steps, with room in the byte budget reserved for
        grow_by more tokens (fed by the caller's later steps: the draft's drafts).
        """
        validate_session_id(session_id)
        if not 0 <= slot <= MAX_BRANCH_SLOTS or not (fork_from is None or 0 <= fork_from <= MAX_BRANCH_SLOTS):
            raise InvalidRequest(f"slot and fork_from must be in [0, {MAX_BRANCH_SLOTS}], got {slot} and {fork_from}")
        if fork_from == slot:
            raise InvalidRequest(f"a slot cannot be forked from itself (slot {slot})")
        # The sequence this call feeds (what is held past cache_len moves from the feed to the kept
        # part below, and an empty feed re-feeds one kept token: the sum stays this). Checked before
        # the per-token checks: an oversized commit was scanned token by token first.
        total = commit.cache_len + len(commit.append_tokens) + len(extra_tokens)
        if total > self.max_context:
            raise InvalidRequest(f"sequence of {total} tokens exceeds the model context of {self.max_context}")
        # Room for the drafts stops where the whole budget does: a draft near it drafts fewer tokens
        # (DraftEngine clamps k the same way), rather than its call being refused INVALID_ARGUMENT.
        grow_by = max(0, min(grow_by, self.budget_tokens() - total))
        self.check_tokens(commit.append_tokens, "commit.append_tokens")
        self.check_tokens(extra_tokens, "tokens")
        if fork_from is not None:
            self.fork(session_id, fork_from, slot, commit, len(commit.append_tokens) + len(extra_tokens) + grow_by)
        source_held = fork_from is not None and self.store.peek(slot_key(session_id, fork_from)) is not None
        live_slot = fork_from if source_held else slot
        base_id, session_id = session_id, slot_key(session_id, slot)
        session = self._checkout(session_id, commit)
        created = not session.tokens
        # Only once the slot is there: a call on an evicted branch fails NOT_FOUND without marking
        # the live cache a stale copy (first to be evicted).
        self._mark_live_slot(base_id, live_slot)
        feed_tokens = list(commit.append_tokens)
        keep = commit.cache_len
        # What the cache already holds past cache_len of the appended tokens is kept, not fed again:
        # a call that timed out or was cancelled after its forwards leaves its caller unsure how far
        # it got (a long prefill resent from cache_len 0 would start over every time), and drafts
        # the target then accepted are held already. Compared token by token: the same prefix.
        held = common_prefix_len(session.tokens[keep:keep + len(feed_tokens)], feed_tokens)
        keep, feed_tokens = keep + held, feed_tokens[held:]
        try:
            if not feed_tokens:
                if keep == 0:
                    raise InvalidRequest("nothing to condition on: commit has cache_len=0 and no append_tokens")
                keep -= 1
                feed_tokens = [session.tokens[keep]]
            self._reserve(session_id, min(total + grow_by, self.max_context))
        except SpecdecError:
            if created or fork_from is not None:  # created for this call: not kept for a refusal
                self.store.pop(session_id)
            raise
        try:
            stats.prefilled_tokens = len(commit.append_tokens) - held
            self.counters.prefilled_tokens += stats.prefilled_tokens
            logits = yield ForwardStep(session, feed_tokens + list(extra_tokens), len(extra_tokens) + 1,
                                       crop_to=keep)
        except BaseException:
            self.store.unpin(session_id)
            if created and not session.tokens:  # created for this call and never fed: not kept
                self.store.pop(session_id)
            raise
        stats.fed_tokens += len(feed_tokens) + len(extra_tokens)
        return session, logits

    def release(self, session_id: str, slot: int = 0) -> None:
        """End of the call that begin_steps pinned the session's slot for."""
        self.store.unpin(slot_key(session_id, slot))

    def run_alone(self, steps: CallSteps) -> Any:
        """Run a call's steps, each as its own forward (no scheduler: tools, tests)."""
        from specdec.sampling import drive
        return drive(steps, lambda step: self.feed_many([step])[0])

    def _reserve(self, session_id: str, total_tokens: int) -> None:
        """Pin the session (release() unpins) with room in the byte budget for it to grow to
        total_tokens, evicting LRU idle others. Refused before evicting anything where the sessions in
        use leave no such room (CapacityExceeded: evictions would not make it fit), or where the
        whole budget could not hold it (InvalidRequest)."""
        needed = self._check_room(session_id, total_tokens)
        self.store.pin(session_id, reserve_bytes=needed)
        if needed:
            self.store.enforce_budget(first=self._stale)  # stale copies first

    def _check_room(self, session_id: str, total_tokens: int) -> int:
        """The bytes `total_tokens` of the session take; raises where they cannot be had (see _reserve)."""
        needed = total_tokens * self._bytes_per_token
        if needed > self.store.max_bytes:  # not even an empty worker could: no point retrying
            raise InvalidRequest(f"{total_tokens} tokens for session {session_id!r} exceed the {self.role} worker's "
                                 f"whole KV budget of {self.store.max_bytes} bytes")
        if needed and not self.store.fits(needed, exclude=session_id):
            raise CapacityExceeded(
                f"{self.role} worker KV budget of {self.store.max_bytes} bytes cannot hold "
                f"{total_tokens} tokens for session {session_id!r} next to the sessions in use")
        return needed

    def timed(self) -> CallTimer:
        self.counters.calls += 1
        return CallTimer()

