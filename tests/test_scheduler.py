"""The per-worker batch scheduler on its own: a fake forward, no model, no gRPC."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import pytest

from specdec.errors import CapacityExceeded, DeadlineExceeded, WorkerUnavailable
from specdec.scheduler import BatchLimits, BatchScheduler, QueueFull, _Return

WAIT_S = 10.0


@dataclass
class Step:
    session: str
    tokens: list[int]


class FakeForward:
    """Records each forward's steps; can hold the next forward until released."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.rows: list[list[int]] = []  # token rows of each step, per forward
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.gate.set()
        self.fail_with: str | None = None  # fail the first forward that has this session
        self.error: Exception | None = None  # ... with this error (else "forward failed")

    def hold(self) -> None:
        self.gate.clear()
        self.entered.clear()

    def __call__(self, steps: list[Step]) -> list[int]:
        self.entered.set()
        assert self.gate.wait(WAIT_S)
        self.batches.append([s.session for s in steps])
        self.rows.append([len(s.tokens) for s in steps])
        if self.fail_with in [s.session for s in steps]:
            self.fail_with = None
            raise self.error or RuntimeError("forward failed")
        return [len(s.tokens) for s in steps]


def call(session: str, steps: int = 1, tokens: int = 1, log: list | None = None):
    """A call of `steps` forward steps; logs start and cleanup events."""
    def make():
        if log is not None:
            log.append(("start", session))
        try:
            out = []
            for _ in range(steps):
                out.append((yield Step(session, [0] * tokens)))
            return out
        finally:
            if log is not None:
                log.append(("cleanup", session))
    return make


@pytest.fixture
def forward():
    return FakeForward()


def submit_held(scheduler: BatchScheduler, forward: FakeForward, session: str, make, **kwargs):
    """Hold the forwards, submit a call and wait until it is inside its first forward: whatever is
    submitted next arrives while that forward runs."""
    forward.hold()
    submitted = scheduler.submit(session, make, **kwargs)
    assert forward.entered.wait(WAIT_S)
    return submitted


def make_scheduler(forward: FakeForward, **limits) -> BatchScheduler:
    limits.setdefault("window_ms", 0.0)
    return BatchScheduler(forward, BatchLimits(**limits))


def test_calls_that_arrive_together_share_each_forward(forward) -> None:
    scheduler = make_scheduler(forward)
    try:
        first, _ = submit_held(scheduler, forward, "a", call("a"))
        # While "a" is in its forward, three multi-step calls arrive: they run as one batch per step.
        futures = [scheduler.submit(s, call(s, steps=3))[0] for s in ("b", "c", "d")]
        forward.gate.set()
        assert first.result(WAIT_S) == [1]
        assert [f.result(WAIT_S) for f in futures] == [[1, 1, 1]] * 3
        assert forward.batches == [["a"], ["b", "c", "d"], ["b", "c", "d"], ["b", "c", "d"]]
        assert scheduler.forwards == 4 and scheduler.batched_sessions == 10
    finally:
        scheduler.close()


def test_a_hung_forward_is_reported_once_and_a_slow_one_is_not(forward) -> None:
    """A forward that never returns fails no call and kills no thread: only the watchdog sees it.
    Then the worker refuses calls (UNAVAILABLE: the orchestrator passes it over) and reports
    NOT_SERVING, so that its liveness probe restarts it. A pass counts from the calls' start to their
    resumption, not the forward alone: on a GPU the forward only queues kernels."""
    import asyncio

    from specdec.scheduler import watch_for_a_hung_forward

    async def watch(scheduler: BatchScheduler, hang_s: float, for_s: float, hung: list[float]) -> bool:
        async def on_hang(seconds: float) -> None:
            hung.append(seconds)
        task = asyncio.create_task(watch_for_a_hung_forward(scheduler, hang_s, on_hang, interval_s=0.02))
        await asyncio.sleep(for_s)
        done = task.done()
        task.cancel()
        return done

    scheduler = make_scheduler(forward)
    try:
        assert scheduler.pass_running_s() == (0.0, 0.0)
        first, _ = submit_held(scheduler, forward, "a", call("a"))
        queued, _ = scheduler.submit("b", call("b"))
        hung: list[float] = []
        assert not asyncio.run(watch(scheduler, hang_s=5.0, for_s=0.3, hung=hung)) and hung == []  # not yet
        assert asyncio.run(watch(scheduler, hang_s=0.2, for_s=0.5, hung=hung)) and len(hung) == 1 and hung[0] > 0.2
        assert scheduler.pass_running_s()[0] > 0.2
        with pytest.raises(WorkerUnavailable, match="stuck"):  # refused from now on ...
            scheduler.submit("c", call("c"))
        with pytest.raises(WorkerUnavailable, match="stuck"):  # ... and the call queued behind it failed
            queued.result(WAIT_S)
        forward.gate.set()
        assert first.result(WAIT_S) == [1]  # the stuck pass's own calls end as it does
    finally:
        scheduler.close()
    # A forward expected to take long on the worker's own cost curve (a lone long prompt on a slow
    # CPU) is slow, not stuck: it is given HANG_OVER_EXPECTED times its expected time.
    slow = BatchScheduler(forward, BatchLimits(window_ms=0.0, prefill_curve=((1, 100.0), (64, 6400.0))))
    try:
        first, _ = submit_held(slow, forward, "a", call("a", tokens=8))  # 8 rows: 0.8 s expected
        assert slow.pass_running_s()[1] == pytest.approx(0.8)
        hung = []
        assert not asyncio.run(watch(slow, hang_s=0.2, for_s=0.5, hung=hung)) and hung == []
        forward.gate.set()
        assert first.result(WAIT_S) == [8]
    finally:
        slow.close()


def test_a_call_joins_a_running_multi_step_call_between_steps(forward) -> None:
    scheduler = make_scheduler(forward)
    try:
        long_call, long_load = submit_held(scheduler, forward, "long", call("long", steps=3))
        short_call, short_load = scheduler.submit("short", call("short", steps=1))
        forward.gate.set()
        long_call.result(WAIT_S), short_call.result(WAIT_S)
        assert forward.batches == [["long"], ["long", "short"], ["long"]]
        assert long_load.forwards == 3 and long_load.batch_sessions == 4
        assert short_load.mean_batch == 2.0 and short_load.queue_ms >= 0.0
    finally:
        scheduler.close()


def test_one_call_per_session_at_a_time_in_arrival_order(forward) -> None:
    scheduler = make_scheduler(forward)
    log: list = []
    try:
        first, _ = submit_held(scheduler, forward, "s", call("s", steps=2, log=log))
        second, _ = scheduler.submit("s", call("s", steps=1, log=log))
        other, _ = scheduler.submit("t", call("t", steps=1))
        forward.gate.set()
        first.result(WAIT_S), second.result(WAIT_S), other.result(WAIT_S)
        # The second call on "s" starts only after the first cleaned up; "t" did not wait for it.
        assert log == [("start", "s"), ("cleanup", "s"), ("start", "s"), ("cleanup", "s")]
        assert all(batch.count("s") <= 1 for batch in forward.batches)
        assert forward.batches[1] == ["s", "t"]
    finally:
        scheduler.close()


def test_token_cap_starves_nobody(forward) -> None:
    # Rows per forward capped at 4: a 4-row call and five 1-row calls of several steps each. Whoever
    # was left out of a forward is the oldest and goes first in the next one.
    scheduler = make_scheduler(forward, max_batch_tokens=4)
    try:
        blocker, _ = submit_held(scheduler, forward, "x", call("x"))
        futures = [scheduler.submit("big", call("big", steps=3, tokens=4))[0]]
        futures += [scheduler.submit(f"s{i}", call(f"s{i}", steps=3))[0] for i in range(5)]
        forward.gate.set()
        blocker.result(WAIT_S)
        for f in futures:
            f.result(WAIT_S)
        batches = forward.batches[1:]
        rows = {"big": 4}
        assert all(sum(rows.get(s, 1) for s in b) <= 4 for b in batches)
        # No call waits more than two forwards between its steps.
        for session in ["big"] + [f"s{i}" for i in range(5)]:
            seen = [i for i, b in enumerate(batches) if session in b]
            assert len(seen) == 3
            assert max(b - a for a, b in zip([-1] + seen, seen)) <= 3, (session, batches)
    finally:
        scheduler.close()


def test_full_queue_is_refused_with_a_retry_hint(forward) -> None:
    scheduler = make_scheduler(forward, max_batch=1, max_queue=1)
    try:
        running, _ = submit_held(scheduler, forward, "a", call("a"))
        queued, _ = scheduler.submit("b", call("b"))
        with pytest.raises(QueueFull) as refused:
            scheduler.submit("c", call("c"))
        assert refused.value.code_name == "RESOURCE_EXHAUSTED" and refused.value.retry_after_ms > 0
        assert "retry after" in str(refused.value)
        forward.gate.set()
        running.result(WAIT_S), queued.result(WAIT_S)
        assert scheduler.rejected == 1
        # With the queue drained, calls are taken again.
        assert scheduler.submit("c", call("c"))[0].result(WAIT_S) == [1]
    finally:
        scheduler.close()


