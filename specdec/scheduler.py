"""Per-worker batch scheduler: many calls, one model thread, one forward per step (no grpc, no torch).

Every worker call is a generator of forward steps (see specdec.worker_core.ForwardStep): it yields
the tokens it needs run through the model, receives their logits, and returns its result. The
scheduler owns the model thread. Each iteration it admits waiting calls, collects the pending step of
every active call and runs them as ONE forward (`forward(steps) -> outputs`), then resumes each call
with its output. A call with several steps (a draft proposing k tokens) stays in the batch step by
step while other calls join and leave: continuous batching.

Rules:
- Bounded: at most `max_batch` calls active, at most `max_queue` waiting; past that, submit() raises
  QueueFull (RESOURCE_EXHAUSTED) with a retry hint: when the soonest active call should end, from
  its forwards left and the measured forward time (0: no waiting room; an EndSession, which takes no
  slot, is never refused).
- Fair: calls are admitted first come first served, and inside the active set the step that has
  waited longest goes first; a step left out by the token cap is the oldest next time, so none starves.
  While a prompt waits, decode steps leave it MIN_PROMPT_CHUNK rows of the cap.
  A single step over `max_batch_tokens` (a long prefill) runs alone when its turn comes.
- Chunked prefill: while other calls share the forward, the prompts in it (steps longer than a
  decode step) get at most `prefill_chunk` rows between them; a longer prompt runs in chunks over
  the next forwards, so that prompts arriving never stall the others' decode steps for long. A
  step alone runs whole. With a measured cost curve (`prefill_curve`) the budget grows with the
  decode rows beside it past max_batch (the most rows that at most double their forward): beside
  the k + 1 rows of many sessions' verifies a fixed budget would spread each prompt over many slow
  forwards, and the first tokens of speculating sessions would come late.
- One call per session at a time: a second call on a session waits until the first ends (the cache
  is the session's state), in arrival order. A draft's branch slots are calls of their own, but an
  EndSession (every slot) waits for the calls on all of them, and later calls on any wait for it.
- Failures: a forward that runs out of memory fails its calls with CapacityExceeded (load, not a
  bug); any other error as it is. If the model thread itself fails (a bug outside every call), all
  calls and every later submit fail UNAVAILABLE, and `on_failure` tells the server.
- Deadlines and cancellation are checked before admission and before every step: an expired call
  stops without spending a forward, and its generator is closed so its cleanup runs.
- A short window (`window_ms`) lets calls that are due (sessions that just finished a call and
  usually come back about now; a new session as the others usually do) join the next forward, so
  that streams in step share forwards instead of alternating. It is never waited when nobody is
  expected, so a single stream pays nothing.
- Shared compute (`shared_compute`: the draft and the target on the same cores): the window is a
  whole forward's time. While this worker waits, the other one computes on the same cores, so the
  wait costs little, and a forward that takes the sessions still drafting along saves one forward's
  fixed cost (on a CPU, streaming the weights). The sessions then run in step, all drafting, then
  all verifying (gang scheduling), instead of splitting into groups whose forwards alternate and
  each pay the fixed cost, and whose draft and verify contend for the cores. On separate devices
  this stays off: there two groups alternating keep both devices busy.

Over 300 lines: admission, fairness, deadlines and the load figures all read the same active and
waiting sets under one lock; split apart, each would need its own view of them.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Generator, Iterable, Iterator, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from specdec import curves
from specdec.contract import session_of
from specdec.errors import CapacityExceeded, DeadlineExceeded, WorkerUnavailable

log = logging.getLogger(__name__)

Steps = Generator[Any, Any, Any]

# A step of at most this many rows is a decode step (a verify of up to 32 drafts, the most a request
# may ask for, or a draft's catch-up): never chunked, and not counted in a forward's prompt budget.
DECODE_STEP_ROWS = 33
# The fewest prompt rows a shared forward carries while prompts wait: below this a prompt crawls.
MIN_PROMPT_CHUNK = 16
# EndSessions may wait beyond max_queue (they free memory), up to this many more calls in all.
MAX_WAITING_ENDS = 1024


_DROPPED, _ADMITTED, _WAITS = "dropped", "admitted", "waits"  # where admission places a waiting call


# A CPU allocation failure is a plain RuntimeError from torch's allocator (or Python's MemoryError);
# matched by message, so that this module needs no torch.
_OOM_MESSAGES = ("can't allocate memory", "not enough memory", "defaultcpuallocator", "out of memory")
# CUDA errors that leave the process's device context unusable (sticky): every later forward would
# fail the same way, so the worker must be restarted, not keep answering INTERNAL. By the CUDA error
# code where the exception carries one, else by the message's first line ("CUDA error: ..."): torch
# appends to every CUDA error a note on device-side assertion tracking, which must not match.
_STICKY_CUDA_ERRORS = frozenset({214, 700, 710, 714, 715, 716, 717, 718, 719})  # ECC, illegal address, assert, ...
_DEVICE_LOST_MESSAGES = ("illegal memory access", "device-side assert triggered", "illegal instruction",
                         "unspecified launch failure", "misaligned address", "uncorrectable ecc",
                         "hardware stack error")


def out_of_memory(exc: BaseException) -> bool:
    """Whether a forward's error is the device running out of memory: torch.OutOfMemoryError (CUDA's,
    torch.cuda.OutOfMemoryError is the same class), matched by name, or a CPU allocation failure."""
    if any(cls.__name__ == "OutOfMemoryError" for cls in type(exc).__mro__) or isinstance(exc, MemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _OOM_MESSAGES)


def device_lost(exc: BaseException) -> bool:
    """Whether an error means the device is lost to this process (a sticky CUDA error)."""
    if out_of_memory(exc):
        return False
    code = getattr(exc, "error_code", None)
    if isinstance(code, int):
        return code in _STICKY_CUDA_ERRORS
    first_line = (str(exc).splitlines() or [""])[0].lower()
    return "cuda error" in first_line and any(m in first_line for m in _DEVICE_LOST_MESSAGES)


class DeviceLost(RuntimeError):
    """A forward failed in a way that leaves the device unusable: the model thread stops (_die)."""


def _no_steps() -> Steps:
    raise AssertionError("a call only counted for the queue is never run")


class QueueFull(CapacityExceeded):
    """The worker's queue is full (with the retry hint CapacityExceeded carries)."""


