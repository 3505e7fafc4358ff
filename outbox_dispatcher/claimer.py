"""Claims batches of pending rows and waits for new ones (notification, poll, or stop)."""

from __future__ import annotations

import asyncio

import asyncpg

from outbox_dispatcher.migrations import lock_key
from outbox_dispatcher.models import Batch, OutboxRecord
from outbox_dispatcher.settings import DeadLetterPolicy, Settings
from outbox_dispatcher.sql import Queries


class Claimer:
    def __init__(
        self, pool: asyncpg.Pool, queries: Queries, settings: Settings, owner: str
    ) -> None:
        self._pool = pool
        self._queries = queries
        self._owner = owner
        s = settings
        self._args = (
            s.batch_size,
            s.scan_limit,
            owner,
            s.lease_seconds,
            lock_key(s.db_schema, s.table),
            s.dead_letter_policy is DeadLetterPolicy.BLOCK,
            s.max_attempts,
        )

    async def claim(self) -> Batch | None:
        """Lease up to batch_size rows; one round trip, one short transaction."""
        rows = await self._pool.fetch(self._queries.claim, *self._args)
        if not rows:
            return None
        return Batch(rows[0]["lease_token"], [OutboxRecord.from_row(row) for row in rows])


async def wait_for_work(wake: asyncio.Event, stop: asyncio.Event, seconds: float) -> None:
    """Return when a notification arrives, the dispatcher stops, or the poll interval passes."""
    waiters = [asyncio.ensure_future(wake.wait()), asyncio.ensure_future(stop.wait())]
    try:
        await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
