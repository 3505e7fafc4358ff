"""The operator's operations: dead rows (list, count, requeue, discard), replay, release of held
rows, pause/resume, the audit. One layer for both faces: the CLI (admin.py) and the console call
these functions, which return data and print nothing.

Every operation is safe while dispatchers run. Dead and published rows are never leased, so the
operations that change them cannot race a dispatcher's publish; each works in batches of
cleanup_batch_size rows between ids fixed when it starts. Pauses live in a table the claim reads;
rows already claimed when a pause commits are still published. Every change is recorded in the
audit table. docs/operations.md describes each command and what it is safe against.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg
import orjson

from outbox_dispatcher import db, migrations, status
from outbox_dispatcher.settings import Settings
from outbox_dispatcher.sql import Queries
from outbox_dispatcher.store import Store

# How dead list shows a NULL topic or key (and what --topic / --key accept for them).
NULL_TOPIC = "(routed)"
NULL_KEY = "(none)"


@dataclass(frozen=True)
class Filters:
    """Which rows a command touches; None means any. Times compare with created_at."""

    ids: list[int] | None = None
    key: str | None = None
    topic: str | None = None  # NULL_TOPIC: rows with no topic (routed by the dispatcher)
    since: datetime | None = None
    until: datetime | None = None
    from_id: int | None = None
    to_id: int | None = None
    keyless: bool | None = None  # True: rows with no ordering key
    dead_since: datetime | None = None  # dead_at, for dead rows
    dead_until: datetime | None = None
    error: str | None = None  # dead rows whose last_error contains this, in any case

    @classmethod
    def of(cls, ns: argparse.Namespace) -> Filters:
        return cls(
            ids=getattr(ns, "ids", None),
            key=ns.key,
            topic=ns.topic,
            since=ns.since,
            until=ns.until,
            from_id=getattr(ns, "from_id", None),
            to_id=getattr(ns, "to_id", None),
            keyless=getattr(ns, "keyless", None),
            dead_since=getattr(ns, "dead_since", None),
            dead_until=getattr(ns, "dead_until", None),
            error=getattr(ns, "error", None),
        )

    def empty(self) -> bool:
        return all(value is None for value in vars(self).values())

    def dead_args(self) -> tuple[object, ...]:
        return (
            self.ids,
            self.key,
            self.topic,
            self.since,
            self.until,
            self.keyless,
            self.dead_since,
            self.dead_until,
            self.error,
        )

    def replay_args(self) -> tuple[object, ...]:
        return (self.from_id, self.to_id, self.key, self.topic, self.since, self.until)

    def as_json(self) -> dict[str, object]:
        """The filter for the audit table: only what was given, times in ISO 8601."""
        return {
            name: value.isoformat() if isinstance(value, datetime) else value
            for name, value in vars(self).items()
            if value is not None
        }


async def dead_list(
    conn: asyncpg.Connection, queries: Queries, filters: Filters, limit: int
) -> list[dict[str, Any]]:
    rows = await Store(conn, queries).dead_list(filter_args=filters.dead_args(), limit=limit)
    return [{**dict(row), "event_id": str(row["event_id"])} for row in rows]


async def dead_count(conn: asyncpg.Connection, queries: Queries, filters: Filters) -> int:
    """How many dead rows a requeue or discard with these filters would change."""
    return await Store(conn, queries).dead_count(filter_args=filters.dead_args())


async def replay_count(conn: asyncpg.Connection, queries: Queries, filters: Filters) -> int:
    """How many published rows a replay with these filters would make pending again."""
    return await Store(conn, queries).replay_count(filter_args=filters.replay_args())


async def wake(conn: asyncpg.Connection, queries: Queries, channel: str) -> None:
    """Wake idle dispatchers, so that requeued, replayed or resumed rows go out at once."""
    await Store(conn, queries).wake(channel=channel)


# Where an action came from, for its audit row (merged into the filter): the CLI gives none, the
# console {"via": "console", "http_client": ...}.
Origin = Mapping[str, object]


def _audited(filter: Mapping[str, object], origin: Origin | None) -> dict[str, object]:
    return {**filter, **(origin or {})}


# One batch of a cursor-batched statement: Store.dead_requeue, dead_discard or replay_batch.
Step = Callable[..., Awaitable[asyncpg.Record]]


async def _walk(
    store: Store,
    step: Step,
    args: tuple[object, ...],
    batch_size: int,
    progress: Progress | None = None,
) -> int:
    """Run a cursor-batched statement over ids (0, max id now], one transaction per batch
    (unless the caller holds one)."""
    bound = await store.max_id()
    after = 0
    total = 0
    while True:
        row = await step(filter_args=args, after=after, bound=bound, limit=batch_size)
        if row["last_id"] is None:
            return total
        after = row["last_id"]
        total += row["rows"]
        if progress is not None:
            progress(row["rows"])


Progress = Callable[[int], object]


async def dead_requeue(
    conn: asyncpg.Connection,
    queries: Queries,
    filters: Filters,
    batch_size: int,
    progress: Progress | None = None,
    origin: Origin | None = None,
) -> int:
    """Make matching dead rows pending again (attempts 0, due now); returns how many."""
    store = Store(conn, queries)
    n = await _walk(store, store.dead_requeue, filters.dead_args(), batch_size, progress)
    await audit(conn, queries, "dead requeue", _audited(filters.as_json(), origin), n)
    return n


async def dead_discard(
    conn: asyncpg.Connection,
    queries: Queries,
    filters: Filters,
    batch_size: int,
    progress: Progress | None = None,
    origin: Origin | None = None,
) -> int:
    """Delete matching dead rows; returns how many."""
    store = Store(conn, queries)
    n = await _walk(store, store.dead_discard, filters.dead_args(), batch_size, progress)
    await audit(conn, queries, "dead discard", _audited(filters.as_json(), origin), n)
    return n


async def replay(
    conn: asyncpg.Connection,
    queries: Queries,
    filters: Filters,
    batch_size: int,
    progress: Progress | None = None,
    origin: Origin | None = None,
) -> int:
    """Make matching published rows pending again, with their event ids; returns how many.

    One transaction (in batches, for progress): dispatchers see every replayed row at once when
    it commits, so a key's replayed rows go out in their order and before the key's newer rows;
    an interrupted replay changes nothing. Published rows are never leased, so the row locks it
    holds until then delay no dispatcher.
    """
    async with conn.transaction():
        store = Store(conn, queries)
        n = await _walk(store, store.replay_batch, filters.replay_args(), batch_size, progress)
        await audit(conn, queries, "replay", _audited(filters.as_json(), origin), n)
    return n


async def release_held(conn: asyncpg.Connection, queries: Queries, topic: str | None) -> int:
    """Let rows go that an interrupted replay of an earlier version left held; how many."""
    async with conn.transaction():
        n = await Store(conn, queries).release_held(topic=topic)
        await audit(conn, queries, "replay --release-held", {"topic": topic} if topic else {}, n)
    return n


async def audit(
    conn: asyncpg.Connection, queries: Queries, command: str, filter: object, rows: int
) -> None:
    """Record an operator action in the database (who, from where and when: the database's)."""
    # As text: the statement works on any connection, with or without our jsonb codec.
    await Store(conn, queries).audit(
        command=command, filter_json=orjson.dumps(filter).decode(), rows=rows
    )


async def pause(
    conn: asyncpg.Connection,
    queries: Queries,
    topic: str | None,
    reason: str | None,
    origin: Origin | None = None,
) -> status.Pause:
    """Pause a topic or the whole table; paused_by is the database role and client address."""
    async with conn.transaction():
        row = await Store(conn, queries).pause(topic=topic or status.WHOLE_TABLE, reason=reason)
        await audit(conn, queries, "pause", _audited({"topic": topic, "reason": reason}, origin), 1)
    return status.Pause(**dict(row or {}))


async def resume(
    conn: asyncpg.Connection,
    queries: Queries,
    topic: str | None,
    channel: str,
    origin: Origin | None = None,
) -> status.Pause | None:
    """Lift a pause and wake idle dispatchers so that the rows go out at once."""
    async with conn.transaction():
        row = await Store(conn, queries).resume(topic=topic or status.WHOLE_TABLE)
        changed = 0 if row is None else 1
        await audit(conn, queries, "resume", _audited({"topic": topic}, origin), changed)
    await wake(conn, queries, channel)
    return None if row is None else status.Pause(**dict(row))


@contextlib.asynccontextmanager
async def connected(settings: Settings) -> AsyncIterator[tuple[asyncpg.Connection, Queries]]:
    """A connection for an operator command: its changes are durable before it reports them
    (synchronous_commit on, whatever the dispatcher's own setting)."""
    durable = settings.model_copy(update={"synchronous_commit": "on"})
    conn = await db.connect(settings.database_url.get_secret_value(), durable)
    try:
        await migrations.check_version(conn, settings.db_schema, settings.table)
        yield conn, Queries.for_table(settings.db_schema, settings.table)
    finally:
        await conn.close()
