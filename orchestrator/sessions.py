"""Orchestrator session state: the canonical tokens and what each worker is believed to hold."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from orchestrator.kpolicy import SessionStats
from specdec.contract import Commit, common_prefix_len, prefix_hash
from specdec.errors import CapacityExceeded, SessionBusy, SessionInputConflict, SessionNotFound

log = logging.getLogger(__name__)
BUSY_RETRY_AFTER_MS = 1000  # the retry hint when every session is busy: about one turn


@dataclass
class WorkerView:
    """Tokens the orchestrator believes a worker caches for a session (rebuildable at any time)."""
    tokens: list[int] = field(default_factory=list)

    def _keep(self, canonical: list[int]) -> int:
        # Keep at least one canonical token to feed: its logits predict the next token.
        return min(common_prefix_len(self.tokens, canonical), max(0, len(canonical) - 1))

    def appended_for(self, canonical: list[int]) -> int:
        """How many tokens commit_for(canonical) appends (without hashing the kept prefix)."""
        return len(canonical) - self._keep(canonical)

    def commit_for(self, canonical: list[int]) -> Commit:
        keep = self._keep(canonical)
        return Commit(cache_len=keep, prefix_hash=prefix_hash(canonical[:keep]),
                      append_tokens=tuple(canonical[keep:]))

    def after_call(self, sent_prefix: list[int], extra: list[int], cache_len: int) -> None:
        self.tokens = (sent_prefix + extra)[:cache_len]

    def reset(self) -> None:
        self.tokens = []

    def keep(self, length: int) -> None:
        """After a call whose outcome is unknown: the worker holds at least the first `length` tokens
        it held before (it applied the commit, applied part of it (a prompt cut off between prefill
        chunks), or did not run it); the next commit's prefix hash and crop handle any of the three."""
        del self.tokens[length:]


@dataclass
class OrchestratorSession:
    session_id: str
    ephemeral: bool
    tokens: list[int] = field(default_factory=list)          # canonical: prompt + generated, all turns
    messages: list[dict[str, str]] = field(default_factory=list)  # chat history, when chat is used
    # The draft holds a session in slots (pipelined rounds pre-draft on branch slots forked from the
    # session's cache); draft_slot is the one that holds the session's text, and a branch whose guess
    # came true becomes it.
    draft_views: dict[int, WorkerView] = field(default_factory=lambda: {0: WorkerView()})
    draft_slot: int = 0
    target_view: WorkerView = field(default_factory=WorkerView)
    stats: SessionStats = field(default_factory=SessionStats)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # The turn holding the lock has ended or been cancelled and is only cleaning up (settling its
    # pre-drafts): the session's next request waits for it rather than being refused as busy.
    ending: bool = False
    turns: int = 0  # turns begun: a request that waited while another one began a turn is busy
    # Its first turn failed, so it was dropped (a request waiting for it starts a new session).
    discarded: bool = False
    last_used: float = field(default_factory=time.monotonic)
    held_tokens: int = 0  # its tokens as counted against the token budget (at the end of its last turn)
    established: bool = False  # a named session whose first turn completed: counted against max_sessions

    async def begin_turn(self, wait_s: float) -> None:
        """Take the session for a turn (release: lock.release()). Refused as busy while another turn
        runs on it; one that has ended and is only cleaning up (a client that cancelled a stream
        and asked again at once) is waited for, up to wait_s."""
        busy = SessionBusy(f"session {self.session_id!r} is busy with another request; retry when it finishes")
        if self.lock.locked() and not self.ending:
            raise busy
        seen = self.turns
        try:
            async with asyncio.timeout(wait_s):
                await self.lock.acquire()
        except TimeoutError:
            raise busy from None
        if self.turns != seen:
            # Another request that waited too took the session first, and its turn has run since:
            # this one arrived while a turn was running, and is refused like any such request.
            self.lock.release()
            raise busy
        self.turns += 1
        self.ending = False

    @property
    def draft_view(self) -> WorkerView:
        return self.draft_views.setdefault(self.draft_slot, WorkerView())

    def check_input(self, chat: bool) -> None:
        """A session keeps one kind of input: a chat's history is re-rendered each turn and cannot
        carry raw text, and raw text after a chat would bypass its template."""
        if self.messages and not chat:
            raise SessionInputConflict(f"session {self.session_id!r} is a chat: continue it with messages")
        if chat and self.tokens and not self.messages:
            raise SessionInputConflict(f"session {self.session_id!r} holds a raw prompt: continue it with prompt "
                                       "or prompt_ids, or start a new session for a chat")


