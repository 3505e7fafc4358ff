"""The load: rows written before the dispatcher starts (one bulk INSERT, as an outage's backlog or
a bulk load arrives), keys that cannot move, and writers committing at a steady rate."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import asyncpg
from aiokafka import AIOKafkaConsumer

from outbox_dispatcher.store import OperatorStore, Statements

PAYLOAD = 512
KEYS = 1000
STUCK_KEY = "stuck-key"  # the prefill's keys are key-<n>: no collision
STUCK_KEY_KINDS = ("block", "backoff", "paused", "replay")  # see make_stuck
STATEMENTS = Statements.for_table("public", "outbox")
REPLAY_BATCH = 250  # rows per hold batch of the stuck key's replay (as version 0.1 held)

INSERT_ROWS = (
    "WITH written AS (INSERT INTO outbox (topic, ordering_key, payload, headers) "
    "SELECT $1, coalesce($5, $6 || (i % $2)), "
    "convert_to(lpad(i::text, $3, 'x'), 'UTF8'), "
    "jsonb_build_object('seq', (i / $2)::text) FROM generate_series(0, $4 - 1) i "
    "RETURNING id) SELECT min(id), max(id) FROM written"
)


async def insert_rows(
    conn: asyncpg.Connection,
    topic: str,
    rows: int,
    keys: int,
    key: str | None = None,
    prefix: str = "key-",
) -> tuple[int, int]:
    """One INSERT of `rows` rows over `keys` keys `<prefix><n>` (or all on `key`), payloads
    numbered in id order (the hot key's consumer checks the order by them); returns the first
    and the last id written."""
    ids = await conn.fetchrow(INSERT_ROWS, topic, keys, PAYLOAD, rows, key, prefix)
    assert ids is not None
    return int(ids[0]), int(ids[1])


async def prefill(
    url: str, topic: str, rows: int, keys: int, key: str | None = None, prefix: str = "key-"
) -> tuple[float, int]:
    """`insert_rows` on a connection of its own; returns its WAL bytes per row, measured after a
    CHECKPOINT so that it pays its full-page images as the drain does, and its first id.
    Nothing else: no VACUUM or ANALYZE a user's backlog would not get (autovacuum comes when the
    product's settings on the table call it)."""
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("CHECKPOINT")
        wal0 = await conn.fetchval("SELECT pg_current_wal_lsn()")
        first, _ = await insert_rows(conn, topic, rows, keys, key, prefix)
        wal = await conn.fetchval("SELECT pg_current_wal_lsn() - $1::pg_lsn", wal0)
    finally:
        await conn.close()
    return float(wal) / rows, first


async def make_stuck(url: str, topic: str, kind: str, rows: int) -> dict[str, Any]:
    """`rows` pending rows of STUCK_KEY that cannot move: `block` (its head dead; the dispatcher
    runs with dead_letter_policy=block), `backoff` (its head waits an hour), `paused` (its rows
    in a topic of their own, paused), `replay` (published, then held by an unfinished replay).
    Returns the settings the dispatcher needs for it."""
    stuck_topic = f"{topic}-paused" if kind == "paused" else topic
    await prefill(url, stuck_topic, rows, 1, key=STUCK_KEY)
    conn = await asyncpg.connect(url)
    try:
        head = await conn.fetchval("SELECT min(id) FROM outbox WHERE ordering_key = $1", STUCK_KEY)
        if kind == "block":
            await conn.execute(
                "UPDATE outbox SET dead_at = now(), attempts = 10, last_error = 'benchmark' "
                "WHERE id = $1",
                head,
            )
            return {"dead_letter_policy": "block"}
        if kind == "backoff":
            await conn.execute(
                "UPDATE outbox SET attempts = 1, next_attempt_at = now() + interval '1 hour', "
                "last_error = 'benchmark' WHERE id = $1",
                head,
            )
        elif kind == "paused":
            await OperatorStore(conn, STATEMENTS).pause(
                topic=stuck_topic, reason="a stuck key", by=None
            )
        elif kind == "replay":
            await conn.execute(
                "UPDATE outbox SET published_at = now() WHERE ordering_key = $1", STUCK_KEY
            )
            last = await conn.fetchval(
                "SELECT max(id) FROM outbox WHERE ordering_key = $1", STUCK_KEY
            )
            # A replay of version 0.1 whose command died between hold and release (replay is
            # one transaction now): held for an hour, in batches, as that version held them.
            after = 0
            while True:
                after = await conn.fetchval(
                    "WITH batch AS (SELECT id FROM outbox WHERE ordering_key = $1 "
                    "AND published_at IS NOT NULL AND id > $2 AND id <= $3 ORDER BY id LIMIT $4), "
                    "held AS (UPDATE outbox o SET published_at = NULL, attempts = 0, "
                    "next_attempt_at = now() + interval '1 hour', "
                    "last_error = 'replayed by operator at (held)' "
                    "FROM batch b WHERE o.id = b.id RETURNING o.id) SELECT max(id) FROM held",
                    STUCK_KEY,
                    after,
                    last,
                    REPLAY_BATCH,
                )
                if after is None:
                    break
        else:
            msg = f"unknown stuck kind {kind!r}"
            raise ValueError(msg)
    finally:
        await conn.close()
    return {}


async def write_load(
    url: str,
    topic: str,
    rate: float | None,
    rows_per_tx: int,
    seconds: float,
    committed: dict[str, float],
    connections: int = 8,
    table: str = "outbox",
) -> int:
    """Writer transactions of `rows_per_tx` rows, paced to `rate` rows/s over `connections`."""
    pool = await asyncpg.create_pool(url, min_size=connections, max_size=connections)
    assert pool is not None
    payload = b"x" * PAYLOAD
    start = time.monotonic()
    end = start + seconds
    tx_interval = (rows_per_tx / rate) * connections if rate else 0.0
    sql = (
        f"INSERT INTO {table} (topic, ordering_key, payload) "
        "SELECT $1, k, $3 FROM unnest($2::text[]) AS k RETURNING event_id"
    )

    async def writer(n: int) -> int:
        count = 0
        next_at = start + n * tx_interval / connections
        i = n
        while True:
            now = time.monotonic()
            if now >= end:
                return count
            if tx_interval and next_at > now:
                await asyncio.sleep(next_at - now)
            keys = [f"key-{(i + j) % KEYS}" for j in range(rows_per_tx)]
            i += rows_per_tx * connections
            async with pool.acquire() as conn, conn.transaction():
                rows = await conn.fetch(sql, topic, keys, payload)
            done = time.monotonic()
            for row in rows:
                committed[str(row["event_id"])] = done
            count += len(rows)
            next_at += tx_interval

    try:
        return sum(await asyncio.gather(*(writer(n) for n in range(connections))))
    finally:
        await pool.close()


async def consumed_in_order(bootstrap: str, topic: str, rows: int) -> tuple[int, int]:
    """Payloads were numbered in id order: first deliveries must come back ascending. Returns
    how many came back below one delivered before them (reordered), and how many of `rows`
    never came (within 120 s)."""
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", group_id=None
    )
    await consumer.start()
    seen: set[int] = set()
    last = -1
    reordered = 0
    try:
        deadline = time.monotonic() + 120
        while len(seen) < rows and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=500, max_records=20_000)
            for records in batch.values():
                for record in records:
                    n = int((record.value or b"").lstrip(b"x"))
                    if n in seen:
                        continue
                    seen.add(n)
                    if n < last:
                        reordered += 1
                    last = max(last, n)
    finally:
        await consumer.stop()
    return reordered, max(rows - len(seen), 0)
