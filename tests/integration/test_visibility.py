"""Visibility: rows of one key written by overlapping transactions whose ids and commits come in
different orders. The documented rule (docs/guarantees.md, "Per-key order and visibility"):
per key, a claim publishes in id order among the rows committed when it runs; a row that
commits late with a lower id is published after the higher ids already published, and before
any row that commits after it. Nothing is lost either way.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from typing import Any

import asyncpg
import orjson
import pytest

from outbox_dispatcher.config.settings import Settings

from .helpers import (
    Services,
    check,
    consume,
    event_ids,
    running,
    wait_all_settled,
    wait_until,
)

pytestmark = [pytest.mark.integration]

INSERT = (
    "INSERT INTO outbox (topic, ordering_key, payload) VALUES ($1, $2, $3) "
    "RETURNING id, event_id::text"
)


def _payload(key: str, seq: int, name: str) -> bytes:
    """The checker's payload shape; seq is the order the documented rule expects."""
    return orjson.dumps({"key": key, "seq": seq, "name": name})


async def _published(conn: asyncpg.Connection, row_id: int) -> bool:
    value: bool = await conn.fetchval(
        "SELECT published_at IS NOT NULL FROM outbox WHERE id = $1", row_id
    )
    return value


async def test_a_lower_id_that_commits_late_is_published_after_higher_ids_never_lost(
    conn: asyncpg.Connection,
    database_url: str,
    services: Services,
    topic: str,
    make_settings: Any,
) -> None:
    await late_lower_id(conn, database_url, services, topic, make_settings(http_port=0))


async def late_lower_id(
    conn: asyncpg.Connection,
    database_url: str,
    services: Services,
    topic: str,
    settings: Settings,
) -> None:
    """The scenario, for any dispatcher settings (test_pgbouncer runs it through PgBouncer)."""
    t1 = await asyncpg.connect(database_url)
    t2 = await asyncpg.connect(database_url)
    try:
        async with running(settings):
            # T1 takes id n and stays open; T2 takes n+1 and commits.
            tx1 = t1.transaction()
            await tx1.start()
            row_n = await t1.fetchrow(INSERT, topic, "k", _payload("k", 1, "n"))
            async with t2.transaction():
                row_n1 = await t2.fetchrow(INSERT, topic, "k", _payload("k", 0, "n+1"))
            assert row_n1["id"] > row_n["id"]

            async def n1_published() -> bool:
                return await _published(conn, row_n1["id"])

            await wait_until(n1_published, 30, "n+1 to be published while n is uncommitted")
            assert not await _published(conn, row_n["id"])
            await asyncio.sleep(0.5)  # several more claims see nothing of n
            await tx1.commit()
            # A row committed after n, same key: n must come before it.
            row_n2 = await conn.fetchrow(INSERT, topic, "k", _payload("k", 2, "n+2"))

            async def all_published() -> bool:
                return await _published(conn, row_n["id"]) and await _published(conn, row_n2["id"])

            await wait_until(all_published, 30, "n and n+2 to be published")
    finally:
        await t1.close()
        await t2.close()
    records = await consume(services.kafka_bootstrap_servers, topic, 3)
    verdict = check(records, await event_ids(conn))
    assert (len(verdict.lost), verdict.duplicates, verdict.reordered, verdict.unexpected) == (
        0,
        0,
        [],
        [],
    )
    # One key, one partition: offsets give Kafka's order.
    kafka_order = [
        orjson.loads(r.value or b"")["name"] for r in sorted(records, key=lambda r: r.offset)
    ]
    assert kafka_order == ["n+1", "n", "n+2"]


async def test_overlapping_writers_each_row_after_everything_committed_before_it_began(
    conn: asyncpg.Connection,
    database_url: str,
    services: Services,
    topic: str,
    make_settings: Any,
) -> None:
    """Many overlapping transactions on 3 keys, committing in random order. What the rule
    promises and this checks: every row is published once, and a row is published after every
    row of its key whose transaction had committed before its own transaction began (those were
    visible to any claim that could see it, and have lower ids)."""
    rng = random.Random(1234)
    # event id -> (key, began, committed, id)
    spans: dict[str, tuple[str, float, float, int]] = {}

    async def writer(n: int) -> None:
        c = await asyncpg.connect(database_url)
        try:
            for i in range(40):
                key = f"k{rng.randrange(3)}"
                began = time.monotonic()
                async with c.transaction():
                    row = await c.fetchrow(INSERT, topic, key, _payload(key, n * 1000 + i, "x"))
                    await asyncio.sleep(rng.uniform(0, 0.03))
                spans[row["event_id"]] = (key, began, time.monotonic(), row["id"])
        finally:
            await c.close()

    async with running(make_settings(http_port=0, batch_size=20)):
        await asyncio.gather(*(writer(n) for n in range(6)))
        await wait_all_settled(conn, 60)
    records = await consume(services.kafka_bootstrap_servers, topic, len(spans))
    verdict = check(records, set(spans))
    assert (len(verdict.lost), verdict.duplicates, verdict.unexpected) == (0, 0, [])
    order: dict[str, list[str]] = {}
    for r in sorted(records, key=lambda r: (r.partition, r.offset)):
        event_id = dict(r.headers)["event-id"].decode()
        order.setdefault(spans[event_id][0], []).append(event_id)
    violations = []
    for events in order.values():
        for later_pos, later in enumerate(events):
            began = spans[later][1]
            for earlier in events[later_pos + 1 :]:
                if spans[earlier][2] < began:
                    violations.append((earlier, later))
    assert violations == []
    # The interesting case happened: rows published after a higher id of their key.
    out_of_id_order = sum(
        1
        for events in order.values()
        for a, b in itertools.pairwise(events)
        if spans[a][3] > spans[b][3]
    )
    assert out_of_id_order > 0
    print(
        f"\n{len(spans)} rows, 6 overlapping writers: {out_of_id_order} published after a higher id"
    )
