"""The lag that pages (issue 12): measured from a time the database sets, not from a writer's
created_at, and without the rows that wait on purpose. The gauges and `status` run the same
statements the dispatcher's metrics sampler runs, here without a dispatcher so that nothing moves.
"""

from __future__ import annotations

from typing import Any

import asyncpg
import orjson
import pytest

from outbox_dispatcher.operate import reads
from outbox_dispatcher.operate.actions import DeadRequeue, Replay, perform
from outbox_dispatcher.operate.filters import Filters
from outbox_dispatcher.operate.session import Session
from outbox_dispatcher.store import DispatchStore, Statements

from .helpers import cli
from .test_observability import backdate_clock

pytestmark = pytest.mark.integration

STATEMENTS = Statements.for_table("public", "outbox")
DAY = 86400


async def gauges(conn: asyncpg.Connection) -> dict[str, Any]:
    """One sample, as the metrics sampler takes it: clock entry, gauges, prune."""
    store = DispatchStore(conn, STATEMENTS)
    await store.clock_tick()
    row = dict(await store.gauges(block_on_dead=False))
    await store.clock_prune(first_pending_id=row["first_pending_id"])
    return row


async def topic_status(conn: asyncpg.Connection, topic: str | None) -> reads.TopicStatus:
    session = Session(conn, STATEMENTS, "public.outbox")
    [found] = [t for t in await reads.topics(session) if t.topic == topic]
    return found


async def test_a_backdated_created_at_does_not_fake_lag(conn: asyncpg.Connection) -> None:
    """12a: a writer's created_at a day in the past shows seconds of lag, not a day."""
    await gauges(conn)  # a dispatcher's note: the rows below were committed after it
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload, created_at) "
        "VALUES ('lag-a', 'k', 'x', now() - interval '1 day'), "
        "       ('lag-a', NULL, 'y', now() - interval '1 day'), "
        "       (NULL, 'r', 'z', now() - interval '1 day')"  # routed by the dispatcher
    )
    row = await gauges(conn)
    assert row["pending"] == 3
    assert row["paused_rows"] == row["held_rows"] == 0
    assert 0 <= row["oldest_pending_age_seconds"] < 60
    for topic in ("lag-a", None):
        t = await topic_status(conn, topic)
        assert t.parked == 0
        assert t.oldest_pending_age_seconds is not None
        assert 0 <= t.oldest_pending_age_seconds < 60


async def test_created_at_is_believed_within_the_database_clock(conn: asyncpg.Connection) -> None:
    """An honest created_at between two clock entries is the lag; one in the future is not
    believed past the first entry that saw the row committed (it cannot hide lag either)."""
    await backdate_clock(conn, minutes=30)
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload, created_at) "
        "VALUES ('lag-b', 'k', 'x', now() - interval '10 minutes')"
    )
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload, created_at) "
        "VALUES ('lag-c', 'k2', 'x', now() + interval '1 day')"
    )
    await backdate_clock(conn, minutes=5)  # both rows were committed 5 minutes ago at the latest
    row = await gauges(conn)
    assert 590 < row["oldest_pending_age_seconds"] < 700
    t = await topic_status(conn, "lag-b")
    assert t.oldest_pending_age_seconds is not None
    assert 590 < t.oldest_pending_age_seconds < 700
    future = await topic_status(conn, "lag-c")
    assert future.oldest_pending_age_seconds is not None
    assert 290 < future.oldest_pending_age_seconds < 400


async def test_a_replay_of_old_rows_lags_from_the_replay(conn: asyncpg.Connection) -> None:
    """Rows written two days ago and published, replayed now: their lag starts now."""
    await backdate_clock(conn, minutes=3 * 24 * 60)
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload, created_at, published_at) "
        "SELECT 'lag-r', 'k' || (i % 5), 'x', now() - interval '2 days', "
        "       now() - interval '2 days' FROM generate_series(1, 50) i"
    )
    await backdate_clock(conn, minutes=2 * 24 * 60 - 1)
    session = Session(conn, STATEMENTS, "public.outbox")
    replayed = await perform(Replay(Filters(topic="lag-r"), batch_size=20), session)
    assert replayed.rows == 50
    row = await gauges(conn)
    assert row["pending"] == 50
    assert 0 <= row["oldest_pending_age_seconds"] < 60
    t = await topic_status(conn, "lag-r")
    assert t.oldest_pending_age_seconds is not None
    assert t.oldest_pending_age_seconds < 60
    # The same for dead rows requeued: they wait from the requeue, not from their first write.
    await conn.execute(
        "UPDATE outbox SET published_at = now(), pending_since = NULL WHERE topic = 'lag-r'"
    )
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload, created_at, dead_at, last_error) "
        "VALUES ('lag-d', 'd', 'x', now() - interval '2 days', now() - interval '1 day', 'e')"
    )
    requeued = await perform(DeadRequeue(Filters(topic="lag-d"), batch_size=100), session)
    assert requeued.rows == 1
    row = await gauges(conn)
    assert row["pending"] == 1
    assert 0 <= row["oldest_pending_age_seconds"] < 60