def test_the_retry_hint_is_when_a_queue_place_frees() -> None:
    """A queue place frees when a waiting call is admitted, which is when an active call ends: after
    all its forwards. With 9-forward calls and 50 ms forwards (a fake clock: no wall-clock timing),
    a call refused while one runs and one waits is taken 450 ms later; the hint said 100 ms
    (forward time x (1 + waiting / max_batch))."""
    now = [0.0]
    gate, entered = threading.Event(), threading.Event()
    gate.set()

    def forward(steps):
        entered.set()
        assert gate.wait(WAIT_S)
        now[0] += 0.05  # each forward: 50 ms of the fake clock
        return [0] * len(steps)
    scheduler = BatchScheduler(forward, BatchLimits(max_batch=1, max_queue=1, window_ms=0.0), clock=lambda: now[0])
    try:
        for s in ("w1", "w2", "w3"):  # what it measures: 50 ms forwards, 9 forwards a call
            scheduler.submit(s, call(s, steps=9))[0].result(WAIT_S)
        gate.clear()
        entered.clear()
        running, _ = scheduler.submit("a", call("a", steps=9))
        assert entered.wait(WAIT_S)  # a is in its first forward
        admitted_at: list[float] = []

        def queued_call():
            admitted_at.append(now[0])
            return (yield from call("b", steps=9)())
        queued, _ = scheduler.submit("b", queued_call)
        with pytest.raises(QueueFull) as refused:
            scheduler.submit("c", call("c", steps=9))
        refused_at = now[0]
        gate.set()
        running.result(WAIT_S), queued.result(WAIT_S)
        waited_ms = 1000.0 * (admitted_at[0] - refused_at)  # b admitted: the queue place freed
        assert waited_ms == pytest.approx(450.0)
        assert 0.5 * waited_ms <= refused.value.retry_after_ms <= 2.0 * waited_ms, refused.value.retry_after_ms
    finally:
        gate.set()
        scheduler.close()


def test_max_queue_zero_means_no_waiting_room_not_no_calls(forward) -> None:
    scheduler = make_scheduler(forward, max_batch=1, max_queue=0)
    try:
        assert scheduler.submit("a", call("a"))[0].result(WAIT_S) == [1]  # an idle worker takes a call
        running, _ = submit_held(scheduler, forward, "b", call("b"))
        with pytest.raises(QueueFull):  # the one slot is taken and there is no waiting room
            scheduler.submit("c", call("c"))
        # An EndSession takes no slot and frees memory: never refused for load.
        ended, _ = scheduler.submit("a", call("a", steps=0), ends_session=True)
        forward.gate.set()
        assert running.result(WAIT_S) == [1] and ended.result(WAIT_S) == []
        assert scheduler.rejected == 1
    finally:
        scheduler.close()


def test_the_queue_counts_only_calls_the_next_forward_cannot_take(forward) -> None:
    """An EndSession takes no slot: one waiting behind its session's call did count as queued, so a
    call that would join the next forward was refused RESOURCE_EXHAUSTED with a slot free (and the
    load the k policy sees said 0 waiting). A call behind its own session's call does wait."""
    scheduler = make_scheduler(forward, max_batch=2, max_queue=0)
    try:
        running, _ = submit_held(scheduler, forward, "a", call("a", steps=3))
        ended, _ = scheduler.submit("a", call("a", steps=0), ends_session=True)  # waits behind a's call
        assert scheduler.snapshot().waiting == 0
        joining, _ = scheduler.submit("c", call("c"))  # the free slot: not refused
        with pytest.raises(QueueFull):
            scheduler.submit("c", call("c"))  # behind c's own call: it would wait, and max_queue is 0
        forward.gate.set()
        assert running.result(WAIT_S) == [1, 1, 1] and joining.result(WAIT_S) == [1] and ended.result(WAIT_S) == []
        assert scheduler.rejected == 1
    finally:
        scheduler.close()


def test_a_steps_own_failure_fails_only_its_call(forward) -> None:
    """A forward that runs its steps one at a time hands back a step's exception as its output."""
    def forward_failing_for_b(steps):
        return [RuntimeError("b failed") if s.session == "b" else len(s.tokens) for s in steps]

    scheduler = make_scheduler(forward_failing_for_b)
    try:
        futures = {s: scheduler.submit(s, call(s, steps=2))[0] for s in ("a", "b")}
        assert futures["a"].result(WAIT_S) == [1, 1]
        with pytest.raises(RuntimeError, match="b failed"):
            futures["b"].result(WAIT_S)
        assert scheduler.submit("b", call("b"))[0].exception(WAIT_S) is not None  # b's forward still fails
    finally:
        scheduler.close()


def test_deadline_expiring_in_the_queue_or_between_steps_stops_the_call(forward) -> None:
    scheduler = make_scheduler(forward)
    log: list = []
    try:
        running, _ = submit_held(scheduler, forward, "a", call("a", steps=3, log=log), timeout_s=2.0)
        waiting, _ = scheduler.submit("b", call("b", log=log), timeout_s=0.1)
        threading.Event().wait(2.2)  # both deadlines pass while the forward is held
        forward.gate.set()
        with pytest.raises(DeadlineExceeded):
            running.result(WAIT_S)
        with pytest.raises(DeadlineExceeded):
            waiting.result(WAIT_S)
        # "a" ran one forward, then was stopped and cleaned up; "b" never started.
        assert forward.batches == [["a"]]
        assert log == [("start", "a"), ("cleanup", "a")]
        assert scheduler.expired == 2
    finally:
        scheduler.close()


def test_cancelled_calls_are_dropped_and_cleaned_up(forward) -> None:
    scheduler = make_scheduler(forward)
    log: list = []
    try:
        running, _ = submit_held(scheduler, forward, "a", call("a", steps=3, log=log))
        waiting, _ = scheduler.submit("b", call("b", log=log))
        assert waiting.cancel() and running.cancel()
        forward.gate.set()
        assert scheduler.submit("c", call("c"))[0].result(WAIT_S) == [1]
        assert ("start", "b") not in log and log == [("start", "a"), ("cleanup", "a")]
        assert ["a"] in forward.batches and not any("b" in b for b in forward.batches)
    finally:
        scheduler.close()


def test_a_failed_forward_fails_its_calls_and_the_scheduler_goes_on(forward) -> None:
    scheduler = make_scheduler(forward)
    log: list = []
    try:
        blocker, _ = submit_held(scheduler, forward, "x", call("x"))
        futures = [scheduler.submit(s, call(s, steps=2, log=log))[0] for s in ("a", "b")]
        forward.fail_with = "a"
        forward.gate.set()
        assert blocker.result(WAIT_S) == [1]
        for f in futures:
            with pytest.raises(RuntimeError, match="forward failed"):
                f.result(WAIT_S)
        assert ("cleanup", "a") in log and ("cleanup", "b") in log
        assert scheduler.submit("c", call("c"))[0].result(WAIT_S) == [1]
    finally:
        scheduler.close()


class OutOfMemoryError(RuntimeError):
    """Stands for torch.OutOfMemoryError (CUDA's; matched by name, the scheduler has no torch)."""


@pytest.mark.parametrize("error", [
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                 "you tried to allocate 4611686018427387904 bytes. Error code 12 (Cannot allocate memory)"),
    OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
], ids=["cpu", "cuda"])
def test_a_forward_out_of_memory_fails_its_calls_as_capacity_not_internal(forward, error) -> None:
    """Running out of memory is load, not a bug: both calls of the batch get RESOURCE_EXHAUSTED with
    a retry hint (they were INTERNAL), and the scheduler goes on."""
    scheduler = make_scheduler(forward)
    log: list = []
    try:
        blocker, _ = submit_held(scheduler, forward, "x", call("x"))
        futures = [scheduler.submit(s, call(s, steps=2, log=log))[0] for s in ("a", "b")]
        forward.fail_with, forward.error = "a", error
        forward.gate.set()
        assert blocker.result(WAIT_S) == [1]
        for f in futures:
            with pytest.raises(CapacityExceeded, match="out of memory") as failed:
                f.result(WAIT_S)
            assert failed.value.code_name == "RESOURCE_EXHAUSTED" and failed.value.retry_after_ms > 0
            assert "2 calls" in str(failed.value) and failed.value.__cause__ is error
        assert ["a", "b"] in forward.batches and ("cleanup", "a") in log and ("cleanup", "b") in log
        assert scheduler.submit("c", call("c"))[0].result(WAIT_S) == [1]
    finally:
        scheduler.close()


def test_a_steps_own_out_of_memory_is_capacity_too() -> None:
    """Steps run one at a time hand back their own error: an allocation failure there maps the same way."""
    def forward_out_of_memory_for_b(steps):
        return [RuntimeError("not enough memory: you tried to allocate 1 GB") if s.session == "b" else len(s.tokens)
                for s in steps]

    scheduler = make_scheduler(forward_out_of_memory_for_b)
    try:
        futures = {s: scheduler.submit(s, call(s))[0] for s in ("a", "b")}
        assert futures["a"].result(WAIT_S) == [1]
        with pytest.raises(CapacityExceeded, match="out of memory"):
            futures["b"].result(WAIT_S)
    finally:
        scheduler.close()


