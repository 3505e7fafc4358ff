"""The dispatcher's database: every statement the claim, settle, lease and wake-up paths run, one
keyword-only method each, named like the statement in sql/queries.sql.

The claim engine lives in the schema (schema/) and in these calls; the modules around them
(claimer, marker, reclaimer, listener, metrics) decide when to call, never how to talk SQL, so a
change of the engine touches this file, the schema and their tests.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import asyncpg

from outbox_dispatcher import db
from outbox_dispatcher.sql import Queries

# Raised by a claim when the server's lock table or memory is short (SQLSTATE 53200).
OutOfMemoryError = asyncpg.OutOfMemoryError
Row = asyncpg.Record


class Store:
    """One outbox table's statements over a pool (or a connection, for tests and operators)."""

    def __init__(self, executor: asyncpg.Pool | db.Executor, queries: Queries) -> None:
        self._executor = executor
        self._queries = queries

    async def _fetch(self, query: str, *args: object) -> list[Row]:
        return await db.fetch(self._executor, query, *args)

    async def claim(
        self,
        *,
        limit: int,
        max_keys: int,
        owner: str,
        lease_seconds: float,
        token: uuid.UUID,
        block_on_dead: bool,
        max_attempts: int,
    ) -> list[Row]:
        """Lease up to `limit` rows of at most `max_keys` ready keys under `token`."""
        return await self._fetch(
            self._queries.claim,
            limit,
            max_keys,
            owner,
            lease_seconds,
            token,
            block_on_dead,
            max_attempts,
        )

    async def release_claim(self, *, token: uuid.UUID) -> int:
        """Give back what a claim under `token` leased; rows released."""
        [(rows,)] = await self._fetch(self._queries.release_claim, token)
        return int(rows)

    async def settle(
        self,
        *,
        token: uuid.UUID,
        keys: Sequence[str],
        ids: Sequence[int],
        outcomes: Sequence[str],
        errors: Sequence[str | None],
        delays: Sequence[float],
        counted: Sequence[int],
        delete_published: bool,
    ) -> int:
        """Record one batch's outcomes and release its keys; rows that were still ours."""
        rows = await self._fetch(
            self._queries.settle,
            token,
            list(keys),
            list(ids),
            list(outcomes),
            list(errors),
            list(delays),
            list(counted),
            delete_published,
        )
        return len(rows)

    async def extend_leases(
        self, *, ids: Sequence[int], tokens: Sequence[uuid.UUID], seconds: float
    ) -> int:
        """Extend live leases of these rows under their tokens; rows extended."""
        return len(await self._fetch(self._queries.extend_leases, list(ids), list(tokens), seconds))

    async def dead_letter_crash_loops(self, *, max_attempts: int) -> list[Row]:
        return await self._fetch(self._queries.dead_letter_crash_loops, max_attempts)

    async def count_expired_leases(self) -> int:
        [(expired,)] = await self._fetch(self._queries.count_expired_leases)
        return int(expired)

    async def waiting_announce(self, *, owner: str, seconds: float) -> None:
        await self._fetch(self._queries.waiting_announce, owner, seconds)

    async def waiting_withdraw(self, *, owner: str) -> None:
        await self._fetch(self._queries.waiting_withdraw, owner)

    async def gauges(self, *, block_on_dead: bool) -> Row:
        [row] = await self._fetch(self._queries.gauges, block_on_dead)
        return row

    async def clock_tick(self) -> None:
        """Note the highest committed id at the database's time: lag is measured from these."""
        await self._fetch(self._queries.clock_tick)

    async def clock_prune(self, *, first_pending_id: int | None) -> None:
        """Forget clock entries that no pending row needs any more."""
        await self._fetch(self._queries.clock_prune, first_pending_id)

    async def schema_version(self) -> int:
        [(version,)] = await self._fetch(self._queries.schema_version)
        return int(version)
