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
    def __init__(
        self,
        pool: asyncpg.Pool,
        queries: Queries,
        retry_for: float,
        *,
        delete_on_publish: bool = False,
    ) -> None:
        self._pool = pool
        self._queries = queries
        self._retry_for = retry_for
        self._delete = delete_on_publish

    def _statements(
        self, batch: Batch, results: Sequence[Result]
    ) -> list[tuple[str, tuple[object, ...]]]:
        """The statements that record `results`: usually one (every row acknowledged)."""
        pairs = list(zip((r.id for r in batch.records), results, strict=True))
        published = [row_id for row_id, res in pairs if res.outcome is Outcome.PUBLISHED]
        rest = pairs
        statements: list[tuple[str, tuple[object, ...]]] = []
        if published and (self._delete or len(published) == len(pairs)):
            query = self._queries.delete_published if self._delete else self._queries.mark_published
            statements.append((query, (published, batch.token)))
            rest = [(row_id, res) for row_id, res in pairs if res.outcome is not Outcome.PUBLISHED]
        if rest:
            statements.append(
                (
                    self._queries.settle,
                    (
                        [row_id for row_id, _ in rest],
                        [res.outcome.value for _, res in rest],
                        [res.error for _, res in rest],
                        [res.delay for _, res in rest],
                        [int(res.counted) for _, res in rest],
                        batch.token,
                    ),
                )
            )
        return statements

    async def settle(self, batch: Batch, results: Sequence[Result]) -> int:
        """Write every result; returns how many rows were still ours. Retries while the database
        is briefly away: a mark that never lands means a re-publish, not a loss."""
        settled = 0
        failed = False
        for query, args in self._statements(batch, results):
            changed = await self._execute(query, args, len(batch.records))
            if changed is None:
                failed = True  # settle_failed said what happens; the lease was not lost
            else:
                settled += changed
        if not failed and settled < len(batch.records):
            log.warning(
                "lease_lost",
                rows=len(batch.records) - settled,
                consequence=(
                    "another dispatcher took these rows over after the lease expired; they are "
                    "published again with the same event id"
                ),
            )
        return settled

    async def _execute(self, query: str, args: tuple[object, ...], rows: int) -> int | None:
        """Rows changed, or None if the database stayed away past the retry window."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._retry_for
        pause = 0.1
        while True:
            try:
                return len(await db.fetch(self._pool, query, *args))
            except db.RETRIABLE_ERRORS as exc:
                if loop.time() + pause > deadline:
                    log.error(
                        "settle_failed",
                        rows=rows,
                        error=repr(exc),
                        consequence="the leases will expire and the rows be published again",
                    )
                    return None
                log.warning("settle_retrying", rows=rows, error=repr(exc))
                await asyncio.sleep(pause)
                pause = min(pause * 2, 2.0)

    async def settle_shielded(self, batch: Batch, results: Sequence[Result]) -> int:
        """Settle even if the caller is cancelled: a dropped mark after an ack is a duplicate."""
        task = asyncio.ensure_future(self.settle(batch, results))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await task
            raise
