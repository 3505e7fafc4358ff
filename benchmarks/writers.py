"""What the relay's schema costs the application's writers: insert throughput into the outbox as
migrated against a table with the same columns and only its primary key, and the part each piece
of the schema takes."""

from __future__ import annotations

from benchmarks.load import write_load
from benchmarks.stack import Stack, connection, fresh

CONNECTIONS = 4
ROWS_PER_TX = 10
# A dispatcher that found nothing announces that it waits: while it does, every writer statement
# notifies (the wake-up trigger), the writers' worst case.
WAITING = (
    "INSERT INTO outbox_waiting (owner, until) VALUES ('benchmark', now() + interval '1 hour')"
)
AUTOVACUUM_OPTIONS = (
    "autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold, "
    "autovacuum_vacuum_insert_scale_factor, autovacuum_analyze_scale_factor, "
    "autovacuum_vacuum_cost_delay"
)
CHECKS = (
    "DROP CONSTRAINT outbox_topic_valid, DROP CONSTRAINT outbox_topic_not_internal, "
    "DROP CONSTRAINT outbox_headers_valid, DROP CONSTRAINT outbox_ordering_key_length"
)

# The outbox as migrated (schema version 11) with one part taken away at a time, and with all of
# them taken away (the primary key only). On INSERT the writers meet: the wake-up trigger (one
# check of <table>_waiting per statement, a notification while a dispatcher waits), the key
# index (ordering_key, id), the dead-key index (a predicate only: no entry for a pending row),
# the event_id unique index, the CHECKs, fillfactor 50 (room for the mark's HOT update) and the
# autovacuum options (an insert-driven vacuum every 5%). The engine's row triggers fire on
# UPDATE and DELETE only.
WRITER_PARTS = {
    "outbox": "",
    "without_wake_trigger": "DROP TRIGGER outbox_wake ON outbox",
    "without_checks": f"ALTER TABLE outbox {CHECKS}",
    "without_headers_check": "ALTER TABLE outbox DROP CONSTRAINT outbox_headers_valid",
    "without_topic_checks": (
        "ALTER TABLE outbox DROP CONSTRAINT outbox_topic_valid, "
        "DROP CONSTRAINT outbox_topic_not_internal"
    ),
    "without_event_id_unique": "ALTER TABLE outbox DROP CONSTRAINT outbox_event_id_key",
    "without_key_index": "DROP INDEX outbox_key_rows_idx",
    "without_fillfactor": "ALTER TABLE outbox RESET (fillfactor)",
    "without_autovacuum_options": f"ALTER TABLE outbox RESET ({AUTOVACUUM_OPTIONS})",
    "primary_key_only": (
        "DROP TRIGGER outbox_wake ON outbox; DROP TRIGGER outbox_note_change ON outbox; "
        "DROP TRIGGER outbox_note_removed_dead ON outbox; DROP TRIGGER outbox_truncated ON outbox; "
        f"ALTER TABLE outbox {CHECKS}, DROP CONSTRAINT outbox_event_id_key, "
        "DROP CONSTRAINT outbox_not_published_and_dead; "
        "DROP INDEX outbox_key_rows_idx, outbox_dead_key_idx, outbox_dead_id_idx, "
        "outbox_dead_at_idx; "
        f"ALTER TABLE outbox RESET (fillfactor, {AUTOVACUUM_OPTIONS})"
    ),
}

# What is left of the outbox once primary_key_only's DDL ran: must be nothing but the key.
LEFT_OVER = """
SELECT (SELECT count(*) FROM pg_index WHERE indrelid = 'outbox'::regclass AND NOT indisprimary)
     + (SELECT count(*) FROM pg_trigger WHERE tgrelid = 'outbox'::regclass AND NOT tgisinternal)
     + (SELECT count(*) FROM pg_constraint WHERE conrelid = 'outbox'::regclass AND contype <> 'p')
     + (SELECT coalesce(cardinality(reloptions), 0) FROM pg_class
         WHERE oid = 'outbox'::regclass)
"""


async def writer_cost(stack: Stack, seconds: float) -> dict[str, float]:
    """Writer throughput, 10-row transactions from 4 connections as fast as they can, no
    dispatcher running, into (a) the outbox as migrated with no dispatcher waiting, (b) the same
    while a dispatcher says it waits (every statement notifies), (c) a table with the same
    columns and only its primary key. Costs in % of (c)."""
    results = {}
    for case in ("outbox", "outbox_dispatcher_waiting", "primary_key_only"):
        async with fresh(stack) as (url, topic), connection(url) as conn:
            if case == "outbox_dispatcher_waiting":
                await conn.execute(WAITING)
            if case == "primary_key_only":
                await conn.execute(
                    "CREATE TABLE plain (LIKE outbox INCLUDING DEFAULTS INCLUDING IDENTITY); "
                    "ALTER TABLE plain ADD PRIMARY KEY (id)"
                )
            table = "plain" if case == "primary_key_only" else "outbox"
            await conn.execute("CHECKPOINT")
            wal0 = await conn.fetchval("SELECT pg_current_wal_lsn()")
            written = await write_load(
                url, topic, None, ROWS_PER_TX, seconds, {}, CONNECTIONS, table
            )
            wal = await conn.fetchval("SELECT pg_current_wal_lsn() - $1::pg_lsn", wal0)
            results[f"rows_per_second_{case}"] = written / seconds
            # The writers' WAL in 10-row transactions (the drain's writer share is one INSERT).
            results[f"wal_bytes_per_row_{case}"] = float(wal) / max(written, 1)
    plain = results["rows_per_second_primary_key_only"]
    results["cost_percent"] = 100 * (1 - results["rows_per_second_outbox"] / plain)
    results["cost_percent_dispatcher_waiting"] = 100 * (
        1 - results["rows_per_second_outbox_dispatcher_waiting"] / plain
    )
    return results


async def writer_cost_parts(stack: Stack, seconds: float) -> dict[str, float]:
    """Where the writers' cost goes: `writer_cost`'s load (10-row transactions, 4 connections,
    a dispatcher waiting, none running) into the outbox with one part of the schema dropped at
    a time. Each part's share is the throughput it gives back, in % of the primary-key-only
    table."""
    results = {}
    for case, ddl in WRITER_PARTS.items():
        async with fresh(stack) as (url, topic), connection(url) as conn:
            await conn.execute(WAITING)
            if ddl:
                await conn.execute(ddl)
            if case == "primary_key_only":
                left = await conn.fetchval(LEFT_OVER)
                assert left == 0, f"primary_key_only: {left} schema objects left on the outbox"
            await conn.execute("CHECKPOINT")
            written = await write_load(
                url, topic, None, ROWS_PER_TX, seconds, {}, CONNECTIONS, "outbox"
            )
            results[f"rows_per_second_{case}"] = written / seconds
    plain = results["rows_per_second_primary_key_only"]
    full = results["rows_per_second_outbox"]
    results["cost_percent"] = 100 * (1 - full / plain)
    for case in WRITER_PARTS:
        if case.startswith("without_"):
            gained = results[f"rows_per_second_{case}"] - full
            results[f"share_percent_{case.removeprefix('without_')}"] = 100 * gained / plain
    return results