@dataclass(frozen=True)
class BatchLimits:
    max_batch: int = 8            # calls (sessions) sharing one forward; 1 = one call at a time
    max_batch_tokens: int = 256   # token rows per forward
    window_ms: float = 20.0       # cap on waiting for due calls to join a forward (also <= 10% of a forward)
    max_queue: int = 64           # calls waiting for a slot; more get RESOURCE_EXHAUSTED
    prefill_chunk: int = 64       # prompt rows per forward while other calls share it; 0 = whole prompts
    shared_compute: bool = False  # the other worker of the pair runs on these cores: wait up to a forward for due calls
    # (rows, ms) forward costs (`--prefill-chunk auto`): each forward's prompt budget is then sized
    # against the decode rows it actually runs (prefill_chunk_for), prefill_chunk where it cannot tell.
    prefill_curve: tuple[tuple[int, float], ...] = ()
    # With a curve: > 0 sizes each forward's prompt budget so that each decode step's stream cycles
    # at most this many times as slowly as alone (its step and its gap between calls: an inter-token
    # latency bound, itl_limit_ms), and every prompt row counts, the short rests of chunked prompts
    # too. 0: the budget above.
    prefill_itl_factor: float = 0.0
    # The ITL bound also lets a forward take (factor - 1) x each session's gap between calls: on the
    # target, where a speculating session's gap is its drafting. Not on the draft as well: two
    # workers each relaxed by the other's time would let a stream's cycle grow (2 factor - 1)-fold.
    itl_gap_relief: bool = False

    def validate(self) -> None:
        if (self.max_batch < 1 or self.max_batch_tokens < 1 or self.max_queue < 0 or self.window_ms < 0
                or self.prefill_chunk < 0 or not itl_factor_valid(self.prefill_itl_factor)):
            raise ValueError(f"invalid batch limits {self}")


def prefill_chunk_for(curve: Sequence[tuple[int, float]], decode_rows: int, cap: int) -> int | None:
    """A worker's own prompt budget per shared forward, from its measured (rows, ms) forward costs:
    the largest of 16, 32, 64, ... (up to cap, at least 16) rows whose forward, next to `decode_rows` decode rows,
    costs at most twice the decode rows' alone. A prompt then at most doubles the other streams' step:
    a few rows on a CPU whose forward grows with its rows, hundreds on a GPU where it is flat. Past
    the largest measured count the last segment's slope extends the curve. None where the curve does
    not reach 16 rows (nothing measured to choose from)."""
    points = sorted(curve)
    if len(points) < 2 or points[-1][0] < 16:
        return None
    limit = 2.0 * curves.extended(points, decode_rows)
    chunk = 16
    while chunk * 2 <= cap and curves.extended(points, decode_rows + chunk * 2) <= limit:
        chunk *= 2
    return chunk


def itl_factor_valid(factor: float) -> bool:
    """An ITL bound is off (0) or at least 1: below 1 no prompt row would fit beside any decode step."""
    return factor == 0 or factor >= 1


def itl_limit_ms(curve: Sequence[tuple[int, float]], step_rows: int, factor: float,
                 gap_ms_per_step: float = 0.0) -> float:
    """What a forward beside a decode step of `step_rows` rows may cost under an inter-token latency
    bound of `factor`: the stream's cycle alone is its forward plus its gap between calls (the other
    worker's time, the RPCs), and with prompt rows beside it that cycle may grow to `factor` times, so
    the forward may cost factor x its cost alone plus (factor - 1) x the gap, spread over the call's
    steps. A target-only session's gap is a few ms; a speculating one's includes its drafting."""
    return factor * (curves.extended(sorted(curve), step_rows) or 0.0) + (factor - 1.0) * max(0.0, gap_ms_per_step)


def prefill_chunk_within(curve: Sequence[tuple[int, float]], decode_rows: int, limit_ms: float, cap: int) -> int:
    """Prompt rows for a forward beside `decode_rows` decode rows such that the forward costs at most
    `limit_ms` (`itl_limit_ms`). Multiples of 8 from 16; 16 where even that breaks the bound (the
    decode rows alone do, or a forward of 16 more rows does), so that prompts always make progress.
    A bound on inter-token latency under load, paid for in first-token latency: a prompt takes more
    forwards."""
    points = sorted(curve)
    chunk = MIN_PROMPT_CHUNK
    while (decode_rows + chunk + 8 <= cap
           and (curves.extended(points, decode_rows + chunk + 8) or float("inf")) <= limit_ms):
        chunk += 8
    return chunk


class _Return(NamedTuple):
    """A session whose last call ended: when, the EWMA of its gap until its next call (0 before one
    was seen), and how many forwards that call took part in (the ITL bound spreads the gap over them)."""
    ended: float
    gap: float
    steps: int = 1


