"""Waiting for new rows: a hint from the LISTEN connection, a poll, or the stop."""

from __future__ import annotations

import asyncio
from collections import deque


class Wakeup:
    """Hands each new-rows hint to one idle claim loop, not to all of them: waking every loop on
    every notification makes them all claim at once and fight over the same keys, which costs
    the database more than the rows are worth. A loop that found a full batch passes the hint on
    (there is likely more). A hint that finds no loop waiting is kept for the next one."""

    def __init__(self) -> None:
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._pending = False

    def notify(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._pending = True

    async def wait(self, stop: asyncio.Event, seconds: float) -> None:
        """Return on a hint, on stop, or after `seconds` (the polling fallback)."""
        if self._pending:
            self._pending = False
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        await wait_any(waiter, stop, seconds)
        if not waiter.done():
            waiter.cancel()


async def wait_any(future: asyncio.Future[None], stop: asyncio.Event, seconds: float) -> None:
    stopped: asyncio.Future[None] = asyncio.ensure_future(_wait(stop))
    try:
        await asyncio.wait({future, stopped}, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()


async def _wait(event: asyncio.Event) -> None:
    await event.wait()


async def pause(stop: asyncio.Event, seconds: float) -> None:
    """Sleep, but wake up for a shutdown."""
    await wait_any(asyncio.get_running_loop().create_future(), stop, seconds)
