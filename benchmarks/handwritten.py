"""The baseline: the hand-written outbox relay most teams start from, kept small and honest.

One worker claims a handful of rows (FOR UPDATE SKIP LOCKED, marking them with its name), then, row
by row, sends the record and waits for the broker's acknowledgement (`send_and_wait`) and marks
that one row published with its own UPDATE (its own commit, at the server's default
synchronous_commit). It is correct enough to ship, which is why it is common, and slow for the
same reasons the dispatcher exists: each row pays a full Kafka round trip (acks=all, nothing
batched, since only one record is ever in flight) plus a database round trip and a commit. It
also has no lease expiry (a crash strands its claimed rows), no retry policy and no per-key
concurrency, none of which matter for a throughput baseline.
"""

from __future__ import annotations

import time
from typing import Any

import asyncpg
import orjson
from aiokafka import AIOKafkaProducer

EVENT_ID_HEADER = "event-id"

CLAIM = """
UPDATE outbox SET lease_owner = 'handwritten'
 WHERE id IN (SELECT id FROM outbox
               WHERE published_at IS NULL AND dead_at IS NULL AND lease_owner IS NULL
               ORDER BY id
               LIMIT $1
               FOR UPDATE SKIP LOCKED)
RETURNING id, topic, ordering_key, payload, headers, event_id
"""

MARK = "UPDATE outbox SET published_at = now() WHERE id = $1"


def _headers(row: Any) -> list[tuple[str, bytes]]:
    """The row's headers (jsonb, a JSON string on a plain connection) plus the event id."""
    stored: dict[str, str] = orjson.loads(row["headers"])
    headers = [(name, value.encode()) for name, value in stored.items()]
    headers.append((EVENT_ID_HEADER, str(row["event_id"]).encode()))
    return headers


async def run(database_url: str, bootstrap_servers: str, batch: int = 50) -> tuple[int, float]:
    """Drain the outbox the hand-written way with one worker; returns (rows published, seconds).
    Connecting and starting the producer are not timed."""
    conn: asyncpg.Connection = await asyncpg.connect(database_url)
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap_servers.split(","), acks="all", enable_idempotence=True
    )
    try:
        await producer.start()
        published = 0
        started = time.perf_counter()
        while True:
            async with conn.transaction():
                rows = await conn.fetch(CLAIM, batch)
            if not rows:
                break
            # RETURNING follows the update's order, not necessarily id order.
            for row in sorted(rows, key=lambda r: int(r["id"])):
                key = row["ordering_key"]
                await producer.send_and_wait(
                    row["topic"],
                    row["payload"],
                    key=key.encode() if key is not None else None,
                    headers=_headers(row),
                )
                await conn.execute(MARK, row["id"])
                published += 1
        elapsed = time.perf_counter() - started
    finally:
        await producer.stop()
        await conn.close()
    return published, elapsed