def _slots_taken(jobs: Iterable[_Job]) -> int:
    """Batch slots these calls hold: an EndSession runs no forward and holds none."""
    return sum(not job.ends_session for job in jobs)


@dataclass
class CallLoad:
    """What the batching did to one call (reported in its WorkerTiming)."""
    queue_ms: float = 0.0
    forwards: int = 0
    batch_sessions: int = 0   # summed over the call's forwards
    batch_rows: int = 0       # summed over the call's forwards
    # Of those rows, the prompt rows (prefill steps and their chunks), summed over the call's forwards:
    # what a steady call's time owes to the prompts it shared forwards with.
    batch_prompt_rows: int = 0

    @property
    def mean_batch(self) -> float:
        return self.batch_sessions / self.forwards if self.forwards else 1.0

    @property
    def mean_rows(self) -> float:
        return self.batch_rows / self.forwards if self.forwards else 0.0

    @property
    def mean_prompt_rows(self) -> float:
        return self.batch_prompt_rows / self.forwards if self.forwards else 0.0


@dataclass
class LoadSnapshot:
    """The worker's load right now: the k policy lowers k as it grows."""
    utilisation: float = 0.0      # busy fraction of the model thread over the last few seconds
    active: int = 0
    waiting: int = 0              # calls beyond the free slots: true queueing, the saturation signal
    mean_batch: float = 0.0       # sessions per forward, recent mean


@dataclass
class _Job:
    session_id: str
    make_steps: Callable[[], Steps]
    deadline: float | None
    submitted: float
    future: Future = field(default_factory=Future)
    load: CallLoad = field(default_factory=CallLoad)
    steps: Steps | None = None
    pending: Any = None
    pending_since: float = 0.0
    chunked: bool = False  # its pending step is the rest of a prompt split by chunked prefill
    ends_session: bool = False


