"""Records the outcome of a published batch: one statement, fenced by the lease token."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import asyncpg
import structlog

from outbox_dispatcher import db
from outbox_dispatcher.models import Batch, Outcome, Result
from outbox_dispatcher.sql import Queries

log = structlog.get_logger(__name__)


class Marker:
    def __init__(self, pool: asyncpg.Pool, queries: Queries, retry_for: float) -> None:
        self._pool = pool
        self._queries = queries
        self._retry_for = retry_for

    async def settle(self, batch: Batch, results: Sequence[Result]) -> int:
        """Write every result; returns how many rows were still ours. Retries while the database
        is briefly away: a mark that never lands means a re-publish, not a loss."""
        ids = [r.id for r in batch.records]
        args: tuple[object, ...]
        if all(res.outcome is Outcome.PUBLISHED for res in results):
            query, args = self._queries.mark_published, (ids, batch.token)
        else:
            query = self._queries.settle
            args = (
                ids,
                [res.outcome.value for res in results],
                [res.error for res in results],
                [res.delay for res in results],
                [int(res.counted) for res in results],
                batch.token,
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._retry_for
        pause = 0.1
        while True:
            try:
                rows = await db.fetch(self._pool, query, *args)
                break
            except db.RETRIABLE_ERRORS as exc:
                if loop.time() + pause > deadline:
                    log.error(
                        "settle_failed",
                        rows=len(batch.records),
                        error=repr(exc),
                        consequence="the leases will expire and the rows be published again",
                    )
                    return 0
                log.warning("settle_retrying", rows=len(batch.records), error=repr(exc))
                await asyncio.sleep(pause)
                pause = min(pause * 2, 2.0)
        if len(rows) < len(batch.records):
            log.warning(
                "lease_lost",
                rows=len(batch.records) - len(rows),
                consequence=(
                    "another dispatcher took these rows over after the lease expired; they are "
                    "published again with the same event id"
                ),
            )
        return len(rows)

    async def settle_shielded(self, batch: Batch, results: Sequence[Result]) -> int:
        """Settle even if the caller is cancelled: a dropped mark after an ack is a duplicate."""
        task = asyncio.ensure_future(self.settle(batch, results))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await task
            raise
