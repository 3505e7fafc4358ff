"""Records the outcome of a published batch and releases its keys: one statement, fenced by the
lease token."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import asyncpg
import structlog

from outbox_dispatcher import db
from outbox_dispatcher.models import PUBLISHED, Batch, Result
from outbox_dispatcher.sql import Queries
from outbox_dispatcher.store import Store

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
        self._store = Store(pool, queries)
        self._retry_for = retry_for
        self._delete = delete_on_publish

    def arguments(self, batch: Batch, results: Sequence[Result]) -> dict[str, Any]:
        """Store.settle's keywords: each row's outcome, and the batch's keys to release."""
        records = batch.records
        arguments: dict[str, Any] = {
            "token": batch.token,
            "keys": sorted({r.ordering_key for r in records if r.ordering_key is not None}),
            "ids": [r.id for r in records],
            "delete_published": self._delete,
        }
        if all(res is PUBLISHED for res in results):  # the common case: one pass, not four
            n = len(results)
            arguments |= {
                "outcomes": [PUBLISHED.outcome.value] * n,
                "errors": [None] * n,
                "delays": [0.0] * n,
                "counted": [0] * n,
            }
        else:
            arguments |= {
                "outcomes": [res.outcome.value for res in results],
                "errors": [res.error for res in results],
                "delays": [res.delay for res in results],
                "counted": [int(res.counted) for res in results],
            }
        return arguments

    async def settle(self, batch: Batch, results: Sequence[Result]) -> int:
        """Write every result in one statement; returns how many rows were still ours. Retries
        while the database is briefly away: a mark that never lands means a re-publish, not a
        loss."""
        changed = await self._execute(self.arguments(batch, results), len(batch.records))
        if changed is None:
            return 0  # settle_failed said what happens; the lease was not lost
        if changed < len(batch.records):
            log.warning(
                "lease_lost",
                rows=len(batch.records) - changed,
                consequence=(
                    "another dispatcher took these rows over after the lease expired; they are "
                    "published again with the same event id"
                ),
            )
        return changed

    async def _execute(self, arguments: dict[str, Any], rows: int) -> int | None:
        """Rows changed, or None if the database stayed away past the retry window."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._retry_for
        pause = 0.1
        while True:
            try:
                return await self._store.settle(**arguments)
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
