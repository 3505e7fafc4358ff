"""Waiting for new rows: a hint from the LISTEN connection, a poll, or the stop; and the
announcement that asks writers for that hint only while someone waits."""

from __future__ import annotations

import asyncio
from collections import deque

import structlog

from outbox_dispatcher.store import DispatchStore, db

log = structlog.get_logger(__name__)


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


class Waiting:
    """Tells writers' trigger that this dispatcher waits for a wake-up, so that writers pay for
    a notification only while someone listens for it. Best effort: a lost announcement only
    means the next poll finds the rows."""

    def __init__(self, store: DispatchStore, owner: str, ttl: float) -> None:
        self._store = store
        self._owner = owner
        self._ttl = ttl
        self._until = 0.0  # this process's clock; 0: not announced

    async def announce(self) -> bool:
        """Announce (or refresh) the wait; True if it was not announced a moment ago, so that the
        caller claims once more (rows committed before the announcement sent no notification)."""
        now = asyncio.get_running_loop().time()
        if now < self._until - self._ttl / 2:
            return False
        try:
            await self._store.waiting_announce(owner=self._owner, seconds=self._ttl)
        except db.RETRIABLE_ERRORS as exc:
            log.debug("waiting_announce_failed", error=repr(exc))
            return False
        fresh = now >= self._until
        self._until = now + self._ttl
        return fresh

    @property
    def ttl(self) -> float:
        return self._ttl

    def announced(self) -> None:
        """Announced by someone else for `ttl` from now (the idle probe's batch at an outbox's
        first look, dispatch/probe.py): its next `announce` is a refresh, not fresh."""
        self._until = asyncio.get_running_loop().time() + self._ttl

    async def withdraw(self) -> None:
        """Busy again: writers can stop notifying (a no-op when nothing was announced)."""
        if not self._until:
            return
        self._until = 0.0
        try:
            await self._store.waiting_withdraw(owner=self._owner)
        except db.RETRIABLE_ERRORS as exc:
            log.debug("waiting_withdraw_failed", error=repr(exc))
