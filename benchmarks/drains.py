"""Drains: rows already in the table (or a burst committed while the dispatcher waits), timed until
the last is published. Each also says how many rows it left stranded: pending when nothing had
moved for STALL_LIMIT seconds (0 in a drain that finished)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import asyncpg

from benchmarks.load import KEYS, STUCK_KEY, consumed_in_order, insert_rows, make_stuck, prefill
from benchmarks.processes import (
    Dispatchers,
    backend_cpu_by_pid,
    backend_cpu_since,
    dispatchers,
    slow_broker,
    wait_ready,
)
from benchmarks.stack import Stack, connection, fresh, settings_for

STALL_LIMIT = 60.0  # seconds without a row settled after which the pending rows are stranded
EMPTIED_KEYS = 1000  # keys published while a writer transaction stays open (open_writer)
PENDING_FROM = (
    "SELECT id FROM outbox WHERE id >= $1 AND id <= $2 "
    "AND published_at IS NULL AND dead_at IS NULL ORDER BY id LIMIT 1"
)
# Rows the table's statistics say were updated or deleted (marks, deletes on publish): moves
# even while the lowest pending row waits (a retry in backoff).
SETTLED = "SELECT n_tup_upd + n_tup_del FROM pg_stat_user_tables WHERE relid = 'outbox'::regclass"


async def wait_drained(
    conn: asyncpg.Connection, first: int, last: int | None = None, *, interval: float = 0.02
) -> int:
    """Until no row with an id in [first, last] is pending; returns how many are left pending
    when none settled for STALL_LIMIT seconds (stranded). Walks the primary key upwards from the
    lowest row still pending, so that polling costs the database little."""
    low, upto = first, last if last is not None else 2**62
    settled = await conn.fetchval(SETTLED)
    moved = time.monotonic()
    while (pending := await conn.fetchval(PENDING_FROM, low, upto)) is not None:
        now = time.monotonic()
        if pending > low:
            low, moved = pending, now
        elif now - moved > STALL_LIMIT:
            count = await conn.fetchval(SETTLED)
            if count == settled:
                left: int = await conn.fetchval(
                    "SELECT count(*) FROM outbox WHERE id >= $1 AND id <= $2 "
                    "AND published_at IS NULL AND dead_at IS NULL",
                    first,
                    upto,
                )
                print(f"STRANDED: {left} rows pending, none settled for {STALL_LIMIT:.0f} s")
                return left
            settled, moved = count, now
        await asyncio.sleep(interval)
    return 0


async def drain(
    stack: Stack,
    rows: int,
    keys: int,
    processes: int = 1,
    *,
    stuck: str | None = None,
    stuck_rows: int = 0,
    broker_delay: float = 0.0,
    **opts: Any,
) -> dict[str, float]:
    """`drain_in` a fresh database."""
    async with fresh(stack) as (url, topic):
        return await drain_in(
            stack,
            url,
            topic,
            rows,
            keys,
            processes,
            stuck=stuck,
            stuck_rows=stuck_rows,
            broker_delay=broker_delay,
            **opts,
        )


async def drain_beside_at_least_once(
    stack: Stack, rows: int, keys: int, **opts: Any
) -> dict[str, float]:
    """`drain` with `opts`, right after the same drain at least once, in each run: a mode's
    ratio compares neighbours. In a full run the at-least-once `drain` comes half an hour
    before the last scenarios, and the machine drifts by more than the modes differ (2026-12-05:
    0.76x against the drain of the run's start, 0.93-1.11x in five pairs run in turn)."""
    base = await drain(stack, rows, keys)
    figures = await drain(stack, rows, keys, **opts)
    return {
        **figures,
        "rows_stranded": figures["rows_stranded"] + base["rows_stranded"],
        "at_least_once_events_per_second": base["events_per_second"],
        "at_least_once_postgres_cpu_ms_per_1k": base["postgres_cpu_ms_per_1k"],
        "vs_at_least_once": figures["events_per_second"] / base["events_per_second"],
        "postgres_cpu_vs_at_least_once": figures["postgres_cpu_ms_per_1k"]
        / base["postgres_cpu_ms_per_1k"],
    }


async def drain_in(
    stack: Stack,
    url: str,
    topic: str,
    rows: int,
    keys: int,
    processes: int = 1,
    *,
    stuck: str | None = None,
    stuck_rows: int = 0,
    broker_delay: float = 0.0,
    **opts: Any,
) -> dict[str, float]:
    """Rows already in the table; events/s from the first to the last row marked published.
    With `stuck`, STUCK_KEY's `stuck_rows` rows that cannot move are written first and the
    figures are those of the other keys' rows; with `broker_delay`, the dispatchers reach the
    broker through the fault proxy."""
    async with contextlib.AsyncExitStack() as exits:
        if stuck:
            opts.update(await make_stuck(url, topic, stuck, stuck_rows))
        writer_wal, first = await prefill(url, topic, rows, keys)
        if broker_delay:
            bootstrap = await exits.enter_async_context(slow_broker(stack, broker_delay))
            opts["kafka_bootstrap_servers"] = bootstrap
        settings = settings_for(url, stack, **opts)
        conn = await exits.enter_async_context(connection(url))
        # No CHECKPOINT here: the prefill's and the drain's changes fall in the checkpoint cycle
        # that began just before the prefill, as a writer's insert and our claim and mark of its
        # row do in steady operation (one after a CHECKPOINT would charge the drain a full-page
        # image of every heap page, which new pages spare the insert).
        wal0 = await conn.fetchval("SELECT pg_current_wal_lsn()")
        fpi0 = await conn.fetchval("SELECT wal_fpi FROM pg_stat_wal")
        async with dispatchers(settings, processes) as group:
            # The clock starts when the oldest row is gone or published (as the database clock
            # does with the first published_at), not at process start-up.
            await wait_drained(conn, first, first, interval=0.005)
            started = time.monotonic()
            cpu0 = group.cpu()
            pg0 = await backend_cpu_by_pid(conn)
            # The stuck key's rows (and open_writer's emptied keys) are older than `first`: the
            # walk from `first` never reads them.
            stranded = await wait_drained(conn, first)
            wall = time.monotonic() - started
            cpu = group.cpu() - cpu0
            pg = backend_cpu_since(pg0, await backend_cpu_by_pid(conn))
            wal = await conn.fetchval("SELECT pg_current_wal_lsn() - $1::pg_lsn", wal0)
        # Backends report their WAL counters when they exit (the dispatchers' are gone now).
        await asyncio.sleep(0.5)
        fpi = await conn.fetchval("SELECT wal_fpi FROM pg_stat_wal") - fpi0
        span = await conn.fetchval(
            "SELECT extract(epoch FROM max(published_at) - min(published_at)) FROM outbox "
            "WHERE id >= $1",
            first,
        )
        dead = await conn.fetchval(
            "SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL AND id >= $1", first
        )
        left = await conn.fetchval(
            "SELECT count(*) FROM outbox WHERE ordering_key = $1 AND published_at IS NULL",
            STUCK_KEY,
        )
    assert dead == 0, f"{dead} rows dead-lettered in a benchmark"
    assert left == (stuck_rows if stuck else 0), f"the stuck key moved: {left} rows pending"
    dispatcher_wal = float(wal) / rows
    return {
        # By the database clock, first to last mark; with delete_on_publish (no marks) by this
        # process's clock from the dispatcher's connection to the last row gone.
        "events_per_second": rows / max(float(span) if span is not None else wall, 1e-3),
        "events_per_second_wall": rows / max(wall, 1e-3),
        "dispatcher_cpu_ms_per_1k": cpu * 1000 / (rows / 1000),
        "postgres_cpu_ms_per_1k": pg * 1000 / (rows / 1000),
        # The writer's share (its INSERT, right after a CHECKPOINT) and ours (everything from
        # the dispatcher's start to the last mark: claims, marks, the engine's work rows,
        # autovacuum).
        "wal_bytes_per_event_writer": writer_wal,
        "wal_bytes_per_event_dispatcher": dispatcher_wal,
        "wal_bytes_per_event_total": writer_wal + dispatcher_wal,
        # Full-page images in ours, cluster-wide (pg_stat_wal): near 0 unless a checkpoint fell
        # inside the drain.
        "wal_full_page_images_per_1k_events": fpi * 1000 / rows,
        "rows_stranded": float(stranded),
    }


async def hot_key(stack: Stack, rows: int) -> dict[str, float]:
    """All rows on one ordering key; the order is checked on the consumer side."""
    async with fresh(stack) as (url, topic):
        _, first = await prefill(url, topic, rows, 1)
        async with connection(url) as conn:
            async with dispatchers(settings_for(url, stack)) as group:
                await wait_ready(url, group)
                stranded = await wait_drained(conn, first, interval=0.05)
            span = await conn.fetchval(
                "SELECT extract(epoch FROM max(published_at) - min(published_at)) FROM outbox"
            )
        reordered, missing = await consumed_in_order(stack.bootstrap, topic, rows - stranded)
    if reordered or missing:
        print(f"REORDERED: hot key: {reordered} records out of order, {missing} never consumed")
    return {
        "events_per_second": rows / max(float(span or 0), 1e-6),
        "rows_stranded": float(stranded + missing),
        "rows_reordered": float(reordered),
    }


async def open_writer(stack: Stack, rows: int, *, held: bool) -> dict[str, float]:
    """Version 9's halt (review N1): a writer transaction holding one outbox row stays open
    (`held`) while EMPTIED_KEYS keys are published, emptied; then `drain_in` of `rows` rows over
    KEYS other keys. Without `held`, the same steps with no writer open. After the drain the
    writer commits and its row must be published too."""
    async with fresh(stack) as (url, topic), connection(url) as writer, connection(url) as conn:
        own = 0
        tx = writer.transaction()
        await tx.start()
        try:
            if held:
                own, _ = await insert_rows(writer, topic, 1, 1, key="open-writer")
            first, last = await insert_rows(conn, topic, EMPTIED_KEYS, EMPTIED_KEYS, None, "e-")
            async with dispatchers(settings_for(url, stack)) as group:
                await wait_ready(url, group)
                stranded = await wait_drained(conn, first, last)
            # The engine's view of the open writer: its row's id is a hole in the cursor.
            holes = await conn.fetchval("SELECT cardinality(hole_lo) FROM outbox_cursor")
            figures = await drain_in(stack, url, topic, rows, KEYS)
        finally:
            await tx.commit()
        if held:
            async with dispatchers(settings_for(url, stack)):
                stranded += await wait_drained(conn, own, own)
    figures["rows_stranded"] += stranded
    figures["cursor_holes_at_start"] = float(holes)
    return figures


async def burst(stack: Stack, rows: int, *, analyze: bool) -> dict[str, float]:
    """Issue 21 point 10: one transaction of `rows` rows over KEYS keys into a freshly migrated
    table (its statistics those of the empty table) while a dispatcher on default settings
    waits; events/s from the commit to the last row published, by the database clock. With
    `analyze`, an ANALYZE of the outbox in the same transaction: the statistics arrive with
    the rows."""
    async with fresh(stack) as (url, topic), connection(url) as conn:
        async with dispatchers(settings_for(url, stack)) as group:
            await wait_ready(url, group)
            await asyncio.sleep(1)  # the dispatcher has found nothing and waits for a wake-up
            async with conn.transaction():
                first, _ = await insert_rows(conn, topic, rows, KEYS)
                if analyze:
                    await conn.execute("ANALYZE outbox")
            committed = await conn.fetchval("SELECT clock_timestamp()")
            figures = await _timed(conn, group, first, rows)
        span = await conn.fetchval(
            "SELECT extract(epoch FROM max(published_at) - $1::timestamptz) FROM outbox",
            committed,
        )
    figures["events_per_second"] = rows / max(float(span or 0), 1e-3)
    return figures


async def _timed(
    conn: asyncpg.Connection, group: Dispatchers, first: int, rows: int
) -> dict[str, float]:
    """The CPU of the dispatchers and of their backends while they drain the rows from
    `first`, per 1k rows, and the rows stranded."""
    cpu0 = group.cpu()
    pg0 = await backend_cpu_by_pid(conn)
    stranded = await wait_drained(conn, first)
    cpu = group.cpu() - cpu0
    pg = backend_cpu_since(pg0, await backend_cpu_by_pid(conn))
    return {
        "dispatcher_cpu_ms_per_1k": cpu * 1000 / (rows / 1000),
        "postgres_cpu_ms_per_1k": pg * 1000 / (rows / 1000),
        "rows_stranded": float(stranded),
    }