def test_running_out_of_memory_between_forwards_is_capacity_too(forward) -> None:
    """Out of memory in a call's own work outside a forward (a branch's cache copy before its first
    forward, the verify rule on the device after one) is load as well: RESOURCE_EXHAUSTED with a
    retry hint, not INTERNAL. Other errors there stay what they are."""
    def failing(session: str, after_forward: bool, error: BaseException):
        def make():
            if after_forward:
                yield Step(session, [0])
            raise error
        return make

    scheduler = make_scheduler(forward)
    try:
        for after_forward in (False, True):
            future, _ = scheduler.submit("a", failing("a", after_forward, OutOfMemoryError("CUDA out of memory")))
            with pytest.raises(CapacityExceeded, match="between forwards") as failed:
                future.result(WAIT_S)
            assert failed.value.retry_after_ms > 0
        future, _ = scheduler.submit("b", failing("b", True, ValueError("a bug")))
        with pytest.raises(ValueError, match="a bug"):
            future.result(WAIT_S)
        assert scheduler.submit("c", call("c"))[0].result(WAIT_S) == [1]
    finally:
        scheduler.close()


def test_a_failure_of_the_model_thread_fails_every_call_and_every_later_one(forward, caplog) -> None:
    """A bug outside the calls' own error handling (here in _select) killed the model thread
    silently: its calls and every later one waited forever (a Verify for the orchestrator's whole
    --target-timeout-s). Now they fail UNAVAILABLE, the error is logged with its traceback, and the
    worker is told (on_failure: its health goes NOT_SERVING)."""
    failures: list[BaseException] = []
    log: list = []
    scheduler = make_scheduler(forward, max_batch=1)
    scheduler.on_failure(failures.append)
    running, _ = submit_held(scheduler, forward, "a", call("a", steps=3, log=log))
    waiting, _ = scheduler.submit("b", call("b", log=log))

    def broken_select():
        raise AssertionError("a bug in selection")
    scheduler._select = broken_select  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="specdec.scheduler"):
        forward.gate.set()
        for future in (running, waiting):
            with pytest.raises(WorkerUnavailable, match="model thread .* failed .*a bug in selection"):
                future.result(WAIT_S)
        scheduler._thread.join(WAIT_S)
    assert log == [("start", "a"), ("cleanup", "a")]  # a's steps closed (its session unpinned); b never started
    assert len(failures) == 1 and isinstance(failures[0], AssertionError)
    assert [r.exc_info[1] for r in caplog.records if r.exc_info] == failures
    with pytest.raises(WorkerUnavailable, match="model thread"):  # refused at once, not left to hang
        scheduler.submit("c", call("c"))
    told: list[BaseException] = []
    scheduler.on_failure(told.append)  # registered late: told at once
    assert len(told) == 1
    scheduler.close()


def test_a_forward_that_loses_the_device_stops_the_worker(forward, caplog) -> None:
    """A sticky CUDA error (an illegal memory access) fails every later forward too: answering each
    call INTERNAL kept a dead replica in the rotation, healthy to its probes. Its calls and every later
    one fail UNAVAILABLE (the orchestrator passes the replica over) and its health goes NOT_SERVING.
    Another forward error fails only that forward's calls."""
    failures: list[BaseException] = []
    scheduler = make_scheduler(forward)
    scheduler.on_failure(failures.append)
    forward.fail_with, forward.error = "a", RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        scheduler.submit("a", call("a"))[0].result(WAIT_S)
    assert not failures and scheduler.submit("b", call("b"))[0].result(WAIT_S) == [1]
    forward.fail_with = "c"
    forward.error = RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be "
                                 "asynchronously reported at some other API call")
    with caplog.at_level(logging.ERROR, logger="specdec.scheduler"):
        with pytest.raises(WorkerUnavailable, match="left the device unusable"):
            scheduler.submit("c", call("c"))[0].result(WAIT_S)
        scheduler._thread.join(WAIT_S)
    assert len(failures) == 1 and "illegal memory access" in str(failures[0])
    with pytest.raises(WorkerUnavailable, match="model thread"):
        scheduler.submit("d", call("d"))
    scheduler.close()


def test_a_lost_device_in_one_calls_own_forward_stops_the_worker_too() -> None:
    """Models without ragged batching run each step of a batch as its own forward and hand a step's
    error back as its output: a lost device there was that call's INTERNAL, for every call of every
    later batch, while the worker stayed SERVING."""
    failures: list[BaseException] = []

    def forward(steps: list[Step]) -> list:
        return [RuntimeError("CUDA error: an illegal memory access was encountered") if s.session == "b" else 1
                for s in steps]
    scheduler = BatchScheduler(forward, BatchLimits(window_ms=0.0))
    scheduler.on_failure(failures.append)
    assert scheduler.submit("a", call("a"))[0].result(WAIT_S) == [1]
    with pytest.raises(WorkerUnavailable, match="left the device unusable"):
        scheduler.submit("b", call("b"))[0].result(WAIT_S)
    scheduler._thread.join(WAIT_S)
    assert len(failures) == 1 and "illegal memory access" in str(failures[0])
    scheduler.close()


