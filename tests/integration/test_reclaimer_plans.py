"""The reclaimer's exactly-once statement under the pool's generic plans (issue 35): its work
does not grow with the rows the outbox keeps. Real PostgreSQL; the cost is counted in buffers
(EXPLAIN's shared hit + read), never timed."""

from __future__ import annotations

import asyncpg
import orjson
import pytest

from outbox_dispatcher.store import Statements

pytestmark = pytest.mark.integration

STATEMENTS = Statements.for_table("public", "outbox")
KEYS = 1000
MAX_ATTEMPTS = 3


async def _in_flight(conn: asyncpg.Connection) -> None:
    """Every one of KEYS keys leased (live) with two pending rows, and 20 keyless rows leased:
    what a steady load keeps in flight, nothing looping."""
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload)"
        f" SELECT 't', 'k' || (g % {KEYS}), 'x' FROM generate_series(1, {2 * KEYS}) g"
    )
    await conn.execute(
        "INSERT INTO outbox (topic, payload) SELECT 't', 'x' FROM generate_series(1, 20)"
    )
    await conn.execute(
        "INSERT INTO outbox_work (keyless, ordering_key, head_id, state, claim_token, claim_owner,"
        " claim_expires_at, claim_first, claim_last)"
        " SELECT ordering_key IS NULL, coalesce(ordering_key, min(id)::text), max(id) + 1, 'r',"
        " gen_random_uuid(), 'owner-' || (min(id) % 3), now() + interval '1 hour', min(id),"
        " max(id) FROM outbox WHERE published_at IS NULL"
        " GROUP BY ordering_key, CASE WHEN ordering_key IS NULL THEN id END"
    )


async def _crash_loops(conn: asyncpg.Connection) -> set[int]:
    """Crash loops among the leases in flight: k1-k3 in state x, k4-k5 and one keyless row
    whose leases expired at their last attempt, a second keyless row in state x. Returns the
    ids the reclaimer would dead-letter."""
    keyless = [
        r["id"]
        for r in await conn.fetch(
            "SELECT id FROM outbox WHERE ordering_key IS NULL ORDER BY id LIMIT 2"
        )
    ]
    looping = ["k1", "k2", "k3", "k4", "k5"]
    ids = await conn.fetch(
        "UPDATE outbox SET attempts = $1 - 1 WHERE published_at IS NULL"
        " AND (ordering_key = ANY($2::text[]) OR id = ANY($3::bigint[])) RETURNING id",
        MAX_ATTEMPTS,
        looping,
        keyless,
    )
    await conn.execute(
        "UPDATE outbox_work SET claim_expires_at = now() - interval '1 second',"
        " state = CASE WHEN ordering_key IN ('k1', 'k2', 'k3', $1) THEN 'x' ELSE state END"
        " WHERE ordering_key = ANY($2::text[])",
        str(keyless[1]),
        [*looping, str(keyless[0]), str(keyless[1])],
    )
    return {int(r["id"]) for r in ids}


async def _generic_plan_cost(database_url: str) -> tuple[int, set[int]]:
    """The statement in a new session with generic plans (as the pool's prepared statement
    runs once PostgreSQL settles on one): the buffers it touched, and the ids it returned."""
    session = await asyncpg.connect(
        database_url, server_settings={"plan_cache_mode": "force_generic_plan"}
    )
    try:
        await session.execute("PREPARE candidates AS " + STATEMENTS["crash_loop_candidates"].sql)
        found = {int(r["id"]) for r in await session.fetch(f"EXECUTE candidates({MAX_ATTEMPTS})")}
        [plan] = orjson.loads(
            await session.fetchval(
                f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE candidates({MAX_ATTEMPTS})"
            )
        )
    finally:
        await session.close()
    return plan["Plan"]["Shared Hit Blocks"] + plan["Plan"]["Shared Read Blocks"], found


async def test_crash_loop_candidates_read_the_same_buffers_whatever_the_rows_published(
    conn: asyncpg.Connection, database_url: str
) -> None:
    """The reclaimer runs `crash_loop_candidates` every reclaim interval (exactly-once, review
    E13). Its generic plan on a table without statistics joined the outbox first: a scan of
    every row, published ones included, to find that nothing loops (219 buffers at 5,000
    published rows, 1,505 at 50,000, with 1,000 leased keys; 18-40 ms a call at 1k/s, at the
    10 s tick). 5,000 then 50,000 published rows beside the same leased keys (autovacuum held
    off: never analyzed): the buffers it touches do not grow with the published rows; then
    crash loops among those keys: it finds their rows, reading them, not the table."""
    await conn.execute("ALTER TABLE outbox SET (autovacuum_enabled = false)")
    await conn.execute("ALTER TABLE outbox_work SET (autovacuum_enabled = false)")
    publish = (
        "INSERT INTO outbox (topic, ordering_key, payload, published_at)"
        f" SELECT 't', 'k' || (g % {KEYS}), 'x', now() FROM generate_series(1, $1::int) g"
    )
    await conn.execute(publish, 5_000)
    await _in_flight(conn)
    small, none_small = await _generic_plan_cost(database_url)
    await conn.execute(publish, 45_000)
    large, none_large = await _generic_plan_cost(database_url)
    expected = await _crash_loops(conn)
    looping, found = await _generic_plan_cost(database_url)
    assert not await conn.fetchval(
        "SELECT count(*) FROM pg_stats WHERE schemaname = 'public' AND tablename = 'outbox'"
    ), "the table has no statistics"
    pages = await conn.fetchval("SELECT pg_relation_size('outbox') / 8192")
    print(f"\nbuffers: {small} at 5,000 published rows, {large} at 50,000 ({pages} pages),")
    print(f"{looping} with crash loops")
    assert not none_small and not none_large
    assert found == expected and len(expected) == 12
    assert large <= 2 * small, f"{small} buffers at 5,000 published rows, {large} at 50,000"
    assert looping < pages / 4, f"{looping} buffers for a table of {pages} pages"