class OrchestratorSessions:
    """Bounded: at most max_sessions and max_tokens (LRU) and idle TTL; evicted sessions end on the
    workers too. The token budget bounds the memory: each context token costs about 50 bytes here
    (the canonical list and the workers' views), and 10,000 sessions of 8k tokens took 3.9 GiB.

    A session's history lives only here: the next turn on an evicted or expired id is refused once
    with NOT_FOUND (the id is remembered, up to TOMBSTONES of them), instead of quietly starting an
    empty session that answers from the new input alone. The turn after that starts afresh."""

    TOMBSTONES = 10_000

    def __init__(self, max_sessions: int, ttl_s: float,
                 on_evict: Callable[[OrchestratorSession], None],
                 clock: Callable[[], float] = time.monotonic, max_tokens: int | None = None) -> None:
        self.max_sessions = max_sessions
        self.max_tokens = max_tokens
        self.tokens = 0  # held_tokens over the sessions
        # Named sessions only: max_sessions bounds them. A stand-alone request's session lives for its
        # turn and admission bounds how many run; counted, it evicted a conversation at the limit.
        self.named = 0
        # ... of which the first turn completed: what eviction compares with max_sessions. A new one
        # still in its first turn (which may be refused) must not cost another's history, through its
        # own turn's end or through any other session's.
        self.established = 0
        self.ttl_s = ttl_s
        self._on_evict = on_evict
        self._clock = clock
        self._sessions: OrderedDict[str, OrchestratorSession] = OrderedDict()
        self._gone: OrderedDict[str, str] = OrderedDict()  # evicted or expired named sessions -> why

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str) -> OrchestratorSession | None:
        return self._sessions.get(session_id)

    def get_or_create(self, session_id: str, ephemeral: bool, new_stats: Callable[[], SessionStats],
                      must_exist: bool = False) -> OrchestratorSession:
        self._expire()
        session = self._sessions.get(session_id)
        if session is None:
            why = self._gone.pop(session_id, None)
            if why is not None:
                raise SessionNotFound(f"session {session_id!r} {why}, and its history with it; send the "
                                      "whole conversation again (this id now starts a new session)")
            if must_exist:
                raise SessionNotFound(f"session {session_id!r} is not held by this orchestrator (ended, "
                                      "expired, evicted, or lost with a restart); send the whole "
                                      "conversation again without resume_session")
            if not ephemeral and self.named >= self.max_sessions and not self._idle_named():
                raise CapacityExceeded(f"all {self.max_sessions} sessions are busy generating; retry later",
                                       BUSY_RETRY_AFTER_MS)
            session = OrchestratorSession(session_id, ephemeral, stats=new_stats())
            self._sessions[session_id] = session
            self.named += not ephemeral
            # Nothing is evicted for it yet: its first turn may still be refused (a prompt over the
            # context) or fail, and a conversation must not be lost for that. touch() makes room.
        session.last_used = self._clock()
        self._sessions.move_to_end(session_id)
        return session

    async def take(self, session_id: str, ephemeral: bool, new_stats: Callable[[], SessionStats],
                   wait_s: float, must_exist: bool = False) -> OrchestratorSession:
        """The session (made if new, unless must_exist), taken for a turn: SessionBusy while another
        turn runs on it."""
        while True:
            session = self.get_or_create(session_id, ephemeral, new_stats, must_exist)
            await session.begin_turn(wait_s)
            if self._sessions.get(session_id) is session:
                return session
            session.lock.release()
            if not session.discarded:  # an EndSession queued on the lock ended it while this one waited
                raise SessionNotFound(f"session {session_id!r} was ended; start a new one")

    def discard(self, session: OrchestratorSession) -> bool:
        """Drop a session without a trace (no tombstone): an ephemeral one after its turn, or one whose
        first turn failed. Whoever waits for it starts a new one. False if it was no longer here."""
        if self._sessions.get(session.session_id) is not session:
            return False
        self.remove(session.session_id)
        session.discarded = True
        return True

    def touch(self, session: OrchestratorSession) -> None:
        """A turn ended: its session's idle time starts now, not when the turn began, and it is the
        most recently used (eviction order; it was placed when its turn began)."""
        session.last_used = self._clock()
        if self._sessions.get(session.session_id) is session:
            self._sessions.move_to_end(session.session_id)
            self.tokens += len(session.tokens) - session.held_tokens
            session.held_tokens = len(session.tokens)
            if not session.ephemeral and not session.established:
                session.established = True
                self.established += 1
            self._enforce_limit(keep=session.session_id)
            self._enforce_tokens()

    def remove(self, session_id: str) -> OrchestratorSession | None:
        """The session ends (its id starts a new one next time, also after an eviction)."""
        self._gone.pop(session_id, None)
        return self._pop(session_id)

    def _pop(self, session_id: str) -> OrchestratorSession | None:
        session = self._sessions.pop(session_id, None)
        if session is not None:
            self.tokens -= session.held_tokens
            self.named -= not session.ephemeral
            self.established -= session.established
        return session

    def _expire(self) -> None:
        # In order of last use (get_or_create and touch move a session to the end): the expired ones
        # are at the front, so this stops at the first that is not (it scanned all 10,000 a request).
        now = self._clock()
        expired = []
        for sid, sess in self._sessions.items():
            if now - sess.last_used <= self.ttl_s:
                break
            if not sess.lock.locked():
                expired.append(sid)
        for sid in expired:
            self._evict(sid, f"expired after {self.ttl_s:g} s idle")

    def _idle_named(self) -> bool:
        """A named session not in a turn exists (one that a new session could take the place of)."""
        return any(not s.ephemeral and not s.lock.locked() for s in self._sessions.values())

    def _enforce_limit(self, keep: str) -> None:
        for sid in list(self._sessions):  # least recently used first; never one in a turn
            if self.established <= self.max_sessions:
                break
            sess = self._sessions[sid]
            if sid != keep and sess.established and not sess.lock.locked():
                self._evict(sid, f"was evicted (more than {self.max_sessions} sessions)")

    def _enforce_tokens(self) -> None:
        if self.max_tokens is None or self.tokens <= self.max_tokens:
            return
        for sid in list(self._sessions):  # least recently used first; never one in a turn
            if self.tokens <= self.max_tokens:
                break
            if not self._sessions[sid].lock.locked():
                self._evict(sid, f"was evicted (sessions held more than {self.max_tokens} tokens)")

    def _evict(self, session_id: str, why: str) -> None:
        session = self._pop(session_id)
        assert session is not None
        log.info("evicting orchestrator session %s: %s", session_id, why)
        if not session.ephemeral:
            self._gone[session_id] = why
            while len(self._gone) > self.TOMBSTONES:
                self._gone.popitem(last=False)
        self._on_evict(session)