async def test_a_pending_since_set_by_a_writer_cannot_fake_lag(conn: asyncpg.Connection) -> None:
    """pending_since is bookkeeping; a writer that sets it anyway cannot date a row before the
    database's last note that did not see it committed."""
    await gauges(conn)
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload, created_at, pending_since) "
        "VALUES ('lag-w', 'k', 'x', now() - interval '1 day', now() - interval '1 day')"
    )
    row = await gauges(conn)
    assert 0 <= row["oldest_pending_age_seconds"] < 60


async def test_paused_and_held_rows_are_parked_in_gauges_and_status(
    conn: asyncpg.Connection, make_settings: Any
) -> None:
    """A paused topic's rows and held rows are parked: counted and aged apart from the lag, which
    stays at the one row that should be moving; `status` shows both."""
    await backdate_clock(conn, minutes=60)
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload, created_at) "
        "SELECT 'lag-p', 'p' || i, 'x', now() - interval '1 hour' FROM generate_series(1, 4) i"
    )
    # A later row of a paused key in a topic that is not paused waits behind it: paused too.
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload, created_at) "
        "VALUES ('lag-x', 'p1', 'x', now() - interval '1 hour')"
    )
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload, created_at, next_attempt_at) "
        "VALUES ('lag-h', 'h', 'x', now() - interval '1 hour', now() + interval '1 hour')"
    )
    await backdate_clock(conn, minutes=2)
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload, created_at) "
        "VALUES ('lag-ok', 'o', 'x', now() - interval '2 minutes')"
    )
    await conn.execute("INSERT INTO outbox_paused (topic, paused_by) VALUES ('lag-p', 'test')")
    row = await gauges(conn)
    assert row["pending"] == 7
    assert 110 < row["oldest_pending_age_seconds"] < 200  # lag-ok's row only
    assert row["paused_rows"] == 5
    assert 3590 < row["oldest_paused_age_seconds"] < 3700
    assert row["held_rows"] == 1
    assert 3590 < row["oldest_held_age_seconds"] < 3700

    paused = await topic_status(conn, "lag-p")
    assert (paused.parked, paused.oldest_pending_age_seconds) == (4, None)
    assert paused.oldest_parked_age_seconds is not None
    assert paused.oldest_parked_age_seconds > 3590
    held = await topic_status(conn, "lag-h")
    assert (held.parked, held.oldest_pending_age_seconds) == (1, None)
    behind = await topic_status(conn, "lag-x")
    assert (behind.parked, behind.oldest_pending_age_seconds) == (1, None)

    settings = make_settings()
    result = await cli(settings, "status", "--json")
    assert result.code == 0, result.err
    totals = orjson.loads(result.out)["totals"]
    assert totals["parked"] == 6
    assert 110 < totals["oldest_pending_age_seconds"] < 200
    assert totals["oldest_parked_age_seconds"] > 3590
    table = await cli(settings, "status")
    header, *lines = table.out.splitlines()
    assert header.split()[5:7] == ["lag", "parked"]
    assert any(line.startswith("lag-p ") and "4 (1h0" in line for line in lines), table.out

    # Without the pause, the same rows are lag again.
    await conn.execute("DELETE FROM outbox_paused")
    row = await gauges(conn)
    assert row["paused_rows"] == 0
    assert row["oldest_pending_age_seconds"] > 3590


async def test_the_clock_keeps_what_pending_rows_need_and_forgets_the_rest(
    conn: asyncpg.Connection,
) -> None:
    await conn.execute("DELETE FROM outbox_clock")
    for days in (5, 4, 3):
        await conn.execute(
            "INSERT INTO outbox_clock (seq, at) SELECT coalesce(max(id), 0), "
            "now() - $1 * interval '1 day' FROM outbox",
            days,
        )
        await conn.execute(
            "INSERT INTO outbox (topic, ordering_key, payload, published_at) "
            "VALUES ('lag-c', 'k', 'x', now())"
        )
    # Written 3 to 4 days ago by the clock, backdated by its writer to 10 days ago.
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload, created_at) "
        "VALUES ('lag-c', 'k', 'x', now() - interval '10 days')"
    )
    pending_id = await conn.fetchval("SELECT max(id) FROM outbox")
    await gauges(conn)
    kept = [r["seq"] for r in await conn.fetch("SELECT seq FROM outbox_clock ORDER BY seq, at")]
    # The last entry below the pending row (its lower bound) and the new one above it stay; the
    # two older entries, below rows nobody waits for, go; the lower bound still holds.
    assert kept == [pending_id - 2, pending_id]
    assert 3 * DAY - 60 < await gauges_age(conn) < 3 * DAY + 60


async def gauges_age(conn: asyncpg.Connection) -> float:
    age: float = (await gauges(conn))["oldest_pending_age_seconds"]
    return age