class BatchScheduler:
    def __init__(self, forward: Callable[[list[Any]], Sequence[Any]], limits: BatchLimits = BatchLimits(),
                 name: str = "model", clock: Callable[[], float] = time.monotonic,
                 utilisation_window_s: float = 5.0) -> None:
        limits.validate()
        self.limits = limits
        self._name = name
        self._forward = forward
        self._clock = clock
        self._pass_since: float | None = None  # when the model thread's current pass began (pass_running_s)
        self._pass_rows = 0  # rows of that pass's forward (0: none yet)
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Job] = collections.deque()
        self._active: list[_Job] = []
        self._closed = False
        # Sessions whose last call ended recently.
        self._returns: dict[str, _Return] = {}
        self._recent_gaps: collections.deque[float] = collections.deque(maxlen=64)  # any session's
        self._recent_steps: collections.deque[int] = collections.deque(maxlen=64)  # forwards per call (retry hints)
        self._busy: collections.deque[tuple[float, float]] = collections.deque()
        self._util_window_s = utilisation_window_s
        self._started = clock()
        self._step_s = 0.0  # EWMA of one forward's duration (retry hints)
        self._batch_ewma = 0.0
        # Counters for metrics.
        self.forwards = 0
        self.batched_sessions = 0
        self.rejected = 0
        self.expired = 0
        self.prefill_chunks = 0  # forwards that ran part of a call's step (chunked prefill)
        # Set once the model thread has failed (_die): why later calls are refused.
        self._failure: str | None = None
        self._on_failure: Callable[[BaseException], None] | None = None
        self._thread = threading.Thread(target=self._run, name=f"{name}-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ API (any thread)
    def submit(self, session_id: str, make_steps: Callable[[], Steps],
               timeout_s: float | None = None, ends_session: bool = False) -> tuple[Future, CallLoad]:
        """Queue a call; make_steps() is called on the model thread when the call is admitted. The
        CallLoad fills in as the call runs (read it once the future is done). ends_session: the
        session will not come back (EndSession), so no forward waits for it, and the call (which runs
        no forward) takes no batch slot."""
        now = self._clock()
        with self._cond:
            if self._closed:
                raise WorkerUnavailable(self._failure or "worker is shutting down")
            # Calls cancelled or past their deadline leave the queue now, not at the next admission:
            # during a long forward (a CPU prefill) they piled up uncounted, and every submit
            # scanned them all (5,000 calls with short deadlines took 8 s to submit).
            dropped = self._take_dropped(now)
            # Refused only if this call would itself wait beyond the free slots past max_queue (0: no
            # waiting room, yet an idle worker still takes a call). An EndSession takes no slot and
            # frees memory: not refused for load, unless the calls waiting pass a hard bound.
            queued = 0 if ends_session else self._queued(joining=session_id)
            if ends_session and len(self._waiting) >= self.limits.max_queue + self.limits.max_batch + MAX_WAITING_ENDS:
                queued = self.limits.max_queue + 1
            if queued > self.limits.max_queue:
                self.rejected += 1
                retry_ms = self._retry_after_ms(over=queued - self.limits.max_queue)
                raise QueueFull(f"worker busy: {len(self._active)} calls in the batch and {len(self._waiting)} "
                                f"waiting (max_queue {self.limits.max_queue}); retry after ~{retry_ms} ms",
                                retry_ms)
            job = _Job(session_id, make_steps, None if timeout_s is None else now + timeout_s, now,
                       ends_session=ends_session)
            self._waiting.append(job)
            self._cond.notify_all()
        for gone in dropped:
            self._end_unstarted(gone)
        return job.future, job.load

    def _take_dropped(self, now: float) -> list[_Job]:
        """The waiting calls cancelled or past their deadline, taken out of the queue (lock held)."""
        dropped = [job for job in self._waiting if self._given_up(job, now)]
        if dropped:
            gone = set(map(id, dropped))
            self._waiting = collections.deque(job for job in self._waiting if id(job) not in gone)
        return dropped

    @staticmethod
    def _given_up(job: _Job, now: float) -> bool:
        """Its caller cancelled it, or its deadline has passed."""
        return job.future.cancelled() or (job.deadline is not None and now >= job.deadline)

    def _end_unstarted(self, job: _Job) -> None:
        """A call given up before it started: retired if cancelled, else failed DEADLINE_EXCEEDED.
        From the model thread (admission) or a submitting thread (submit drops them early)."""
        if job.future.cancelled():
            self._retire(job)
            return
        with self._cond:
            self.expired += 1
        self._fail(job, DeadlineExceeded("deadline expired while the call waited for the model"))

    def snapshot(self) -> LoadSnapshot:
        with self._cond:
            return LoadSnapshot(self._utilisation(self._clock()), len(self._active), self._queued(),
                                self._batch_ewma)

    @property
    def waiting_calls(self) -> int:
        """Calls submitted and not yet admitted to the batch (they join the next forward with a free slot)."""
        with self._cond:
            return len(self._waiting)

    def _queued(self, joining: str | None = None) -> int:
        """Calls that the next forward cannot take (lock held), with a call of session `joining`
        arriving: those _placements leaves waiting. An EndSession takes no slot; a call that
        arrived during a forward and joins the next one is not queued."""
        arriving = [] if joining is None else [_Job(joining, _no_steps, None, self._clock())]
        return sum(place == _WAITS and not job.ends_session
                   for job, place in self._placements([*self._waiting, *arriving]))

    def _placements(self, jobs: Iterable[_Job]) -> Iterator[tuple[_Job, str]]:
        """Where each of these waiting calls goes at the next admission, in arrival order (lock
        held): dropped (cancelled, or past its deadline), admitted (first come first served into the
        free slots, one active call per session; an EndSession runs no forward and takes no slot) or
        left waiting (its session's later calls, an EndSession too, wait behind it).

        Calls are keyed by slot (contract.slot_key: a draft's branch slots run beside its slot 0), but
        an EndSession ends every slot: it waits for the calls on all of them, and they for it. Else it
        ran beside a branch call, freed its pinned cache, and that call (or one queued with
        cache_len=0) left an orphan slot, held until its TTL."""
        busy = {job.session_id for job in self._active}  # slot keys with a call before this one
        sessions = {session_of(key) for key in busy}      # ... and their sessions
        ending = {job.session_id for job in self._active if job.ends_session}  # (an EndSession's key is the session)
        taken = _slots_taken(self._active)
        now = self._clock()
        for job in jobs:
            if self._given_up(job, now):
                yield job, _DROPPED
                continue
            session = session_of(job.session_id)
            if job.ends_session:
                admitted = session not in sessions
                ending.add(session)
            else:
                admitted = taken < self.limits.max_batch and job.session_id not in busy and session not in ending
            taken += admitted and not job.ends_session
            busy.add(job.session_id)
            sessions.add(session)
            yield job, _ADMITTED if admitted else _WAITS

    def pass_running_s(self) -> tuple[float, float]:
        """(how long the model thread's current pass has run, 0 when idle; what its forward is
        expected to take on the prefill curve, 0 where unknown), from any thread. A forward that
        never returns (a hung kernel or device) fails no call and kills no thread: only this shows it."""
        since, rows = self._pass_since, self._pass_rows
        if since is None:
            return 0.0, 0.0
        expected_ms = curves.extended(self.limits.prefill_curve, rows) if rows and self.limits.prefill_curve else None
        return max(0.0, self._clock() - since), (expected_ms or 0.0) / 1000.0

    def mark_hung(self, reason: str) -> None:
        """The watchdog found the model thread stuck: fail the calls waiting behind it and refuse new
        ones (UNAVAILABLE: the orchestrator passes the replica over) until the worker restarts. The
        calls in the stuck pass stay with it (their callers' deadlines end them)."""
        self._refuse_calls(f"the model thread of {self._name} is stuck ({reason}); restart the worker",
                           active_too=False)

    def _refuse_calls(self, failure: str, active_too: bool) -> Callable[[BaseException], None] | None:
        """Close for good: every later submit fails UNAVAILABLE with `failure`, and so do the calls
        waiting now (and the active ones, where `active_too`). Returns the on_failure callback."""
        with self._cond:
            self._closed = True
            self._failure = failure
            jobs = list(self._waiting) + (self._active if active_too else [])
            self._waiting.clear()
            if active_too:
                self._active.clear()
            callback = self._on_failure
            self._cond.notify_all()
        for job in jobs:
            try:
                self._abort(job, WorkerUnavailable(failure))
            except BaseException:  # noqa: BLE001 - fail the others still
                log.exception("failing a call of a model thread that failed or got stuck")
        return callback

    def on_failure(self, callback: Callable[[BaseException], None]) -> None:
        """Call `callback(exc)` if the model thread fails (on that thread; at once if it has): the
        server flips its health to NOT_SERVING. A hook, so that no grpc is imported here."""
        with self._cond:
            self._on_failure = callback
            failure = self._failure
        if failure is not None:
            callback(RuntimeError(failure))

    def close(self, timeout_s: float = 5.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    # ------------------------------------------------------------------ model thread
    def _run(self) -> None:
        try:
            leftover = self._loop()
        except BaseException as exc:  # noqa: BLE001 - a bug outside any one call's own try blocks
            self._die(exc)
            return
        for job in leftover:
            self._abort(job, WorkerUnavailable("worker is shutting down"))

    def _loop(self) -> list[_Job]:
        """Admit, select, forward, until closed; returns the calls left then."""
        while True:
            with self._cond:
                while not self._closed and not self._waiting and not self._active:
                    self._cond.wait()
                if not self._closed:
                    self._wait_for_due_calls()
                if self._closed:  # (also while waiting for due calls: no call admitted, no forward run)
                    leftover = list(self._waiting) + self._active
                    self._waiting.clear()
                    self._active.clear()
                    return leftover
                admitted = self._admit()
            # A pass: starting the admitted calls, one forward, resuming its calls. On a GPU the
            # forward only queues kernels: a hung one blocks where a call's step reads its results.
            self._pass_since = self._clock()
            try:
                self._pass(admitted)
            finally:
                self._pass_since, self._pass_rows = None, 0

    def _pass(self, admitted: list[_Job]) -> None:
        for i, job in enumerate(admitted):
            try:
                self._start(job)
            except BaseException:
                # The device lost: _die fails the waiting and active calls, not the admitted
                # ones dropped (cancelled or expired) that had yet to be ended here.
                active = set(map(id, self._active))
                for dropped in admitted[i + 1:]:
                    if id(dropped) not in active:
                        self._end_unstarted(dropped)
                raise
        self._drop_expired()
        batch = self._select()
        if batch:
            self._step(batch)

    def _die(self, exc: BaseException) -> None:
        """The model thread failed outside every call's own error handling (a bug in admission or
        selection), or the device was lost (DeviceLost: a sticky CUDA error, in a forward or in a
        call's own steps). Without this the thread died silently and submit() kept taking calls whose futures
        never resolved (a Verify then hung for the orchestrator's whole --target-timeout-s). Now every
        call fails at once and so does every later submit, and the worker's health goes NOT_SERVING
        (on_failure). UNAVAILABLE, not INTERNAL: the cause is a bug (logged here with its traceback),
        but what callers must act on is that this worker serves nothing more until restarted. The
        orchestrator passes over a replica that answers UNAVAILABLE and a draft's session runs
        target-only; INTERNAL tells it the worker is healthy and to keep sending it every round."""
        log.error("%s: the model thread failed; failing every call and refusing new ones (restart the worker)",
                  self._name, exc_info=exc)
        callback = self._refuse_calls(
            f"the model thread of {self._name} failed ({type(exc).__name__}: {exc}); restart the worker",
            active_too=True)
        if callback is not None:
            try:
                callback(exc)
            except BaseException:  # noqa: BLE001
                log.exception("the model thread's failure callback failed")

    def _window_s(self) -> float:
        """window_ms caps it; a tenth of the recent forward time bounds what waiting may cost. With
        shared compute, a whole forward's time (the other worker uses the cores meanwhile)."""
        cap = self.limits.window_ms / 1000.0
        if self.forwards == 0:
            return cap
        return max(cap, self._step_s) if self.limits.shared_compute else min(cap, 0.1 * self._step_s)

    def _wait_for_due_calls(self) -> None:
        """Hold the forward up to the window while calls that are due have not arrived (lock held)."""
        if self.limits.window_ms <= 0:
            return
        until = self._clock() + self._window_s()
        while not self._closed:
            due, overdue_at = self._due()
            remaining = min(until, overdue_at) - self._clock()
            if due == 0 or remaining <= 0:
                return
            # Woken by each call that arrives, and when the first due session turns overdue: one that
            # is not coming back (its stream's request ended) holds the forward until then, not for
            # the whole window (a forward's time with shared compute).
            self._cond.wait(remaining)

    def _due(self) -> tuple[int, float]:
        """How many sessions are due back, and when the first of them turns overdue (lock held)."""
        # A full batch cannot take a session that comes back: no point waiting. An EndSession runs no
        # forward and takes no slot for long, so it does not count (a stream's request ends beside others).
        if _slots_taken(self._waiting) + _slots_taken(self._active) >= self.limits.max_batch:
            return 0, float("inf")
        now, window = self._clock(), self._window_s()
        # Overdue past twice its gap and the window; with a forward-long window (shared compute), past
        # 1.5 times its gap and the short window: a session whose turn ended must not hold a forward long.
        overdue, late = (1.5, self.limits.window_ms / 1000.0) if self.limits.shared_compute else (2.0, window)
        present = {j.session_id for j in self._waiting} | {j.session_id for j in self._active}
        typical = self._typical_gap()
        due, overdue_at = 0, float("inf")
        for sid, (ended, learned, _) in list(self._returns.items()):
            since = now - ended
            gap = learned or typical  # a session after its first call comes back as the others do
            if since > max(10 * gap, 2.0):
                del self._returns[sid]  # gone quiet: stop expecting it
            elif sid not in present and gap > 0 and since + window >= gap and since <= overdue * gap + late:
                due += 1  # it usually comes back within the window from now, and is not overdue
                overdue_at = min(overdue_at, ended + overdue * gap + late)
        return due, overdue_at

    def _typical_gap(self) -> float:
        """The median of the last 64 gaps learned from any session, 0 before the first. A new session
        (each request of a stream is one) has no gap of its own after its first call, the prompt's; not
        expecting it made its first decode step miss the next forward and wait a whole one. Kept past
        the sessions themselves, so that the first wave of a new burst of streams is expected too."""
        gaps = sorted(self._recent_gaps)
        return gaps[len(gaps) // 2] if gaps else 0.0

    def _admit(self) -> list[_Job]:
        """The waiting calls placed (_placements) into the batch, or dropped (lock held)."""
        admitted: list[_Job] = []
        kept: collections.deque[_Job] = collections.deque()
        for job, place in self._placements(list(self._waiting)):
            if place == _WAITS:
                kept.append(job)
                continue
            admitted.append(job)  # a dropped one: _start drops it (cancelled) or fails it (deadline)
            if place == _DROPPED:
                continue
            self._active.append(job)
            ended = self._returns.get(job.session_id)
            if ended is not None and not job.ends_session:  # learn how soon this session comes back
                gap = max(0.0, job.submitted - ended.ended)
                if gap > 0:  # (0: it was queued behind its own previous call, not a return)
                    self._recent_gaps.append(gap)
                    self._returns[job.session_id] = ended._replace(
                        gap=gap if ended.gap <= 0 else 0.7 * ended.gap + 0.3 * gap)
        self._waiting = kept
        return admitted

    def _start(self, job: _Job) -> None:
        now = self._clock()
        if self._given_up(job, now):
            self._end_unstarted(job)
            return
        job.load.queue_ms = (now - job.submitted) * 1000.0
        try:
            job.steps = job.make_steps()
        except BaseException as exc:  # noqa: BLE001 - delivered to the caller
            self._raise_if_device_lost(exc, "a call's work between forwards")
            self._fail(job, self._as_capacity_error(exc))
            return
        self._advance(job, None, first=True)

    def _advance(self, job: _Job, output: Any, first: bool = False) -> None:
        assert job.steps is not None
        try:
            job.pending = next(job.steps) if first else job.steps.send(output)
            job.pending_since = self._clock()
        except StopIteration as stop:
            self._finish(job, stop.value)
        except BaseException as exc:  # noqa: BLE001 - delivered to the caller
            # A CUDA fault surfaces at the next sync, often in a call's own steps (its sampling's
            # .tolist(), a branch's copy): the device is as lost as in a forward.
            self._raise_if_device_lost(exc, "a call's work between forwards")
            # Out of memory between forwards (a branch's cache copy, the verify rule on the device)
            # is load as much as in a forward.
            self._fail(job, self._as_capacity_error(exc))

    @staticmethod
    def _raise_if_device_lost(exc: BaseException, where: str) -> None:
        """DeviceLost out of the model loop where `exc` lost the device: the calls stay active, and
        _die fails them, and all others, UNAVAILABLE."""
        if device_lost(exc):
            raise DeviceLost(f"{where} left the device unusable: {exc}") from exc

    def _drop_expired(self) -> None:
        now = self._clock()
        for job in list(self._active):
            if job.future.cancelled():
                self._close_steps(job)
                self._finish(job)
            elif job.deadline is not None and now >= job.deadline:
                with self._cond:
                    self.expired += 1
                self._abort(job, DeadlineExceeded("deadline expired between forward steps"))

    def _select(self) -> list[tuple[_Job, Any, bool]]:
        """The (call, step, is a prompt) triples of the next forward: oldest step first, up to
        max_batch_tokens rows. A prompt is a step longer than a decode step, or a chunk of one.

        Chunked prefill: while decode steps wait, they go first, and the steps longer than a decode
        step (a new turn's prompt, a re-prefill) get at most prefill_chunk rows of the forward between
        them. A prompt past that runs its first rows now and the rest in the next forwards (it stays
        the oldest prompt, so it goes first among them), and the decode steps are never held up behind
        whole prompts. With no decode step waiting (a step alone, a burst of prompts) steps run whole:
        a single stream keeps the numerics and the speed of one forward."""
        ready = sorted((j for j in self._active if j.pending is not None), key=lambda j: (j.pending_since, j.submitted))
        decoding = [j for j in ready if len(j.pending.tokens) <= DECODE_STEP_ROWS]
        # Prompts are budgeted only while decode steps wait on them; among themselves they run whole.
        chunking = bool(decoding) and len(ready) > 1 and self.limits.prefill_chunk > 0
        if chunking:  # decode steps first, so a prompt's chunk never crowds them out of the row cap
            ready = decoding + [j for j in ready if len(j.pending.tokens) > DECODE_STEP_ROWS]
        prefill_left: int | None = None  # sized at the first prompt, against the decode rows before it
        itl_bound = self.limits.prefill_itl_factor > 0 and bool(self.limits.prefill_curve)
        # Decode steps leave a waiting prompt MIN_PROMPT_CHUNK rows of the cap: with many sessions
        # verifying many drafts they could fill every forward's max_batch_tokens, and the prompt would
        # get no row (or one) per forward until its deadline.
        prompt_ready = chunking and any(len(j.pending.tokens) > DECODE_STEP_ROWS for j in ready)
        decode_cap = self.limits.max_batch_tokens - (MIN_PROMPT_CHUNK if prompt_ready else 0)
        batch: list[tuple[_Job, Any, bool]] = []
        rows = decode_rows = 0
        for job in ready:
            step = job.pending
            size = len(step.tokens)
            prompt = size > DECODE_STEP_ROWS or job.chunked  # (a short rest of a prompt runs as a decode step)
            if chunking and (size > DECODE_STEP_ROWS or (itl_bound and job.chunked)):
                room = self.limits.max_batch_tokens - rows
                if prefill_left is None:  # the oldest prompt: MIN_PROMPT_CHUNK rows even where a decode
                    # step alone fills the cap (k + 1 >= max_batch_tokens), else it never got a row
                    prefill_left = self._prompt_budget(decode_rows, decoding, itl_bound)
                    room = max(room, MIN_PROMPT_CHUNK)
                take = min(prefill_left, room)
                parts = step.split(take) if 0 < take < size and hasattr(step, "split") else None
                if parts is not None:
                    head, job.pending = parts  # the rest stays pending, still the oldest prompt
                    job.chunked = True
                    step, size = head, len(head.tokens)
                elif size > take and batch:
                    continue  # no room for it in this forward's prompt budget: first in line next time
                prefill_left = max(0, prefill_left - size)
            elif batch and rows + size > (self.limits.max_batch_tokens if prompt else decode_cap):
                continue  # a smaller step behind it may still fit; this one is oldest next time
            batch.append((job, step, prompt))
            rows += size
            decode_rows += 0 if prompt else size
        return batch

    def _prompt_budget(self, decode_rows: int, decoding: list[_Job], itl_bound: bool) -> int:
        """Prompt rows for a forward beside `decode_rows` decode rows (see prefill_curve); never less
        than beside max_batch rows, the startup budget, so that a light load keeps its prompt speed.
        With an ITL bound, sized against every decode step ready (`decoding`, less prompt rests)."""
        if itl_bound:
            steps = [j for j in decoding if not j.chunked]
            if not steps:  # only prompts and their rests ready: no decode step to protect, run whole
                return self.limits.max_batch_tokens
            typical = self._typical_gap()
            limit = min(self._itl_limit_ms(j, typical) for j in steps)  # the tightest session's bound holds
            return prefill_chunk_within(self.limits.prefill_curve, sum(len(j.pending.tokens) for j in steps),
                                        limit, self.limits.max_batch_tokens)
        if not self.limits.prefill_curve or decode_rows <= self.limits.max_batch:
            return self.limits.prefill_chunk
        sized = prefill_chunk_for(self.limits.prefill_curve, decode_rows, self.limits.max_batch_tokens)
        return self.limits.prefill_chunk if sized is None else max(self.limits.prefill_chunk, sized)

    def _itl_limit_ms(self, job: _Job, typical_gap_s: float) -> float:
        """What a forward beside `job`'s decode step may cost under the ITL bound (`itl_limit_ms`).
        With gap relief, its gap is the session's usual one between calls, at most the typical gap of
        all sessions (a chat session's pause between turns is no gap its tokens pay), per step of its
        last call (a call of several steps pays the prompt rows in each)."""
        gap_s = 0.0
        returned = self._returns.get(job.session_id)
        if self.limits.itl_gap_relief and returned:
            gap_s = min(returned.gap, typical_gap_s) / max(1, returned.steps)
        return itl_limit_ms(self.limits.prefill_curve, len(job.pending.tokens), self.limits.prefill_itl_factor,
                            1000.0 * gap_s)

    def _step(self, batch: list[tuple[_Job, Any, bool]]) -> None:
        steps = [step for _, step, _ in batch]
        rows = sum(len(s.tokens) for s in steps)
        prompt_rows = sum(len(step.tokens) for _, step, prompt in batch if prompt)
        for job, step, _ in batch:
            if job.pending is step:
                job.pending = None
        start = self._clock()
        self._pass_rows = rows
        try:
            outputs = self._forward(steps)
        except BaseException as exc:  # noqa: BLE001 - every call in the forward gets the error
            self._raise_if_device_lost(exc, f"a forward of {len(batch)} calls")
            if out_of_memory(exc):
                log.warning("forward over %d calls and %d rows ran out of memory: %s", len(batch), rows, exc)
            else:
                log.exception("batched forward over %d calls failed", len(batch))
            for job, _, _ in batch:
                self._abort(job, self._as_capacity_error(exc, len(batch), rows))
            return
        end = self._clock()
        with self._cond:
            self._busy.append((start, end))
            self._step_s = (end - start) if self.forwards == 0 else 0.8 * self._step_s + 0.2 * (end - start)
            self._batch_ewma = len(batch) if self.forwards == 0 else 0.8 * self._batch_ewma + 0.2 * len(batch)
            self.forwards += 1
            self.batched_sessions += len(batch)
            self.prefill_chunks += any(job.pending is not None for job, _, _ in batch)
        for (job, step, _), output in zip(batch, outputs):
            if isinstance(output, Exception):  # this step's own failure (steps run one at a time)
                self._raise_if_device_lost(output, f"a forward of {len(step.tokens)} rows")  # as from a whole forward
                self._abort(job, self._as_capacity_error(output, 1, len(step.tokens)))
                continue
            job.load.forwards += 1
            job.load.batch_sessions += len(batch)
            job.load.batch_rows += rows
            job.load.batch_prompt_rows += prompt_rows
            if job.pending is None:  # a prefill chunk's call keeps its rest pending: nothing to resume
                job.chunked = False
                self._advance(job, output)

    def _as_capacity_error(self, exc: BaseException, calls: int = 0, rows: int = 0) -> BaseException:
        """Running out of memory is load, not a bug: RESOURCE_EXHAUSTED (retryable, with a hint)
        instead of INTERNAL. A refusal for room (the KV budget full of sessions in use) gets the hint
        too: those sessions are held only for their calls, so the room frees as calls end. Any other
        error is returned as it is. calls, rows: of the forward it ran out in (0: outside a forward,
        in a call's own steps)."""
        if isinstance(exc, CapacityExceeded) and getattr(exc, "retry_after_ms", None) is None:
            with self._cond:
                exc.retry_after_ms = self._retry_after_ms()
            return exc
        if not out_of_memory(exc):
            return exc
        with self._cond:
            retry_ms = self._retry_after_ms()
        where = f"a forward of {calls} calls and {rows} rows" if calls else "a call's work between forwards"
        error = CapacityExceeded(f"out of memory ({type(exc).__name__}) in {where} on {self._name}; retry after "
                                 f"~{retry_ms} ms, or with fewer concurrent calls or shorter prompts", retry_ms)
        error.__cause__ = exc
        return error

    def _close_steps(self, job: _Job) -> None:
        if job.steps is not None:
            try:
                job.steps.close()  # runs the call's finally blocks (unpins its session)
            except BaseException:  # noqa: BLE001
                log.exception("closing an abandoned call failed")

    def _abort(self, job: _Job, exc: BaseException) -> None:
        """Stop a call that has started: close its steps (its finally blocks run), then fail it."""
        self._close_steps(job)
        self._fail(job, exc)

    def _finish(self, job: _Job, result: Any = None) -> None:
        if job.load.forwards and not job.future.cancelled():  # a whole call: how long calls run (retry hints)
            with self._cond:
                self._recent_steps.append(job.load.forwards)
        self._retire(job)
        with contextlib.suppress(InvalidStateError):  # cancelled by the caller meanwhile
            job.future.set_result(result)

    def _fail(self, job: _Job, exc: BaseException) -> None:
        self._retire(job)
        with contextlib.suppress(InvalidStateError):
            job.future.set_exception(exc)

    def _retire(self, job: _Job) -> None:
        job.pending = None
        with self._cond:
            if job in self._active:
                self._active.remove(job)
            previous = self._returns.pop(job.session_id, None)
            now = self._clock()
            if job.ends_session:  # and its branch slots' keys: none of them comes back
                for key in [k for k in self._returns if session_of(k) == job.session_id]:
                    del self._returns[key]
            elif job.steps is None:
                # Never started (its caller gave up, or it expired waiting): not a return to expect
                # the session back after; a forward held for it would wait for a caller that left.
                if previous is not None:
                    self._returns[job.session_id] = previous
            else:
                self._returns[job.session_id] = _Return(now, previous.gap if previous else 0.0,
                                                        job.load.forwards or (previous.steps if previous else 1))
            if len(self._returns) > 4 * (self.limits.max_batch + self.limits.max_queue):
                for sid, (ended, gap, _) in list(self._returns.items()):  # bounded: forget quiet sessions
                    if now - ended > max(10 * gap, 2.0):
                        del self._returns[sid]
            self._cond.notify_all()

    # ------------------------------------------------------------------ load
    def _utilisation(self, now: float) -> float:
        horizon = now - self._util_window_s
        while self._busy and self._busy[0][1] < horizon:
            self._busy.popleft()
        busy = sum(end - max(start, horizon) for start, end in self._busy)
        return min(1.0, busy / max(1e-9, min(self._util_window_s, now - self._started)))

    def _retry_after_ms(self, over: int = 1) -> int:
        """About when a call refused for a full queue would be taken (lock held). A queue place frees
        only when a waiting call is admitted, and that only when an active call ends and frees its
        batch place; an active call holds its place for all its forwards (a Propose k + 1, a chunked
        prompt one per chunk). So: the `over`-th soonest end among the active calls, in forwards
        left (each call's own session's steps per call, else the typical call's, less those it ran),
        times the measured forward time; never less than one forward. Counting the waiting calls
        instead (as once) said 100 ms where a place freed after about 400 (9-step calls, 50 ms
        forwards). Approximate: a queued call behind its own session's call frees no place this way."""
        typical = sorted(self._recent_steps)[len(self._recent_steps) // 2] if self._recent_steps else 1
        left = sorted(self._steps_left(job, typical) for job in self._active if not job.ends_session) or [1]
        forwards = left[min(max(1, over), len(left)) - 1]
        return max(10, int(1000.0 * max(self._step_s, 0.01) * forwards))

    def _steps_left(self, job: _Job, typical: int) -> int:
        """Forwards an active call probably still runs (at least 1; lock held)."""
        returned = self._returns.get(job.session_id)
        left = (returned.steps if returned else typical) - job.load.forwards
        pending = job.pending  # read once: the model thread sets it to None without the lock
        if job.chunked and pending is not None:  # a chunked prompt: at least its rest's chunks
            left = max(left, math.ceil(len(pending.tokens) / max(MIN_PROMPT_CHUNK, self.limits.prefill_chunk)))
        return max(1, left)


HANG_OVER_EXPECTED = 10.0  # a pass this many times longer than its forward's expected time is stuck


async def watch_for_a_hung_forward(scheduler: "BatchScheduler", hang_s: float,
                                   on_hang: Callable[[float], Awaitable[None]], interval_s: float | None = None) -> None:
    """Until cancelled, or until one pass of the model thread (a forward with its calls' steps) has run
    longer than `hang_s`, and HANG_OVER_EXPECTED times what its forward's rows are expected to take
    (a lone long prompt on a slow CPU is slow, not stuck): then the scheduler refuses new calls
    (mark_hung) and `on_hang(seconds)` runs once (the server reports NOT_SERVING, so that the
    liveness probe restarts the worker; callers pass a replica that times out over, but nothing else
    would ever restart it)."""
    interval = interval_s if interval_s is not None else min(5.0, hang_s / 4.0)
    while True:
        await asyncio.sleep(interval)
        running, expected = scheduler.pass_running_s()
        if running > max(hang_s, HANG_OVER_EXPECTED * expected):
            log.error("%s: one forward with its calls' steps has run for %.0f s (expected %.1f s, hang timeout "
                      "%.0f s): refusing calls and reporting NOT_SERVING so that the liveness probe restarts "
                      "this worker", scheduler._name, running, expected, hang_s)
            scheduler.mark_hung(f"one pass has run for {running:.0f} s")
            await on_hang(running)
            return
