"""A long transaction elsewhere in the database (a REPEATABLE READ snapshot and an idle-in-
transaction session, both holding back the xmin horizon) must not stop or slow dispatching much,
and the dispatcher's own transactions must stay short whatever else runs.

CI holds the long transactions for 20 s; OUTBOX_CHAOS=full holds them for 3 minutes.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from typing import Any

import asyncpg
import pytest

from outbox_dispatcher.dispatch.claimer import Claimer
from outbox_dispatcher.models import Batch
from outbox_dispatcher.store.db import APPLICATION_NAME

from .helpers import Services, check, consume, count, event_ids, insert_sequenced, running

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FULL = os.environ.get("OUTBOX_CHAOS") == "full"
BASELINE_SECONDS = 30.0 if FULL else 8.0
HOLD_SECONDS = 180.0 if FULL else 20.0
KEYS_PER_TICK = 30 if FULL else 10  # one row per key every 100 ms: 300 or 100 rows/s
# "About a second": the dispatcher's statements take milliseconds; this leaves room for a
# loaded 2-core CI machine.
LONGEST_DISPATCHER_TRANSACTION = 1.5


def _p(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(seconds: list[float]) -> str:
    ms = [s * 1000 for s in seconds]
    return (
        f"median {statistics.median(ms):.1f} p95 {_p(ms, 0.95):.1f} p99 {_p(ms, 0.99):.1f} "
        f"(n={len(ms)})"
    )


async def _latencies(conn: asyncpg.Connection, since: float, until: float) -> list[float]:
    """Commit-to-mark seconds of the rows written between two database clock readings (the
    insert commits right after created_at; published_at is set right after the broker's ack)."""
    rows = await conn.fetch(
        "SELECT extract(epoch FROM published_at - created_at)::float8 AS s FROM outbox "
        "WHERE created_at >= to_timestamp($1) AND created_at < to_timestamp($2)",
        since,
        until,
    )
    return [r["s"] for r in rows]


async def _db_time(conn: asyncpg.Connection) -> float:
    value: float = await conn.fetchval("SELECT extract(epoch FROM clock_timestamp())::float8")
    return value


async def test_long_transactions_elsewhere_do_not_stop_dispatching(
    conn: asyncpg.Connection,
    database_url: str,
    services: Services,
    topic: str,
    make_settings: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    claim_seconds: list[tuple[float, float]] = []  # (when, how long) of claims that leased rows
    original_claim = Claimer.claim

    async def timed_claim(self: Claimer) -> Batch | None:
        started = time.monotonic()
        batch = await original_claim(self)
        if batch is not None:
            claim_seconds.append((started, time.monotonic() - started))
        return batch

    monkeypatch.setattr(Claimer, "claim", timed_claim)

    longest: dict[str, Any] = {"transaction": 0.0, "state": None, "query": None}
    sampler_conn = await asyncpg.connect(database_url)
    writer = await asyncpg.connect(database_url)
    snapshot_holder = await asyncpg.connect(database_url)
    idle_holder = await asyncpg.connect(database_url)
    sampling = True
    writing = True
    written = 0

    async def sample() -> None:
        """Every 100 ms: the oldest open transaction of the dispatcher in this database. (Not
        one in state idle: that is the server reading the notification queue for the LISTEN
        connection between our statements, not a transaction of ours; seen at 3.4 s once.)"""
        while sampling:
            oldest = await sampler_conn.fetchrow(
                "SELECT extract(epoch FROM clock_timestamp() - xact_start)::float8 AS age, "
                "state, wait_event_type, wait_event, left(query, 300) AS query "
                "FROM pg_stat_activity WHERE datname = current_database() "
                "AND application_name = $1 AND xact_start IS NOT NULL AND state <> 'idle' "
                "ORDER BY xact_start LIMIT 1",
                APPLICATION_NAME,
            )
            if oldest is not None and oldest["age"] > longest["transaction"]:
                # What the oldest transaction was doing, so that a failure names the statement.
                longest.update(
                    transaction=oldest["age"],
                    state=oldest["state"],
                    wait=f"{oldest['wait_event_type']}/{oldest['wait_event']}",
                    query=oldest["query"],
                )
            await asyncio.sleep(0.1)

    async def write() -> None:
        """KEYS_PER_TICK keys, a row each every 100 ms."""
        nonlocal written
        seq = 0
        while writing:
            await insert_sequenced(writer, topic, keys=KEYS_PER_TICK, per_key=1, first_seq=seq)
            seq += 1
            written += KEYS_PER_TICK
            await asyncio.sleep(0.1)

    settings = make_settings(lease_seconds=10, http_port=0)
    tasks: list[asyncio.Task[None]] = []
    try:
        async with running(settings):
            tasks = [asyncio.create_task(sample()), asyncio.create_task(write())]
            base_from = await _db_time(conn)
            mono_base = time.monotonic()
            await asyncio.sleep(BASELINE_SECONDS)
            base_until = await _db_time(conn)
            mono_hold = time.monotonic()

            # The long transactions: a REPEATABLE READ snapshot and an idle-in-transaction
            # session with an xid, both pinning the xmin horizon (VACUUM can remove nothing
            # newer, so every published row's old version stays in table and index).
            rr = snapshot_holder.transaction(isolation="repeatable_read")
            await rr.start()
            seen_at_start = await snapshot_holder.fetchval("SELECT count(*) FROM outbox")
            idle = idle_holder.transaction()
            await idle.start()
            await idle_holder.fetchval("SELECT pg_current_xact_id()")
            hold_from = await _db_time(conn)
            await asyncio.sleep(HOLD_SECONDS)
            hold_until = await _db_time(conn)
            holders = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL) "
                "AND state = 'idle in transaction' "
                "AND xact_start < to_timestamp($1)",
                hold_from,
            )
            seen_at_end = await snapshot_holder.fetchval("SELECT count(*) FROM outbox")
            dead_tuples = await conn.fetchval(
                "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'outbox'"
            )
            writing = False
            await tasks[1]

            async def settled() -> bool:
                return await count(conn, "published_at IS NULL") == 0

            deadline = time.monotonic() + 60
            while not await settled():
                assert time.monotonic() < deadline, "rows left unpublished"
                await asyncio.sleep(0.2)
            await rr.rollback()
            await idle.rollback()
            mono_end = time.monotonic()
    finally:
        writing = sampling = False
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in (sampler_conn, writer, snapshot_holder, idle_holder):
            await c.close()

    assert holders == 2, "both long transactions were open, holding the xmin horizon"
    assert seen_at_end == seen_at_start, "the snapshot stayed the same the whole time"
    assert await count(conn) == written
    verdict = check(
        await consume(services.kafka_bootstrap_servers, topic, written, timeout=120),
        await event_ids(conn),
    )
    assert (len(verdict.lost), verdict.reordered, verdict.unexpected) == (0, [], [])
    assert verdict.delivered == written
    assert longest["transaction"] < LONGEST_DISPATCHER_TRANSACTION, longest

    base = await _latencies(conn, base_from, base_until)
    held = await _latencies(conn, hold_from, hold_until)
    claims_base = [s for at, s in claim_seconds if mono_base <= at < mono_hold]
    claims_held = [s for at, s in claim_seconds if mono_hold <= at < mono_end]
    # The last quarter of the hold: the effect grows with the dead tuples the hold keeps.
    late_from = mono_hold + 0.75 * HOLD_SECONDS
    claims_late = [s for at, s in claim_seconds if late_from <= at < mono_hold + HOLD_SECONDS]
    held_late = await _latencies(conn, hold_until - 0.25 * HOLD_SECONDS, hold_until)
    assert base and held and claims_base and claims_held
    print(
        f"\nlong transactions held {HOLD_SECONDS:.0f}s ({written} rows, "
        f"~{KEYS_PER_TICK * 10} rows/s, "
        f"duplicates {verdict.duplicates}, dead tuples at the end {dead_tuples}):\n"
        f"  commit-to-mark ms  without: median {statistics.median(base) * 1000:.0f} "
        f"p95 {_p(base, 0.95) * 1000:.0f} max {max(base) * 1000:.0f} | "
        f"with: median {statistics.median(held) * 1000:.0f} p95 {_p(held, 0.95) * 1000:.0f} "
        f"max {max(held) * 1000:.0f} | last quarter: median "
        f"{statistics.median(held_late) * 1000:.0f} p95 {_p(held_late, 0.95) * 1000:.0f}\n"
        f"  claim ms           without: {_summary(claims_base)} | with: {_summary(claims_held)}"
        f" | last quarter: {_summary(claims_late)}\n"
        f"  longest dispatcher transaction seen {longest['transaction'] * 1000:.0f} ms"
    )
