"""Admission control: a rate limit (asyncio-throttle) and a concurrency limit with a bounded queue.

Over capacity the caller gets RESOURCE_EXHAUSTED at once instead of an ever-growing queue.
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator

from asyncio_throttle import Throttler

from specdec.errors import CapacityExceeded


class Admission:
    def __init__(self, max_concurrent: int, max_queue: int, rate_per_s: float = 0.0) -> None:
        self.check_limits(max_concurrent, max_queue, rate_per_s)
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        self._semaphore = asyncio.Semaphore(max_concurrent)
        self._throttler = None
        if rate_per_s > 0:
            # ceil(rate) starts per ceil(rate) / rate seconds: the rate exactly, fractional ones too
            # (int(0.5) = 0 starts blocked every request for good), with bursts of up to ceil(rate).
            burst = math.ceil(rate_per_s)
            self._throttler = Throttler(rate_limit=burst, period=burst / rate_per_s)
        self.running = 0
        self.waiting = 0
        self.rejected = 0
        self.mean_request_s = 1.0  # decayed mean time a request holds its slot (a guess until one ends)

    @staticmethod
    def check_limits(max_concurrent: int, max_queue: int, rate_per_s: float) -> None:
        """ValueError unless the limits can admit anything (the CLI checks them before startup)."""
        if max_concurrent < 1 or max_queue < 0 or not (math.isfinite(rate_per_s) and rate_per_s >= 0):
            raise ValueError(f"admission limits must be max_concurrent >= 1, max_queue >= 0 and a finite "
                             f"rate >= 0 (0: off), got {max_concurrent}, {max_queue} and {rate_per_s}")

    def retry_after_ms(self) -> int:
        """About when a place in the queue frees: one of max_concurrent requests ends every mean
        request time / max_concurrent (at least 100 ms, at most 60 s)."""
        return int(min(60_000.0, max(100.0, 1000.0 * self.mean_request_s / max(1, self.max_concurrent))))

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        # Refused where it would wait behind a full queue: requests held back by the rate limit wait
        # as well as those beyond max_concurrent (with a rate limit the running count may never
        # reach the limit, and the queue grew without bound).
        if self.waiting >= self.max_queue and (self.running >= self.max_concurrent or self.waiting > 0):
            self.rejected += 1
            raise CapacityExceeded(f"server busy: {self.running} requests running and {self.waiting} queued "
                                   f"(limits {self.max_concurrent} + {self.max_queue}); retry with backoff",
                                   self.retry_after_ms())
        self.waiting += 1
        try:
            if self._throttler is not None:
                async with self._throttler:
                    pass
            await self._semaphore.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        started = time.monotonic()
        try:
            yield
        finally:
            self.running -= 1
            self._semaphore.release()
            self.mean_request_s += 0.2 * (time.monotonic() - started - self.mean_request_s)
