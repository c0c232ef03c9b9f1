"""Admission control: a rate limit (asyncio-throttle) and a concurrency limit with a bounded queue.

Over capacity the caller gets RESOURCE_EXHAUSTED at once instead of an ever-growing queue.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from asyncio_throttle import Throttler

from specdec.errors import CapacityExceeded


class Admission:
    def __init__(self, max_concurrent: int, max_queue: int, rate_per_s: float = 0.0) -> None:
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        self._semaphore = asyncio.Semaphore(max_concurrent)
        self._throttler = Throttler(rate_limit=int(rate_per_s), period=1.0) if rate_per_s > 0 else None
        self.running = 0
        self.waiting = 0
        self.rejected = 0

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if self.running >= self.max_concurrent and self.waiting >= self.max_queue:
            self.rejected += 1
            raise CapacityExceeded(f"server busy: {self.running} requests running and {self.waiting} queued "
                                   f"(limits {self.max_concurrent} + {self.max_queue}); retry with backoff")
        self.waiting += 1
        try:
            if self._throttler is not None:
                async with self._throttler:
                    pass
            await self._semaphore.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._semaphore.release()
