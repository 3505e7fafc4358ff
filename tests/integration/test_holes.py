"""A hole in the cursor (ids a discovery read past while the transactions writing them were still
open) must stay until no transaction that could fill it can still commit. The discovery judges
that by snapshot xids: a hole found in the read's snapshot is closed only by a later snapshot
whose xmin lies beyond that read's xmax. Taking the xmax from a snapshot older than the read
(the function's start) let a writer that began in between be forgotten: its row, committed
later, stayed pending for ever (until the sweep, out of its key's order). Found by a CI run of
test_writers.py (a writer's row first-delivered after its next one)."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.claimer import Claimer
from outbox_dispatcher.dispatch.settler import Settler
from outbox_dispatcher.models import Batch, Outcome, Result
from outbox_dispatcher.store import DispatchStore, Statements

from .helpers import wait_until

pytestmark = pytest.mark.integration

STATEMENTS = Statements.for_table("public", "outbox")
HOLE_MARGIN_SECONDS = 2.0  # the margin claim_work gives discover: a hole is never closed sooner


def claimer(pool: asyncpg.Pool, batch_size: int = 100) -> Claimer:
    return Claimer(DispatchStore(pool, STATEMENTS), Settings(batch_size=batch_size), "holes")


async def settle(pool: asyncpg.Pool, batch: Batch) -> None:
    await Settler(DispatchStore(pool, STATEMENTS), retry_for=1.0).settle(
        batch, [Result(Outcome.PUBLISHED)] * len(batch.records)
    )


async def insert(conn: asyncpg.Connection, key: str) -> int:
    row_id: int = await conn.fetchval(
        "INSERT INTO outbox (topic, ordering_key, payload) VALUES ('t', $1, 'x') RETURNING id", key
    )
    return row_id


async def drain(pool: asyncpg.Pool) -> list[int]:
    published: list[int] = []
    for _ in range(5):
        batch = await claimer(pool).claim()
        if batch is None:
            break
        published.extend(r.id for r in batch.records)
        await settle(pool, batch)
    return published


async def waiting_for_a_lock(conn: asyncpg.Connection) -> bool:
    return bool(
        await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
    )


async def test_a_writer_that_began_while_a_discovery_was_under_way_is_not_forgotten(
    pool: asyncpg.Pool, conn: asyncpg.Connection, database_url: str
) -> None:
    """The discovery is held between its start and its read (its intake of the change log waits
    for a lock); a writer begins then and stays open across the hole margin and a later claim."""
    moved = await insert(conn, "a")
    await conn.execute("UPDATE outbox SET ordering_key = 'b' WHERE id = $1", moved)
    locker = await asyncpg.connect(database_url)
    writer = await asyncpg.connect(database_url)
    try:
        hold = locker.transaction()
        await hold.start()
        await locker.execute("SELECT * FROM outbox_changed FOR UPDATE")
        held_claim = asyncio.create_task(claimer(pool).claim())
        await wait_until(lambda: waiting_for_a_lock(conn), 10, "the claim waits for the log")
        tx = writer.transaction()
        await tx.start()
        late = await insert(writer, "late")  # its xid: after the discovery began
        after = await insert(conn, "other")  # committed above it: `late` is a hole
        await hold.rollback()
        batch = await held_claim
        assert batch is not None and [r.id for r in batch.records] == [moved]
        await settle(pool, batch)
        await asyncio.sleep(HOLE_MARGIN_SECONDS + 0.3)
        assert await drain(pool) == [after], "(its row was not due yet when the claim began)"
        await tx.commit()
    finally:
        await locker.close()
        await writer.close()
    assert await drain(pool) == [late], "the late writer's row is found by the next discovery"


async def test_a_run_never_passes_a_late_row_no_discovery_has_seen(
    pool: asyncpg.Pool, conn: asyncpg.Connection, database_url: str
) -> None:
    """A writer's row `late` commits below its key's head (the key's later rows of another
    writer went first: a late commit), then the same writer's next row of the key. A claim that
    cannot discover (another claim holds the cursor) runs the key from its head in a snapshot
    that sees both: it must not take the writer's next row before `late` (found by a CI run of
    test_writers.py: a writer's seq 1 first-delivered before its seq 0)."""
    writer = await asyncpg.connect(database_url)
    locker = await asyncpg.connect(database_url)
    try:
        tx = writer.transaction()
        await tx.start()
        late = await insert(writer, "k")
        early = [await insert(conn, "k"), await insert(conn, "k")]
        first = await claimer(pool, batch_size=1).claim()
        assert first is not None and [r.id for r in first.records] == early[:1]
        await settle(pool, first)  # the key goes on from early[1]
        await tx.commit()
        after = await insert(writer, "k")  # the same writer's next row
        hold = locker.transaction()
        await hold.start()
        await locker.execute("SELECT * FROM outbox_cursor FOR UPDATE")  # a discovery under way
        published: list[int] = []
        batch = await claimer(pool).claim()
        assert batch is not None
        published.extend(r.id for r in batch.records)
        await settle(pool, batch)
        await hold.rollback()
    finally:
        await locker.close()
        await writer.close()
    published += await drain(pool)
    assert sorted(published) == sorted([*early[1:], late, after])
    assert published.index(late) < published.index(after), f"order: {published}"
