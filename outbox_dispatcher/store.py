"""The dispatcher's database: every statement the claim, settle, lease and wake-up paths run, one
keyword-only method each, named like the statement in sql/queries.sql.

The claim engine lives in the schema (schema/) and in these calls; the modules around them
(claimer, settler, leases, listener, metrics, status, registry, cleanup) decide when to call,
never how to talk SQL, so a change of the engine touches this file, the schema and their tests.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

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
        scan: int,
    ) -> list[Row]:
        """Lease up to `limit` rows of at most `max_keys` keys under `token`, looking at up to
        `scan` new rows."""
        return await self._fetch(
            self._queries.claim,
            limit,
            max_keys,
            owner,
            lease_seconds,
            token,
            block_on_dead,
            max_attempts,
            scan,
        )

    async def release_claim(self, *, token: uuid.UUID) -> int:
        """Give back what a claim under `token` leased; keys (and rows without one) released."""
        [(rows,)] = await self._fetch(self._queries.release_claim, token)
        return int(rows)

    async def settle(
        self,
        *,
        token: uuid.UUID,
        owner: str,
        ids: Sequence[int],
        keys: Sequence[str | None],
        outcomes: Sequence[str],
        errors: Sequence[str | None],
        delays: Sequence[float],
        counted: Sequence[int],
        delete_published: bool,
        block_on_dead: bool,
    ) -> list[int]:
        """Record one batch's outcomes and release its keys (`keys`: each row's key, aligned
        with `ids`); the ids of the rows that were still ours."""
        rows = await self._fetch(
            self._queries.settle,
            token,
            owner,
            list(ids),
            list(keys),
            list(outcomes),
            list(errors),
            list(delays),
            list(counted),
            delete_published,
            block_on_dead,
        )
        return [int(row[0]) for row in rows]

    async def already_settled(
        self,
        *,
        ids: Sequence[int],
        owner: str,
        outcomes: Sequence[str],
        attempts: Sequence[int],
        delete_published: bool,
    ) -> int:
        """Of these rows, how many already show the outcome a settle by `owner` left (a settle
        whose reply was lost)."""
        [(rows,)] = await self._fetch(
            self._queries.already_settled,
            list(ids),
            owner,
            list(outcomes),
            list(attempts),
            delete_published,
        )
        return int(rows)

    async def extend_leases(
        self, *, ids: Sequence[int], tokens: Sequence[uuid.UUID], seconds: float
    ) -> int:
        """Extend live leases of these rows' work under their tokens; rows still held."""
        return len(await self._fetch(self._queries.extend_leases, list(ids), list(tokens), seconds))

    async def dead_letter_crash_loops(self, *, max_attempts: int, block_on_dead: bool) -> list[Row]:
        return await self._fetch(self._queries.dead_letter_crash_loops, max_attempts, block_on_dead)

    async def sweep(self, *, rows: int, hold_seconds: float) -> tuple[int, bool]:
        """The next `rows` ids of the anti-entropy sweep: (keys it registered pending rows for,
        whether it finished a pass over the table)."""
        [(repaired, wrapped)] = await self._fetch(self._queries.sweep, rows, hold_seconds)
        return int(repaired), bool(wrapped)

    async def engine_drift(self) -> Row:
        """Pending rows no claim will look at: rows, keys, the first id."""
        [row] = await self._fetch(self._queries.engine_drift)
        return row

    async def live_older_dispatchers(self, *, seconds: float, version: int) -> int:
        [(count,)] = await self._fetch(self._queries.live_older_dispatchers, seconds, version)
        return int(count)

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

    # Status, the dispatcher registry and retention (status.py, registry.py, cleanup.py).

    async def dispatcher_beat(
        self,
        *,
        owner: str,
        dead_letter_policy: str,
        version: int,
        totals: tuple[int, int] | None = None,
    ) -> None:
        """A heartbeat; `totals` (rows published, dead-lettered since the start) only on a
        schema that keeps them (migrations.CONSOLE_VERSION)."""
        if totals is None:
            await self._fetch(self._queries.dispatcher_beat, owner, dead_letter_policy, version)
            return
        published, dead = totals
        await self._fetch(
            self._queries.dispatcher_beat_counted,
            owner,
            dead_letter_policy,
            version,
            published,
            dead,
        )

    async def dispatchers_live(self, *, live_seconds: float) -> list[Row]:
        return await self._fetch(self._queries.dispatchers_live, live_seconds)

    async def in_flight_by_owner(self) -> list[Row]:
        return await self._fetch(self._queries.in_flight_by_owner)

    async def paused_list(self) -> list[Row]:
        return await self._fetch(self._queries.paused_list)

    async def status(self) -> list[Row]:
        return await self._fetch(self._queries.status)

    async def status_keys(self, *, block_on_dead: bool) -> list[Row]:
        return await self._fetch(self._queries.status_keys, block_on_dead)

    async def cleanup_window(self, *, after: int, older_than_seconds: float, limit: int) -> Row:
        """One retention batch: the next `limit` rows by id after `after`."""
        [row] = await self._fetch(self._queries.cleanup_window, after, older_than_seconds, limit)
        return row

    # Operator commands (operate/): `filter_args` are a filter's parameters in its statements'
    # order (operate.filters); each mutating statement works on one batch of ids after `after`,
    # up to `limit`, and returns the batch's last id, its row count and its first changed id.

    async def _value(self, query: str, *args: object) -> Any:
        [(value,)] = await self._fetch(query, *args)
        return value

    async def _one(self, query: str, *args: object) -> Row | None:
        rows = await self._fetch(query, *args)
        return rows[0] if rows else None

    async def _batch(self, query: str, *args: object) -> Row:
        row = await self._one(query, *args)
        assert row is not None  # noqa: S101 - an aggregate always returns one row
        return row

    async def dead_page(
        self, *, order: str, filter_args: Sequence[object], cursor: Sequence[object], limit: int
    ) -> list[Row]:
        """One page of dead rows in `order` (id, -id, dead_at, -dead_at: one statement each),
        after `cursor` (its sort values; None: the first page)."""
        query = {
            "id": self._queries.dead_page_id,
            "-id": self._queries.dead_page_id_desc,
            "dead_at": self._queries.dead_page_dead_at,
            "-dead_at": self._queries.dead_page_dead_at_desc,
        }[order]
        return await self._fetch(query, *filter_args, *cursor, limit)

    async def dead_count(self, *, filter_args: Sequence[object]) -> int:
        return int(await self._value(self._queries.dead_count, *filter_args))

    async def dead_bound(self, *, filter_args: Sequence[object]) -> Row:
        return await self._batch(self._queries.dead_bound, *filter_args)

    async def dead_groups(self, *, filter_args: Sequence[object], limit: int) -> list[Row]:
        return await self._fetch(self._queries.dead_groups, *filter_args, limit)

    async def replay_count(self, *, filter_args: Sequence[object]) -> int:
        return int(await self._value(self._queries.replay_count, *filter_args))

    async def replay_bound(self, *, filter_args: Sequence[object]) -> Row:
        return await self._batch(self._queries.replay_bound, *filter_args)

    async def dead_requeue(self, *, filter_args: Sequence[object], after: int, limit: int) -> Row:
        return await self._batch(self._queries.dead_requeue, *filter_args, after, limit)

    async def dead_discard(self, *, filter_args: Sequence[object], after: int, limit: int) -> Row:
        return await self._batch(self._queries.dead_discard, *filter_args, after, limit)

    async def replay_batch(self, *, filter_args: Sequence[object], after: int, limit: int) -> Row:
        return await self._batch(self._queries.replay_batch, *filter_args, after, limit)

    async def release_held(self, *, topic: str | None) -> int:
        return int(await self._value(self._queries.release_held, topic))

    async def pause(self, *, topic: str, reason: str | None, by: str | None) -> Row | None:
        return await self._one(self._queries.pause, topic, reason, by)

    async def wait_for_pause_readers(self) -> bool:
        """False when the wait ran out (claims held the pauses for over 5 s) or the role may not
        lock the pauses (LOCK needs UPDATE, DELETE or TRUNCATE on them)."""
        try:
            await self._fetch(self._queries.wait_for_pause_readers)
        except (asyncpg.LockNotAvailableError, asyncpg.InsufficientPrivilegeError):
            return False
        return True

    async def resume(self, *, topic: str) -> Row | None:
        return await self._one(self._queries.resume, topic)

    async def wake(self, *, channel: str) -> None:
        await self._fetch(self._queries.wake, channel)

    async def in_flight_rows(self, *, topic: str | None) -> int:
        return int(await self._value(self._queries.in_flight_rows, topic))

    async def cleanup_count(self, *, older_than_seconds: float) -> int:
        return int(await self._value(self._queries.cleanup_count, older_than_seconds))

    async def pending_topics(self) -> list[Row]:
        return await self._fetch(self._queries.pending_topics)

    async def dead_topics(self) -> list[Row]:
        return await self._fetch(self._queries.dead_topics)

    async def pending_routed_headers(self, *, limit: int) -> list[Row]:
        return await self._fetch(self._queries.pending_routed_headers, limit)

    # The audit record of an action while it runs (operate/jobs.py). `lock` is the table's
    # advisory-lock key of running actions.

    async def audit_open(
        self,
        *,
        lock: int,
        command: str,
        filter_json: str,
        expected: int | None,
        bound_json: str | None,
        identity: str | None,
        identity_source: str | None,
        request_key: str | None,
    ) -> Row | None:
        """The new record's id (None: `request_key` was recorded before)."""
        return await self._one(
            self._queries.audit_open,
            lock,
            command,
            filter_json,
            expected,
            bound_json,
            identity,
            identity_source,
            request_key,
        )

    async def audit_by_request(self, *, request_key: str) -> int | None:
        row = await self._one(self._queries.audit_by_request, request_key)
        return None if row is None else int(row["id"])

    async def audit_progress(
        self, *, id: int, rows: int, first_id: int | None, last_id: int | None
    ) -> bool | None:
        """Whether an operator asked the action to stop (None: the record no longer runs)."""
        row = await self._one(self._queries.audit_progress, id, rows, first_id, last_id)
        return None if row is None else bool(row["aborting"])

    async def audit_aborting(self, *, id: int) -> bool:
        return bool(await self._value(self._queries.audit_aborting, id))

    async def audit_close(
        self,
        *,
        id: int,
        status: str,
        rows: int,
        detail: str,
        first_id: int | None,
        last_id: int | None,
    ) -> bool:
        row = await self._one(
            self._queries.audit_close, id, status, rows, detail, first_id, last_id
        )
        return row is not None

    async def audit_release(self, *, lock: int, id: int) -> None:
        await self._fetch(self._queries.audit_release, lock, id)

    async def audit_abort(self, *, id: int, by: str | None) -> bool:
        return await self._one(self._queries.audit_abort, id, by) is not None

    async def audit_sweep(self, *, lock: int) -> list[int]:
        return [int(row["id"]) for row in await self._fetch(self._queries.audit_sweep, lock)]

    async def audit_list(
        self, *, lock: int, filter_args: Sequence[object], limit: int
    ) -> list[Row]:
        """Operator actions, newest first; `filter_args`: before id, command, status, who,
        since, until."""
        return await self._fetch(self._queries.audit_list, lock, *filter_args, limit)

    async def audit_get(self, *, lock: int, id: int) -> Row | None:
        return await self._one(self._queries.audit_get, lock, id)

    # The console's reads (besides status and dead rows, which the CLI shares).

    async def blocked_keys(
        self, *, block_on_dead: bool, topic: str | None, key: str | None, limit: int
    ) -> list[Row]:
        """Keys whose head waits (backoff, held, or behind a dead row), oldest heads first."""
        return await self._fetch(self._queries.blocked_keys, block_on_dead, topic, key, limit)

    async def row_detail(self, *, id: int, payload: bool, payload_max_bytes: int) -> Row | None:
        """One row in any state; its payload (the first bytes) only when `payload`."""
        return await self._one(self._queries.row_detail, id, payload, payload_max_bytes)

    async def row_by_event(self, *, event_id: uuid.UUID) -> int | None:
        row = await self._one(self._queries.row_by_event, event_id)
        return None if row is None else int(row["id"])

    async def rows_window(
        self, *, before: int, window: int, filter_args: Sequence[object], limit: int
    ) -> list[Row]:
        """Rows of any state with ids in [before - window, before), newest first."""
        return await self._fetch(self._queries.rows_window, before, window, *filter_args, limit)

    async def routed_groups(self, *, header_names: Sequence[str], limit: int) -> list[Row]:
        return await self._fetch(self._queries.routed_groups, list(header_names), limit)

    async def max_id(self) -> int:
        """The highest id in the table (where a scan of the newest rows starts)."""
        return int(await self._value(self._queries.max_id))

    # The console's logins.

    async def session_open(
        self, *, id: bytes, identity: str, client: str | None, token_tag: str, seconds: float
    ) -> None:
        await self._fetch(self._queries.session_open, id, identity, client, token_tag, seconds)

    async def session_get(self, *, id: bytes, token_tag: str) -> Row | None:
        return await self._one(self._queries.session_get, id, token_tag)

    async def session_end(self, *, id: bytes) -> None:
        await self._fetch(self._queries.session_end, id)

    async def session_prune(self) -> None:
        await self._fetch(self._queries.session_prune)