def test_only_sticky_cuda_errors_count_as_a_lost_device() -> None:
    """torch appends a note on device-side assertion tracking to every CUDA error: matching the whole
    message made a transient launch error ("invalid configuration argument") stop a healthy worker."""
    from specdec.scheduler import device_lost
    note = "\nCUDA kernel errors might be asynchronously reported.\nDevice-side assertion tracking was not enabled by user."
    assert not device_lost(RuntimeError("CUDA error: invalid configuration argument" + note))
    assert not device_lost(RuntimeError("CUDA error: too many resources requested for launch" + note))
    assert not device_lost(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB" + note))
    assert not device_lost(ValueError("an illegal memory access in a message about something else"))
    assert device_lost(RuntimeError("CUDA error: an illegal memory access was encountered" + note))
    assert device_lost(RuntimeError("CUDA error: device-side assert triggered" + note))

    class AcceleratorError(RuntimeError):
        def __init__(self, message: str, error_code: int) -> None:
            super().__init__(message)
            self.error_code = error_code
    assert device_lost(AcceleratorError("CUDA error: whatever the text", 700))
    assert not device_lost(AcceleratorError("CUDA error: an illegal memory access was encountered", 9))


def test_a_lost_device_in_a_calls_own_steps_stops_the_worker(forward) -> None:
    """A CUDA fault surfaces at the next sync, often in a call's own steps (its sampling's .tolist()):
    there too the worker stops (UNAVAILABLE, NOT_SERVING) rather than answering INTERNAL."""
    failures: list[BaseException] = []

    def faulting():
        yield Step("a", [0])
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    scheduler = make_scheduler(forward)
    scheduler.on_failure(failures.append)
    with pytest.raises(WorkerUnavailable, match="between forwards left the device unusable"):
        scheduler.submit("a", faulting)[0].result(WAIT_S)
    scheduler._thread.join(WAIT_S)
    assert len(failures) == 1
    scheduler.close()


def test_a_lost_device_at_a_calls_start_still_ends_the_calls_dropped_with_it() -> None:
    """Admission hands the model thread the calls it placed and those it dropped (expired) together;
    the device lost in the first one's start must not leave a dropped one's future unresolved (_die
    fails only the waiting and active calls)."""
    from specdec.scheduler import _Job

    def faulting():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
        yield  # noqa - a generator
    now = [100.0]
    scheduler = BatchScheduler(lambda steps: [0] * len(steps), BatchLimits(window_ms=0.0), clock=lambda: now[0])
    lost, dropped = _Job("lost", faulting, None, 100.0), _Job("late", call("late"), 100.5, 100.0)
    with scheduler._cond:
        scheduler._waiting.extend([lost, dropped])
        now[0] = 101.0  # "late" expired while it waited
        scheduler._cond.notify_all()
    with pytest.raises(WorkerUnavailable):
        lost.future.result(WAIT_S)
    with pytest.raises(DeadlineExceeded):
        dropped.future.result(WAIT_S)
    scheduler.close()


def test_a_refusal_for_kv_room_carries_a_retry_hint(forward) -> None:
    """The KV budget full of sessions in use (CapacityExceeded from a call's own steps) frees as
    those calls end: RESOURCE_EXHAUSTED with a retry hint, which the orchestrator waits out mid-turn."""
    def refused():
        raise CapacityExceeded("KV budget cannot hold 500 tokens next to the sessions in use")
        yield  # noqa - a generator
    scheduler = make_scheduler(forward)
    try:
        with pytest.raises(CapacityExceeded) as failed:
            scheduler.submit("a", refused)[0].result(WAIT_S)
        assert failed.value.retry_after_ms >= 10
    finally:
        scheduler.close()


def test_errors_inside_a_call_reach_only_that_call(forward) -> None:
    def broken():
        raise ValueError("bad request")
        yield  # noqa: unreachable
    scheduler = make_scheduler(forward)
    try:
        bad, _ = scheduler.submit("a", broken)
        good, _ = scheduler.submit("b", call("b"))
        with pytest.raises(ValueError, match="bad request"):
            bad.result(WAIT_S)
        assert good.result(WAIT_S) == [1]
    finally:
        scheduler.close()


def test_close_fails_waiting_calls_as_unavailable(forward) -> None:
    scheduler = make_scheduler(forward, max_batch=1)
    running, _ = submit_held(scheduler, forward, "a", call("a", steps=2))
    waiting, _ = scheduler.submit("b", call("b"))
    closer = threading.Thread(target=scheduler.close)
    closer.start()
    give_up = time.monotonic() + WAIT_S
    while not scheduler._closed and time.monotonic() < give_up:  # closed before "a" can finish and "b" start
        time.sleep(0.001)
    forward.gate.set()
    closer.join(WAIT_S)
    with pytest.raises(WorkerUnavailable):
        waiting.result(WAIT_S)
    with pytest.raises(WorkerUnavailable):
        scheduler.submit("c", call("c"))


def test_window_waits_only_for_sessions_that_are_due() -> None:
    now = [100.0]
    scheduler = BatchScheduler(lambda steps: [0] * len(steps), BatchLimits(window_ms=5.0), clock=lambda: now[0])
    try:
        with scheduler._cond:
            assert scheduler._window_s() == 0.005
            # "s" ended a call at t=100 and usually comes back 0.2 s after one.
            scheduler._returns["s"] = _Return(100.0, 0.2)
            now[0] = 100.05   # not back for another 0.15 s: no point holding a forward for it
            assert scheduler._due()[0] == 0
            now[0] = 100.197  # comes back within the 5 ms window
            assert scheduler._due()[0] == 1
            now[0] = 100.3    # a little late: still expected
            assert scheduler._due()[0] == 1
            now[0] = 100.5    # overdue: no longer waited for
            assert scheduler._due()[0] == 0
            now[0] = 200.0    # quiet for long: forgotten
            assert scheduler._due()[0] == 0 and "s" not in scheduler._returns
            # A session that comes straight back (a round trip of 3 ms) is due right after its call.
            scheduler._returns["fast"] = _Return(200.0, 0.003)
            assert scheduler._due()[0] == 1
            # A session with no learned gap, and no other session to learn from, is never waited for:
            # a single stream pays nothing.
            scheduler._returns.clear()
            scheduler._returns["new"] = _Return(200.0, 0.0)
            assert scheduler._due()[0] == 0
            # Beside sessions that come back 3-4 ms after a call, a new one (after its prompt's call)
            # is expected as they are: due now, overdue past twice the typical gap and the window.
            scheduler._recent_gaps.extend([0.003, 0.004, 0.003])  # learned from sessions now gone
            assert scheduler._typical_gap() == 0.003
            assert scheduler._due()[0] == 1
            now[0] = 200.0 + 2 * 0.003 + 0.005 + 0.001
            assert scheduler._due()[0] == 0 and "new" in scheduler._returns
            # Its own gap, once learned, wins over the others'.
            scheduler._returns["new"] = _Return(now[0], 0.5)
            assert scheduler._due()[0] == 0
            # The window is at most a tenth of a forward: fast forwards wait less.
            scheduler.forwards, scheduler._step_s = 10, 0.02
            assert scheduler._window_s() == pytest.approx(0.002)
    finally:
        scheduler.close()


def test_with_shared_compute_a_forward_waits_up_to_its_own_time_for_sessions_still_drafting() -> None:
    """Draft and target on the same cores: the target holds a forward for sessions that come back
    within a forward's time (they are drafting, on the cores it would otherwise contend for), so the
    sessions verify together instead of in alternating groups; not for one that is overdue."""
    now = [100.0]
    scheduler = BatchScheduler(lambda steps: [0] * len(steps), BatchLimits(window_ms=5.0, shared_compute=True),
                               clock=lambda: now[0])
    try:
        with scheduler._cond:
            assert scheduler._window_s() == 0.005  # nothing measured yet: the cap
            scheduler.forwards, scheduler._step_s = 10, 0.8  # forwards of 800 ms
            assert scheduler._window_s() == pytest.approx(0.8)
            scheduler._returns["drafting"] = _Return(100.0, 0.5)  # back 0.5 s after its verify, usually
            now[0] = 100.05
            assert scheduler._due()[0] == 1  # within the next forward's time: wait for it
            now[0] = 100.75                      # 1.5 x its gap (and the 5 ms cap): overdue
            assert scheduler._due()[0] == 1
            now[0] = 100.76
            assert scheduler._due()[0] == 0
        # Without shared compute the same session is not waited for until it is 5 ms away.
        plain = BatchScheduler(lambda steps: [0] * len(steps), BatchLimits(window_ms=5.0), clock=lambda: now[0])
        try:
            with plain._cond:
                plain.forwards, plain._step_s = 10, 0.8
                plain._returns["drafting"] = _Return(100.0, 0.5)
                now[0] = 100.05
                assert plain._window_s() == pytest.approx(0.005) and plain._due()[0] == 0
        finally:
            plain.close()
    finally:
        scheduler.close()


def test_a_due_session_that_does_not_come_back_holds_the_forward_only_until_it_is_overdue() -> None:
    """With shared compute the window is a whole forward (here 3 s); a session expected 10 ms after
    its call that never returns (its stream's request ended) must release the forward when it turns
    overdue (1.5 x 10 ms + the 5 ms cap), not at the end of the window."""
    import time as _time

    now = [100.0]
    clocked = BatchScheduler(lambda steps: [0] * len(steps), BatchLimits(window_ms=5.0, shared_compute=True),
                             clock=lambda: now[0])
    try:
        with clocked._cond:
            clocked.forwards, clocked._step_s = 10, 3.0
            clocked._returns.update({"gone": _Return(100.0, 0.010), "later": _Return(100.0, 0.020)})
            due, overdue_at = clocked._due()
            assert due == 2 and overdue_at == pytest.approx(100.0 + 1.5 * 0.010 + 0.005)
    finally:
        clocked.close()

    started: list[float] = []
    scheduler = BatchScheduler(lambda steps: started.append(_time.monotonic()) or [0] * len(steps),
                               BatchLimits(window_ms=5.0, shared_compute=True))
    try:
        with scheduler._cond:
            scheduler.forwards, scheduler._step_s = 10, 3.0
            scheduler._returns["gone"] = _Return(_time.monotonic(), 0.010)
        submitted = _time.monotonic()
        scheduler.submit("x", call("x"))[0].result(WAIT_S)
        assert started and started[0] - submitted < 1.0, started[0] - submitted  # not the 3 s window
    finally:
        scheduler.close()


def _gang_batches(shared_compute: bool) -> list[list[str]]:
    """Two sessions in closed loops against forwards of 60 ms: "fast" comes back 5 ms after each
    call, "slow" (drafting, say) 40 ms after. Returns each forward's sessions."""
    import time as _time

    batches: list[list[str]] = []

    def forward(steps):
        _time.sleep(0.06)
        batches.append(sorted(s.session for s in steps))
        return [0] * len(steps)
    scheduler = BatchScheduler(forward, BatchLimits(window_ms=5.0, shared_compute=shared_compute))

    def loop(session: str, gap_s: float) -> None:
        for _ in range(12):
            scheduler.submit(session, call(session))[0].result(WAIT_S)
            _time.sleep(gap_s)
    try:
        threads = [threading.Thread(target=loop, args=("fast", 0.005)), threading.Thread(target=loop, args=("slow", 0.04))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S * 3)
    finally:
        scheduler.close()
    return batches


def test_with_shared_compute_sessions_of_different_gaps_fall_into_step() -> None:
    together = _gang_batches(shared_compute=True)
    apart = _gang_batches(shared_compute=False)
    # Once the gaps are learned (a few calls), shared compute holds each forward for "slow".
    assert sum(b == ["fast", "slow"] for b in together[4:]) >= 0.5 * len(together[4:]), together
    # Without it "fast" does not wait 40 ms for "slow": most forwards run one of them.
    assert len(apart) > len(together), (apart, together)


def test_a_new_sessions_second_call_joins_the_forward_of_the_others() -> None:
    """A stream's request is a new session: its first call is the prompt's, and it comes back a
    little later than the streams already decoding (12 ms against their 3). Expected back as they
    are, it shares their next forward instead of missing it and waiting a whole forward."""
    import time as _time

    batches: list[list[str]] = []

    def forward(steps):
        _time.sleep(0.5)
        batches.append(sorted(s.session for s in steps))
        return [0] * len(steps)
    # A window of 50 ms (a tenth of these forwards): "fresh" back at 12 ms is well inside it.
    scheduler = BatchScheduler(forward, BatchLimits(window_ms=50.0))
    stop = threading.Event()

    def loop(session: str) -> None:
        while not stop.is_set():
            scheduler.submit(session, call(session))[0].result(WAIT_S)
            _time.sleep(0.003)
    threads = [threading.Thread(target=loop, args=(name,)) for name in ("old1", "old2")]
    try:
        for t in threads:
            t.start()
        deadline = _time.monotonic() + WAIT_S
        while len(batches) < 4:  # the old sessions' gaps are learned
            assert _time.monotonic() < deadline, f"{len(batches)} batches in {WAIT_S} s"
            _time.sleep(0.01)
        scheduler.submit("fresh", call("fresh"))[0].result(WAIT_S)
        _time.sleep(0.012)
        scheduler.submit("fresh", call("fresh"))[0].result(WAIT_S)
    finally:
        stop.set()
        for t in threads:
            t.join(WAIT_S)
        scheduler.close()
    with_fresh = [i for i, b in enumerate(batches) if "fresh" in b]
    assert len(with_fresh) == 2 and batches[with_fresh[0]] == batches[with_fresh[1]] == ["fresh", "old1", "old2"], batches
    assert with_fresh[1] == with_fresh[0] + 1, batches  # the very next forward, not one later


def test_an_end_session_waiting_does_not_count_as_a_full_batch() -> None:
    """At max_batch calls present nobody is waited for (a returning session could not join); an
    EndSession runs no forward, so a stream whose request just ended does not make the batch look
    full and let the next forward start without a session that is due back."""
    from specdec.scheduler import _Job
    now = [100.0]
    scheduler = BatchScheduler(lambda steps: [0] * len(steps), BatchLimits(max_batch=2, window_ms=5.0),
                               clock=lambda: now[0])
    try:
        with scheduler._cond:
            scheduler._returns["due"] = _Return(100.0, 0.003)
            scheduler._waiting.append(_Job("decoding", call("decoding"), None, 100.0))
            scheduler._waiting.append(_Job("finished", call("finished"), None, 100.0, ends_session=True))
            assert scheduler._due()[0] == 1
            scheduler._waiting.append(_Job("other", call("other"), None, 100.0))  # now really full
            assert scheduler._due()[0] == 0
            scheduler._waiting.clear()
    finally:
        scheduler.close()


def test_an_end_session_takes_no_slot_from_a_decoding_session(forward) -> None:
    """A stream's request ends (EndSession) while another session's next step arrives: the
    EndSession runs no forward, so it must not take the last slot and push that step a forward later."""
    scheduler = make_scheduler(forward, max_batch=2)
    try:
        first, _ = submit_held(scheduler, forward, "a", call("a", steps=3))
        ended, _ = scheduler.submit("c", call("c", steps=0), ends_session=True)
        decoding, _ = scheduler.submit("d", call("d"))
        forward.gate.set()
        first.result(WAIT_S), ended.result(WAIT_S), decoding.result(WAIT_S)
        assert sorted(forward.batches[1]) == ["a", "d"], forward.batches
    finally:
        scheduler.close()


def test_an_end_session_never_overtakes_its_own_sessions_earlier_call(forward) -> None:
    """A full batch keeps a session's call waiting; that session's EndSession, queued behind it,
    takes no slot but must still wait for it (one call per session, in arrival order)."""
    events: list = []

    def end_session():
        events.append(("end", "s"))
        return
        yield  # a generator that runs no forward
    scheduler = make_scheduler(forward, max_batch=1)
    try:
        busy, _ = submit_held(scheduler, forward, "x", call("x", steps=2))
        first, _ = scheduler.submit("s", call("s", log=events))
        ended, _ = scheduler.submit("s", end_session, ends_session=True)
        forward.gate.set()
        busy.result(WAIT_S), first.result(WAIT_S), ended.result(WAIT_S)
        assert events == [("start", "s"), ("cleanup", "s"), ("end", "s")], events
    finally:
        scheduler.close()


def test_an_end_session_waits_for_the_calls_on_every_slot_of_its_session(forward) -> None:
    """A draft's branch slots are calls of their own (contract.slot_key), but an EndSession ends every
    slot: it ran beside a call on slot 1, freed that slot's pinned cache mid-call, and the call's end
    put the slot back among the sessions expected (_returns), so later forwards waited for it."""
    from specdec.contract import session_of, slot_key
    events: list[str] = []

    def end_session():
        events.append("EndSession ran")
        return
        yield  # a generator that runs no forward

    def slot_call(tag: str):
        def make():
            events.append(f"{tag} start")
            try:
                yield Step(tag, [0])
                yield Step(tag, [0])
            finally:
                events.append(f"{tag} end")
        return make
    scheduler = make_scheduler(forward)
    try:
        running, _ = submit_held(scheduler, forward, slot_key("s", 1), slot_call("slot1"))
        ended, _ = scheduler.submit("s", end_session, ends_session=True)
        assert scheduler.snapshot().waiting == 0  # it waits, but takes no slot: not queued
        forward.gate.set()
        running.result(WAIT_S), ended.result(WAIT_S)
        assert events == ["slot1 start", "slot1 end", "EndSession ran"], events
        assert not [key for key in scheduler._returns if session_of(key) == "s"]
        # A call on another slot that arrives after the EndSession runs after it (arrival order).
        events.clear()
        running, _ = submit_held(scheduler, forward, "s", slot_call("slot0"))
        ended, _ = scheduler.submit("s", end_session, ends_session=True)
        later, _ = scheduler.submit(slot_key("s", 2), slot_call("slot2"))
        forward.gate.set()
        running.result(WAIT_S), ended.result(WAIT_S), later.result(WAIT_S)
        assert events == ["slot0 start", "slot0 end", "EndSession ran", "slot2 start", "slot2 end"], events
    finally:
        scheduler.close()


def test_the_typical_gap_learns_from_returns_only() -> None:
    """An EndSession is not a return, nor is a call queued behind its own session's previous one
    (a gap of 0): neither moves the gap a new session is expected after."""
    from specdec.scheduler import _Job
    now = [100.0]
    scheduler = BatchScheduler(lambda steps: [0] * len(steps), BatchLimits(window_ms=5.0), clock=lambda: now[0])
    try:
        with scheduler._cond:
            scheduler._returns.update({"ending": _Return(99.0, 0.003), "queued": _Return(100.0, 0.003),
                                       "back": _Return(99.99, 0.003)})
            scheduler._waiting.extend([_Job("ending", call("ending"), None, 100.0, ends_session=True),
                                       _Job("queued", call("queued"), None, 99.5),   # before its last call ended
                                       _Job("back", call("back"), None, 100.0)])
            assert len(scheduler._admit()) == 3
            assert list(scheduler._recent_gaps) == [pytest.approx(0.01)]
            assert scheduler._returns["queued"].gap == 0.003  # its own gap not shrunk by the 0 either
            assert scheduler._returns["back"].gap == pytest.approx(0.7 * 0.003 + 0.3 * 0.01)
            scheduler._active.clear()
            # A call given up before it started is no return: its session is not expected back after it
            # (a new session's would be, after the typical gap; an old one's keeps what it had).
            scheduler._returns["old"] = _Return(99.0, 0.02)
            given_up = [_Job(sid, call(sid), 99.9, 99.8) for sid in ("new", "old")]  # expired unstarted
            now[0] = 100.5
        for job in given_up:
            scheduler._end_unstarted(job)
        with scheduler._cond:
            assert "new" not in scheduler._returns and scheduler._returns["old"] == _Return(99.0, 0.02)
    finally:
        scheduler.close()


def test_a_session_that_ended_is_not_waited_for(forward) -> None:
    scheduler = make_scheduler(forward, window_ms=50.0, shared_compute=True)
    try:
        scheduler.submit("s", call("s"))[0].result(WAIT_S)
        assert "s" in scheduler._returns  # a session comes back after a call, usually
        scheduler.submit("s\x001", call("s\x001"))[0].result(WAIT_S)  # a branch slot of "s" (contract.slot_key)
        scheduler.submit("other", call("other"))[0].result(WAIT_S)
        scheduler.submit("s", call("s"), ends_session=True)[0].result(WAIT_S)  # EndSession
        assert "s" not in scheduler._returns and "s\x001" not in scheduler._returns
        assert "other" in scheduler._returns
    finally:
        scheduler.close()


def test_utilisation_is_the_busy_fraction() -> None:
    now = [0.0]

    def forward(steps):  # each forward takes one (fake) second
        now[0] += 1.0
        return [0] * len(steps)
    scheduler = BatchScheduler(forward, BatchLimits(window_ms=0.0), clock=lambda: now[0], utilisation_window_s=5.0)
    try:
        for i in range(3):
            scheduler.submit(f"s{i}", call(f"s{i}"))[0].result(WAIT_S)
        busy = scheduler.snapshot()
        assert busy.utilisation == pytest.approx(1.0) and busy.active == 0 and busy.waiting == 0
        assert busy.mean_batch == pytest.approx(1.0)
        now[0] += 2.0  # t = 5: busy 3 s of the last 5
        assert scheduler.snapshot().utilisation == pytest.approx(0.6)
        now[0] += 5.0  # idle for a whole window
        assert scheduler.snapshot().utilisation == pytest.approx(0.0)
    finally:
        scheduler.close()


def test_cancelled_or_expired_waiting_calls_free_their_queue_place(forward) -> None:
    scheduler = make_scheduler(forward, max_batch=1, max_queue=1)
    try:
        running, _ = submit_held(scheduler, forward, "a", call("a", steps=2))
        queued, _ = scheduler.submit("b", call("b"))
        assert queued.cancel()
        forward.gate.set()
        running.result(WAIT_S)
        # "b" was dropped without running; the queue takes calls again.
        assert scheduler.submit("c", call("c"))[0].result(WAIT_S) == [1]
        assert not any("b" in batch for batch in forward.batches)
    finally:
        scheduler.close()


def prompt_call(session: str, tokens: int, logits_rows: int = 2, crop_to: int = 5):
    """One verify-like step: a long prompt plus drafts, the logits of the last `logits_rows` wanted."""
    from specdec.worker_core import ForwardStep

    def make():
        return (yield ForwardStep(session, list(range(tokens)), logits_rows, crop_to))
    return make


def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode(forward) -> None:
    scheduler = make_scheduler(forward, prefill_chunk=64)
    try:
        decode, _ = submit_held(scheduler, forward, "a", call("a", steps=5))
        prompt, load = scheduler.submit("p", prompt_call("p", 150))
        forward.gate.set()
        # The prompt's call resumes once, with the output of its last chunk: the rows that have logits.
        assert prompt.result(WAIT_S) == 22
        assert decode.result(WAIT_S) == [1] * 5
        assert [sorted(rows) for rows in forward.rows[:5]] == [[1], [1, 64], [1, 64], [1, 22], [1]]
        assert load.forwards == 3 and scheduler.prefill_chunks == 2
    finally:
        scheduler.close()


@pytest.mark.parametrize("decode_rows", [16, 33], ids=["decoders-fill-the-cap", "one-decoder-over-the-cap"])
def test_decode_steps_that_fill_the_row_cap_leave_a_waiting_prompt_its_chunk(forward, decode_rows: int) -> None:
    """Many sessions verifying many drafts can fill max_batch_tokens with decode rows alone. They
    leave a waiting prompt MIN_PROMPT_CHUNK (16) rows, so it moves every forward instead of waiting
    for the decoders to end (or for its deadline). Also where one decode step alone passes the cap
    (k + 1 = 33 rows against 32): the oldest filled every forward, and the prompt got no row while
    any decoder ran; it gets its 16 rows over the cap."""
    scheduler = make_scheduler(forward, max_batch=3, max_batch_tokens=32, prefill_chunk=16)
    try:
        first, _ = submit_held(scheduler, forward, "a", call("a", steps=12, tokens=decode_rows))
        other, _ = scheduler.submit("b", call("b", steps=12, tokens=decode_rows))
        prompt, _ = scheduler.submit("p", prompt_call("p", 100), timeout_s=WAIT_S)
        forward.gate.set()
        assert prompt.result(WAIT_S) == 20  # its last step: the 20 rows left after 5 chunks of 16
        assert first.result(WAIT_S) == [decode_rows] * 12 and other.result(WAIT_S) == [decode_rows] * 12
        with_prompt = [i for i, batch in enumerate(forward.batches) if "p" in batch]
        assert with_prompt == list(range(1, 7)), forward.batches  # from the first forward it could join
        assert all(sum(rows) <= max(32, decode_rows + 16) for rows in forward.rows)
        assert forward.rows[1:6] == [[decode_rows, 16]] * 5
        # The decoders keep moving: one of them beside each of the prompt's 16-row chunks (the
        # 20-row rest runs as a decode step, the oldest, and alone: with either decoder it would
        # pass the cap).
        assert all(set(batch) - {"p"} for batch in forward.batches[1:6])
        assert forward.batches[6] == ["p"] and forward.rows[6] == [20]
    finally:
        scheduler.close()


def test_calls_report_the_prompt_rows_that_shared_their_forwards(forward) -> None:
    """The pair guard takes other sessions' prompts out of a steady round's time: each call reports
    the prompt rows of its forwards, chunks included (the 22-row rest of a 150-row prompt is short
    enough to look like a decode step, and still counts as prompt)."""
    scheduler = make_scheduler(forward, prefill_chunk=64)
    try:
        decode, decode_load = submit_held(scheduler, forward, "a", call("a", steps=5))
        prompt, prompt_load = scheduler.submit("p", prompt_call("p", 150))
        forward.gate.set()
        prompt.result(WAIT_S), decode.result(WAIT_S)
        assert [sorted(rows) for rows in forward.rows[:5]] == [[1], [1, 64], [1, 64], [1, 22], [1]]
        assert decode_load.forwards == 5 and decode_load.batch_prompt_rows == 150
        assert decode_load.mean_prompt_rows == pytest.approx(30.0)
        assert decode_load.batch_rows == 155
        assert prompt_load.batch_prompt_rows == 150  # its own
        after, after_load = scheduler.submit("a", call("a", steps=2))
        after.result(WAIT_S)
        assert after_load.batch_prompt_rows == 0 and after_load.mean_prompt_rows == 0.0  # decode alone
    finally:
        scheduler.close()


def test_a_prompt_alone_or_with_chunking_off_runs_whole(forward) -> None:
    scheduler = make_scheduler(forward, prefill_chunk=64)
    try:
        assert scheduler.submit("p", prompt_call("p", 150))[0].result(WAIT_S) == 150
        assert forward.rows == [[150]] and scheduler.prefill_chunks == 0
    finally:
        scheduler.close()
    forward = FakeForward()
    scheduler = make_scheduler(forward, prefill_chunk=0)
    try:
        decode, _ = submit_held(scheduler, forward, "a", call("a", steps=3))
        prompt, _ = scheduler.submit("p", prompt_call("p", 150))
        forward.gate.set()
        assert prompt.result(WAIT_S) == 150 and decode.result(WAIT_S) == [1] * 3
        assert [1, 150] in forward.rows and scheduler.prefill_chunks == 0
    finally:
        scheduler.close()


def test_a_call_cancelled_between_prefill_chunks_spends_no_more_forwards() -> None:
    class PausingForward(FakeForward):
        """Blocks the 4th forward until resumed: the test cancels while the prompt is half fed."""
        def __init__(self) -> None:
            super().__init__()
            self.paused, self.resume = threading.Event(), threading.Event()

        def __call__(self, steps: list) -> list[int]:
            if len(self.rows) == 3:
                self.paused.set()
                assert self.resume.wait(WAIT_S)
            return super().__call__(steps)

    forward = PausingForward()
    scheduler = make_scheduler(forward, prefill_chunk=8)
    try:
        decode, _ = submit_held(scheduler, forward, "a", call("a", steps=8))
        log: list = []

        def logged_prompt():
            try:
                return (yield from prompt_call("p", 400)())
            finally:
                log.append("cleanup")
        prompt, load = scheduler.submit("p", logged_prompt)
        forward.gate.set()
        assert forward.paused.wait(WAIT_S)
        assert prompt.cancel()
        forward.resume.set()
        assert decode.result(WAIT_S) == [1] * 8
        assert [sorted(rows) for rows in forward.rows[:4]] == [[1], [1, 8], [1, 8], [1, 8]]
        assert all(rows == [1] for rows in forward.rows[4:]), forward.rows
        assert log == ["cleanup"] and scheduler.prefill_chunks == 3
    finally:
        scheduler.close()


def test_prompts_arriving_together_share_one_prompt_budget_per_forward(forward) -> None:
    scheduler = make_scheduler(forward, prefill_chunk=64)
    try:
        decode, _ = submit_held(scheduler, forward, "a", call("a", steps=4))
        first, _ = scheduler.submit("p", prompt_call("p", 49))
        second, _ = scheduler.submit("q", prompt_call("q", 49))
        forward.gate.set()
        assert first.result(WAIT_S) == 49 and second.result(WAIT_S) == 34 and decode.result(WAIT_S) == [1] * 4
        # 64 prompt rows per forward between them: p whole, q's first 15 rows, then q's other 34.
        assert [sorted(rows) for rows in forward.rows[:3]] == [[1], [1, 15, 49], [1, 34]]
        assert scheduler.prefill_chunks == 1
    finally:
        scheduler.close()


def test_the_prompt_budget_comes_from_the_workers_own_forward_costs() -> None:
    from specdec.scheduler import prefill_chunk_for
    # A CPU: every row costs (40 ms a row over a 1 s floor). 8 decode rows take 1.32 s; with 32 prompt
    # rows 2.6 s (under twice that), with 64 rows 3.9 s (over): 32.
    cpu = [(r, 1000.0 + 40.0 * r) for r in (1, 9, 16, 32, 64)]
    assert prefill_chunk_for(cpu, decode_rows=8, cap=256) == 32
    # A GPU: nearly flat, so the cap (the forward's row budget), extrapolated past 64 rows.
    gpu = [(1, 10.0), (9, 10.5), (16, 11.0), (32, 11.5), (64, 12.0)]
    assert prefill_chunk_for(gpu, decode_rows=8, cap=256) == 256
    assert prefill_chunk_for(gpu, decode_rows=8, cap=100) == 64
    # Steeper than twice at any size: the floor, a decode step's size.
    assert prefill_chunk_for([(1, 1.0), (16, 100.0), (64, 400.0)], decode_rows=1, cap=256) == 16
    # Nothing measured at 16 rows or more: nothing to choose from.
    assert prefill_chunk_for([(1, 10.0), (9, 12.0)], 8, 256) is None
    assert prefill_chunk_for([], 8, 256) is None


@pytest.mark.parametrize("decode_tokens, chunk", [(1, 16), (9, 32)])
def test_the_prompt_budget_grows_with_the_decode_rows_beside_it(forward, decode_tokens: int, chunk: int) -> None:
    """Beside two 1-row decode steps a prompt gets the startup budget (16 rows); beside two 9-row
    verifies (speculating sessions) the most rows that at most double their forward on the
    measured curve: 18 rows cost 1.72 s, with 32 prompt rows 3.0 s (under 3.44), with 64 4.3 s (over)."""
    cpu = tuple((r, 1000.0 + 40.0 * r) for r in (1, 9, 16, 32, 64))
    scheduler = make_scheduler(forward, max_batch=3, prefill_chunk=16, prefill_curve=cpu)
    try:
        first, _ = submit_held(scheduler, forward, "a", call("a", steps=2, tokens=decode_tokens))
        second, _ = scheduler.submit("b", call("b", steps=2, tokens=decode_tokens))
        prompt, _ = scheduler.submit("p", prompt_call("p", 100))
        forward.gate.set()
        first.result(WAIT_S), second.result(WAIT_S), prompt.result(WAIT_S)
        assert sorted(forward.rows[1]) == sorted([decode_tokens, decode_tokens, chunk]), forward.rows
    finally:
        scheduler.close()


def test_an_itl_bound_sizes_the_prompt_rows_against_one_step_alone() -> None:
    from specdec.scheduler import itl_limit_ms, prefill_chunk_within
    # The CPU curve above: one 1-row step alone costs 1040 ms, so a forward may cost 2080 at factor 2.
    cpu = [(r, 1000.0 + 40.0 * r) for r in (1, 9, 16, 32, 64)]
    assert itl_limit_ms(cpu, 1, 2.0) == 2080.0
    assert prefill_chunk_within(cpu, 2, itl_limit_ms(cpu, 1, 2.0), cap=256) == 24  # 26 rows: 2040 ms
    assert prefill_chunk_within(cpu, 2, itl_limit_ms(cpu, 1, 3.0), cap=256) == 48  # 50 rows: 3000 ms
    # Two 9-row verifies: 1360 ms alone, so 2720: 18 + 24 rows cost 2680, 18 + 32 cost 3000.
    assert prefill_chunk_within(cpu, 18, itl_limit_ms(cpu, 9, 2.0), cap=256) == 24
    # Eight 1-row steps already cost 1320 ms; 16 prompt rows (1960) fit, 24 (2280) do not.
    assert prefill_chunk_within(cpu, 8, itl_limit_ms(cpu, 1, 2.0), cap=256) == 16
    # The decode rows alone break the bound: the floor, so that prompts still move.
    assert prefill_chunk_within(cpu, 40, itl_limit_ms(cpu, 1, 2.0), cap=256) == 16
    # A flat (GPU-like) curve: up to the forward's row cap.
    gpu = [(1, 10.0), (9, 10.5), (16, 11.0), (32, 11.5), (64, 12.0)]
    assert prefill_chunk_within(gpu, 8, itl_limit_ms(gpu, 1, 2.0), cap=256) == 248


def test_an_itl_bound_counts_the_streams_gap_between_calls() -> None:
    """A stream's cycle alone is its forward and its gap between calls (a speculating session drafts
    in it): at factor 2 the forward may also take the gap once more, per step of the call."""
    from specdec.scheduler import itl_limit_ms, prefill_chunk_within
    cpu = [(r, 1000.0 + 40.0 * r) for r in (1, 9, 16, 32, 64)]
    assert itl_limit_ms(cpu, 9, 2.0, gap_ms_per_step=800.0) == 2720.0 + 800.0
    assert itl_limit_ms(cpu, 9, 3.0, gap_ms_per_step=800.0) == 3 * 1360.0 + 2 * 800.0
    assert itl_limit_ms(cpu, 9, 1.0, gap_ms_per_step=800.0) == 1360.0  # factor 1: no prompt row fits either way
    # Two 9-row verifies with 800 ms of drafting between calls: 3520 ms, so 18 + 48 rows (3640) do not
    # fit and 18 + 40 (3320) do, against 24 rows without the gap.
    assert prefill_chunk_within(cpu, 18, itl_limit_ms(cpu, 9, 2.0, 800.0), cap=256) == 40


def test_with_an_itl_bound_the_rest_of_a_chunked_prompt_counts_too(forward) -> None:
    """Without the bound a prompt's rest of up to 33 rows runs as a decode step, whole; with it the
    rest is held to the budget as well, so no forward beside the decode steps costs more than twice
    one step alone (2080 ms on this curve: 26 rows)."""
    cpu = tuple((r, 1000.0 + 40.0 * r) for r in (1, 9, 16, 32, 64))
    scheduler = make_scheduler(forward, max_batch=3, prefill_chunk=16, prefill_curve=cpu, prefill_itl_factor=2.0)
    try:
        first, _ = submit_held(scheduler, forward, "a", call("a", steps=4))
        second, _ = scheduler.submit("b", call("b", steps=4))
        prompt, _ = scheduler.submit("p", prompt_call("p", 50))
        forward.gate.set()
        first.result(WAIT_S), second.result(WAIT_S), prompt.result(WAIT_S)
        # 50 rows: 24 now, then 24 of the 26-row rest (2 are logits rows), then the last 2.
        assert [sorted(rows) for rows in forward.rows[:4]] == [[1], [1, 1, 24], [1, 1, 24], [1, 1, 2]], forward.rows
    finally:
        scheduler.close()


def test_with_an_itl_bound_prompts_with_no_decode_step_beside_them_run_whole(forward) -> None:
    """The bound protects decode steps; where only prompts (and a chunked prompt's rest) are ready
    there is none, and they run whole, as without the bound."""
    cpu = tuple((r, 1000.0 + 40.0 * r) for r in (1, 9, 16, 32, 64))
    scheduler = make_scheduler(forward, max_batch=3, prefill_chunk=16, prefill_curve=cpu, prefill_itl_factor=2.0)
    try:
        decode, _ = submit_held(scheduler, forward, "a", call("a", steps=2))
        first, _ = scheduler.submit("p", prompt_call("p", 50))
        second, _ = scheduler.submit("q", prompt_call("q", 60))
        forward.gate.set()
        decode.result(WAIT_S), first.result(WAIT_S), second.result(WAIT_S)
        # Beside a's last step: p's first 24 rows (q waits: the budget is spent); then p's 26-row
        # rest and q whole, with nobody decoding.
        assert [sorted(rows) for rows in forward.rows[:3]] == [[1], [1, 24], [26, 60]], forward.rows
    finally:
        scheduler.close()


def test_with_an_itl_bound_a_speculating_sessions_gap_buys_prompt_rows(forward) -> None:
    """The bound is on each stream's whole cycle: a session that usually spends 800 ms between its
    calls (drafting) lets a prompt take more rows of the forward beside its verify than one that
    comes straight back; the session's gap counts at most the typical gap of all sessions (a pause
    between a chat's turns is no time its tokens wait), divided over its last call's steps."""
    cpu = tuple((r, 1000.0 + 40.0 * r) for r in (1, 9, 16, 32, 64))

    def first_prompt_chunk(gap_s: float, typical_s: float, steps_per_call: int = 1, relief: bool = True) -> int:
        fwd = FakeForward()
        scheduler = make_scheduler(fwd, max_batch=3, prefill_chunk=16, prefill_curve=cpu, prefill_itl_factor=2.0,
                                   itl_gap_relief=relief)
        try:
            with scheduler._cond:  # (the model thread is idle; the lock keeps it so)
                # Its call comes `gap_s` after its last, which took part in `steps_per_call` forwards.
                scheduler._returns["a"] = _Return(time.monotonic() - gap_s, gap_s, steps_per_call)
                scheduler._recent_gaps.extend([typical_s] * 3)
            verify, _ = submit_held(scheduler, fwd, "a", call("a", steps=2, tokens=9))
            prompt, _ = scheduler.submit("p", prompt_call("p", 100))
            fwd.gate.set()
            verify.result(WAIT_S), prompt.result(WAIT_S)
            assert sorted(fwd.rows[1])[0] == 9, fwd.rows
            return max(fwd.rows[1])  # the prompt's rows beside the 9-row verify
        finally:
            scheduler.close()

    # One 9-row verify alone: 1360 ms, so at factor 2 the forward may cost 2720 plus the gap.
    assert first_prompt_chunk(gap_s=0.003, typical_s=0.003) == 32  # 9 + 32 rows: 2640 ms (9 + 40: 2960)
    assert first_prompt_chunk(gap_s=0.8, typical_s=0.8) == 48       # 3520 ms: 9 + 48 rows 3280, 9 + 56 3600
    assert first_prompt_chunk(gap_s=10.0, typical_s=0.8) == 48      # a long pause counts as the typical gap
    assert first_prompt_chunk(gap_s=0.8, typical_s=0.8, steps_per_call=2) == 40  # 400 ms per step: 3120
    # The draft worker takes no relief: the target already takes the draft's time as its own.
    assert first_prompt_chunk(gap_s=0.8, typical_s=0.8, relief=False) == 32


def test_a_sessions_steps_per_call_are_learned_from_its_calls_and_dropped_with_it(forward) -> None:
    """The ITL bound spreads a session's gap over the forwards its last call took part in (a draft's
    call runs one per drafted token); an EndSession forgets the session and its branch slots."""
    from specdec.contract import slot_key
    scheduler = make_scheduler(forward)
    try:
        scheduler.submit("s", call("s", steps=3))[0].result(WAIT_S)
        scheduler.submit(slot_key("s", 1), call(slot_key("s", 1), steps=2))[0].result(WAIT_S)
        scheduler.submit("other", call("other", steps=1))[0].result(WAIT_S)
        assert {sid: r.steps for sid, r in scheduler._returns.items()} == {"s": 3, slot_key("s", 1): 2, "other": 1}
        scheduler.submit("s", lambda: (yield from ()), ends_session=True)[0].result(WAIT_S)
        assert {sid: r.steps for sid, r in scheduler._returns.items()} == {"other": 1}
    finally:
        scheduler.close()


def test_prefill_chunk_flag(caplog) -> None:
    import argparse

    from specdec.contract import CostCurve
    from specdec.worker_server import AUTO_PREFILL_CHUNK_FALLBACK, add_worker_args, batch_limits
    parser = argparse.ArgumentParser()
    add_worker_args(parser, "tiny:seed=0")
    auto = parser.parse_args([])
    assert auto.prefill_chunk == "auto"
    assert batch_limits(auto).prefill_chunk == AUTO_PREFILL_CHUNK_FALLBACK  # calibration skipped
    measured = CostCurve(tuple((r, 64, 1000.0 + 40.0 * r) for r in (1, 9, 16, 32, 64)))
    assert batch_limits(auto, measured).prefill_chunk == 32
    assert batch_limits(auto, measured).prefill_curve == measured.rows_curve()  # sized per forward
    assert batch_limits(auto).prefill_curve == ()
    assert batch_limits(parser.parse_args(["--prefill-chunk", "0"]), measured).prefill_chunk == 0
    assert batch_limits(parser.parse_args(["--prefill-chunk", "48"]), measured).prefill_curve == ()  # fixed
    with pytest.raises(SystemExit):
        batch_limits(parser.parse_args(["--prefill-chunk", "lots"]))
    assert batch_limits(auto, measured).prefill_itl_factor == 2.0  # on by default with auto
    assert batch_limits(parser.parse_args(["--prefill-itl-factor", "3"]), measured).prefill_itl_factor == 3.0
    assert batch_limits(parser.parse_args(["--prefill-itl-factor", "0"]), measured).prefill_itl_factor == 0.0
    assert batch_limits(parser.parse_args(["--prefill-chunk", "48"]), measured).prefill_itl_factor == 0.0  # fixed
    assert batch_limits(auto, measured).itl_gap_relief and not batch_limits(auto, measured, "draft").itl_gap_relief
    with caplog.at_level(logging.WARNING, logger="specdec.worker_server"):
        assert batch_limits(parser.parse_args(["--prefill-itl-factor", "2"])).prefill_curve == ()
        batch_limits(auto)  # the default asks for nothing: no warning where nothing was measured
    assert [r.getMessage() for r in caplog.records] == [
        "--prefill-itl-factor 2.00 has no effect: no forward of 16 rows or more was measured"]
    with pytest.raises(SystemExit):  # a bound below 1 would leave no room for any prompt row
        batch_limits(parser.parse_args(["--prefill-itl-factor", "0.5"]), measured)
    with pytest.raises(ValueError):
        BatchLimits(prefill_itl_factor=0.5).validate()
    with pytest.raises(SystemExit):  # a bound needs the measured curve
        batch_limits(parser.parse_args(["--prefill-chunk", "48", "--prefill-itl-factor", "2"]), measured)
    with pytest.raises(SystemExit):
        batch_limits(parser.parse_args(["--prefill-itl-factor", "-1"]), measured)


def test_shared_compute_flag_and_the_local_services_default() -> None:
    import argparse

    from specdec.tools.demo import cpu_list, shares_compute, worker_flags
    from specdec.worker_server import add_worker_args, batch_limits
    parser = argparse.ArgumentParser()
    add_worker_args(parser, "tiny:seed=0")
    assert batch_limits(parser.parse_args([])).shared_compute is False  # separate devices: the safe default
    assert batch_limits(parser.parse_args(["--shared-compute"])).shared_compute is True
    assert cpu_list("0") == {0} and cpu_list("0-2,5") == {0, 1, 2, 5}
    # demo / bench / loadtest start both workers on one machine: unpinned they share its cores.
    assert shares_compute({})
    assert shares_compute({"target": "0"})                       # the draft may run anywhere
    assert shares_compute({"target": "0-1", "draft": "1"})       # overlapping
    assert not shares_compute({"target": "0", "draft": "1"})     # pinned apart: two devices emulated
    assert cpu_list("0-6:2") == {0, 2, 4, 6}
    assert not shares_compute({"target": "0-6:2", "draft": "1-7:2"})
    # What local_services gives both workers.
    assert worker_flags(0, [], {}, None) == ["--shared-compute"]
    assert worker_flags(1, ["--max-batch", "4"], {"target": "0", "draft": "1"}, None) == ["--threads", "1",
                                                                                          "--max-batch", "4"]
    assert worker_flags(0, ["--shared-compute"], {}, False) == []  # the caller's override wins
    assert worker_flags(0, [], {"target": "0", "draft": "1"}, True) == ["--shared-compute"]


def test_session_store_flags_are_checked_before_the_model_loads() -> None:
    """--session-ttl-s 0 made every call fail (the new session expired before its pin: INTERNAL)."""
    import argparse

    from specdec.worker_server import add_worker_args, check_worker_flags, store_limits
    parser = argparse.ArgumentParser()
    add_worker_args(parser, "tiny:seed=0")
    assert store_limits(parser.parse_args([])).ttl_s == 600.0
    for flags in (["--session-ttl-s", "0"], ["--cache-budget-mb", "-1"], ["--max-sessions", "0"],
                  ["--calibration-s", "nan"], ["--max-batch", "0"], ["--max-queue", "-1"], ["--batch-window-ms", "-5"],
                  ["--max-batch-tokens", "0"], ["--prefill-chunk", "x"], ["--prefill-chunk", "\u00b2"],
                  ["--prefill-itl-factor", "0.5"], ["--prefill-itl-factor", "2", "--prefill-chunk", "32"],
                  ["--hang-timeout-s", "-1"], ["--hang-timeout-s", "0.001"], ["--hang-timeout-s", "nan"],
                  ["--hang-timeout-s", "inf"]):
        with pytest.raises(SystemExit, match="must be"):
            check_worker_flags(parser.parse_args(flags))
    for hang in ("0", "1", "600"):  # off, the least, the default
        check_worker_flags(parser.parse_args(["--hang-timeout-s", hang]))
    # TLS half given (mTLS meant: a CA and a certificate, no key) served plaintext with no client auth.
    for flags in (["--tls-cert", "c.pem"], ["--tls-key", "k.pem"], ["--tls-client-ca", "ca.pem", "--tls-cert", "c.pem"]):
        with pytest.raises(SystemExit, match="needs"):
            check_worker_flags(parser.parse_args(flags))
    check_worker_flags(parser.parse_args(["--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-client-ca", "ca.pem"]))


@pytest.mark.parametrize("max_k", ["0", "-1", "33", "100000"])
def test_worker_max_k_is_checked_before_the_model_loads(max_k: str) -> None:
    """--max-k was never checked: a negative one was taken, a huge one forced a calibration forward
    of that many rows."""
    import argparse

    from specdec.worker_server import add_worker_args, check_worker_flags
    parser = argparse.ArgumentParser()
    add_worker_args(parser, "tiny:seed=0")
    with pytest.raises(SystemExit, match=r"--max-k must be in \[1, 32\]"):
        check_worker_flags(parser.parse_args(["--max-k", max_k]))
    for fine in ("1", "8", "32"):
        check_worker_flags(parser.parse_args(["--max-k", fine]))


def test_calls_given_up_while_waiting_leave_the_queue_and_end_sessions_are_bounded(forward) -> None:
    """During a long forward, calls whose deadline passed (or that were cancelled) stayed queued,
    uncounted, until the next admission: thousands piled up and each submit scanned them all. They
    leave at the next submit, failed DEADLINE_EXCEEDED. EndSessions (never refused for load) stop at
    a hard bound too."""
    from specdec.errors import DeadlineExceeded
    from specdec.scheduler import MAX_WAITING_ENDS, QueueFull
    scheduler = make_scheduler(forward, max_queue=2, max_batch=1)
    try:
        blocker, _ = submit_held(scheduler, forward, "x", call("x"))
        late = []
        for i in range(50):
            late.append(scheduler.submit(f"s{i}", call(f"s{i}"), timeout_s=0.001)[0])
            time.sleep(0.003)  # past its deadline before the next one arrives
        cancelled, _ = scheduler.submit("c", call("c"))
        cancelled.cancel()
        kept, _ = scheduler.submit("kept", call("kept"))
        assert scheduler.waiting_calls == 1
        for future in late:
            with pytest.raises(DeadlineExceeded):
                future.result(0)
        assert scheduler.expired == 50
        ends = 0
        with pytest.raises(QueueFull):
            while ends <= MAX_WAITING_ENDS + 10:
                scheduler.submit(f"e{ends}", call(f"e{ends}"), ends_session=True)
                ends += 1
        assert ends == MAX_WAITING_ENDS + 2 + 1 - 1  # max_queue + max_batch + MAX_WAITING_ENDS, "kept" among them
        forward.gate.set()
        blocker.result(WAIT_S), kept.result(WAIT_S)
    finally:
        scheduler.close()

