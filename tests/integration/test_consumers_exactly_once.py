"""What a consumer gets from a topic an exactly-once dispatcher writes (docs/consumers.md, "In
exactly-once mode"; exactly-once review D3): the documented consumer reads read_committed and so
never applies a copy from an aborted transaction, which the default isolation level does; and
exactly-once publication does not make a sink exactly-once: a consumer killed between its own
commit and its offset commit applies a record twice unless it keeps the inbox."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid
from typing import Any

import asyncpg
import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka import errors as kafka_errors
from aiokafka.admin import AIOKafkaAdminClient

from .helpers import Services, insert_sequenced, running, wait_all_settled, wait_until
from .test_exactly_once import Owners, expire, run
from .test_inbox import _documented_consumer

pytestmark = pytest.mark.integration


def _eos(make_settings: Any) -> Any:
    return make_settings(
        delivery="exactly-once",
        progress_topic=f"progress-{uuid.uuid4().hex[:10]}",
        lease_seconds=3.0,
        transaction_timeout_seconds=2.0,
    )


async def _committed_offsets(bootstrap: str, topic: str) -> set[tuple[int, int]]:
    """(partition, offset) of every record a read_committed reader gets."""
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        isolation_level="read_committed",
    )
    await consumer.start()
    found: set[tuple[int, int]] = set()
    try:
        quiet = 0
        while quiet < 4:
            batch = await consumer.getmany(timeout_ms=500)
            got = {(r.partition, r.offset) for rs in batch.values() for r in rs}
            found |= got
            quiet = 0 if got else quiet + 1
    finally:
        await consumer.stop()
    return found


async def _log_with_aborted_copies(conn: asyncpg.Connection, owners: Owners, topic: str) -> None:
    """Six rows whose hung owner's transaction (sent, never committed) is aborted by the taker's
    fence; the taker commits the six again: the log holds 6 aborted and 6 committed records."""
    await insert_sequenced(conn, topic, keys=3, per_key=2)
    hung = await owners.publisher("owner-a")
    taker = await owners.publisher("owner-b")
    lost = await owners.claim("owner-a")
    producer = hung.lanes[0].producers.current()
    await producer.begin_transaction()
    for r in lost.records:
        headers = [("event-id", str(r.event_id).encode())]
        await (
            await producer.send(
                topic, r.payload, key=(r.ordering_key or "").encode(), headers=headers
            )
        )
    await expire(conn)
    taken = await owners.claim("owner-b")
    assert (await run(taker.publish(taken.records))).outcomes == [None] * 6
    with pytest.raises((kafka_errors.ProducerFenced, kafka_errors.KafkaError)):
        await asyncio.wait_for(producer.commit_transaction(), 10)


@pytest.mark.parametrize("isolation", ["as documented", "read_uncommitted"])
async def test_the_documented_consumer_applies_no_aborted_copy(
    conn: asyncpg.Connection,
    pool: Any,
    make_settings: Any,
    services: Services,
    database_url: str,
    topic: str,
    isolation: str,
) -> None:
    """The inbox records the offset of the copy it applied: as documented, every one is a
    committed record's; at the clients' default isolation level (the guide before this check)
    the first copy of each row, the aborted one, is what ran the handler."""
    owners = Owners(_eos(make_settings), pool)
    try:
        await _log_with_aborted_copies(conn, owners, topic)
    finally:
        await owners.stop()
    committed = await _committed_offsets(services.kafka_bootstrap_servers, topic)
    assert len(committed) == 6

    code = _documented_consumer()
    assert 'isolation_level="read_committed"' in code
    if isolation == "read_uncommitted":
        code = code.replace(
            'isolation_level="read_committed"', 'isolation_level="read_uncommitted"'
        )
    group = f"docs-{uuid.uuid4().hex[:8]}"
    code = code.replace('group_id="orders-projection"', f'group_id="{group}"')
    namespace: dict[str, Any] = {}
    exec(compile(code, "docs/consumers.md", "exec"), namespace)  # noqa: S102 - our own docs
    await conn.execute("CREATE TABLE applied (event_id text)")

    async def apply(db: asyncpg.Connection, record: Any) -> None:
        await db.execute(
            "INSERT INTO applied VALUES ($1)", dict(record.headers)["event-id"].decode()
        )

    task = asyncio.create_task(
        namespace["consume"](database_url, services.kafka_bootstrap_servers, topic, apply)
    )
    admin = AIOKafkaAdminClient(bootstrap_servers=services.kafka_bootstrap_servers)
    await admin.start()
    try:
        last = {p: max(o for q, o in committed if q == p) for p, _ in committed}

        async def consumed_all() -> bool:
            offsets = await admin.list_consumer_group_offsets(group)
            mine = {tp.partition: m.offset for tp, m in offsets.items() if tp.topic == topic}
            return all(mine.get(p, -1) > offset for p, offset in last.items())

        await wait_until(consumed_all, timeout=60, what="the documented consumer to read it all")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await admin.close()
    assert await conn.fetchval("SELECT count(DISTINCT event_id) FROM applied") == 6
    assert await conn.fetchval("SELECT count(*) FROM applied") == 6  # the inbox's work
    applied_at = {
        (r["kafka_partition"], r["kafka_offset"])
        for r in await conn.fetch("SELECT kafka_partition, kafka_offset FROM inbox")
    }
    aborted_applied = len(applied_at - committed)
    print(f"VERDICT consumer-isolation[{isolation}]: aborted_records_applied={aborted_applied}")
    assert aborted_applied == (0 if isolation == "as documented" else 6)


# A sink consumer as a reader of the guide might write one: its own write, its database commit,
# then its offset commit; KILL_AT makes it kill itself (-9) between the last two, at that record.
SINK_CONSUMER = r"""
import asyncio, os, signal, sys
import asyncpg
from aiokafka import AIOKafkaConsumer
from outbox_dispatcher.inbox import Inbox

async def main():
    kill_at = int(os.environ.get("KILL_AT", "-1"))
    consumer = AIOKafkaConsumer(
        os.environ["TOPIC"], bootstrap_servers=os.environ["BOOTSTRAP"],
        group_id=os.environ["GROUP"], enable_auto_commit=False, auto_offset_reset="earliest",
        isolation_level="read_committed")
    pool = await asyncpg.create_pool(os.environ["DATABASE_URL"], min_size=1, max_size=2)
    inbox = Inbox(pool, table="sink_inbox")
    await inbox.create()

    async def write(conn, record):
        event_id = dict(record.headers)["event-id"].decode()
        await conn.execute("INSERT INTO sink VALUES ($1)", event_id)

    await consumer.start()
    seen = quiet = 0
    loop = asyncio.get_running_loop()
    until = loop.time() + 90
    try:
        while loop.time() < until:
            batch = await consumer.getmany(timeout_ms=1000, max_records=1)
            if not batch:
                quiet += 1
                if seen and quiet >= 3:  # read to the end (a rejoin first reads nothing)
                    return
                continue
            quiet = 0
            for records in batch.values():
                for record in records:
                    if os.environ["INBOX"] == "1":
                        await inbox.handle(record, write)
                    else:
                        async with pool.acquire() as conn, conn.transaction():
                            await write(conn, record)
                    seen += 1
                    if seen == kill_at:
                        os.kill(os.getpid(), signal.SIGKILL)
                    await consumer.commit()
    finally:
        await consumer.stop()
        await pool.close()

asyncio.run(main())
"""


async def _run_sink(env: dict[str, str]) -> int:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SINK_CONSUMER, env={**os.environ, **env}
    )
    return await asyncio.wait_for(process.wait(), 120)


@pytest.mark.parametrize("inbox", [False, True], ids=["no-inbox", "inbox"])
async def test_a_sink_killed_between_its_commit_and_its_offset_commit_needs_the_inbox(
    conn: asyncpg.Connection,
    make_settings: Any,
    services: Services,
    database_url: str,
    topic: str,
    inbox: bool,
) -> None:
    """Twenty rows published by an exactly-once dispatcher, read read_committed by a consumer
    that is killed -9 after its 11th database commit and before that record's offset commit,
    then run again: it reads that record again, and only the inbox makes the second a no-op."""
    await insert_sequenced(conn, topic, keys=4, per_key=5)
    async with running(_eos(make_settings)):
        await wait_all_settled(conn, 60)
    await conn.execute("CREATE TABLE sink (event_id text)")
    env = {
        "TOPIC": topic,
        "BOOTSTRAP": services.kafka_bootstrap_servers,
        "GROUP": f"sink-{uuid.uuid4().hex[:8]}",
        "DATABASE_URL": database_url,
        "INBOX": "1" if inbox else "0",
    }
    assert await _run_sink({**env, "KILL_AT": "11"}) == -signal.SIGKILL
    assert await conn.fetchval("SELECT count(*) FROM sink") == 11
    assert await _run_sink(env) == 0
    rows = await conn.fetchval("SELECT count(*) FROM sink")
    distinct = await conn.fetchval("SELECT count(DISTINCT event_id) FROM sink")
    duplicates = rows - distinct
    print(
        f"VERDICT consumer-side[{'inbox' if inbox else 'no-inbox'}]: sink_duplicates={duplicates}"
    )
    assert distinct == 20
    assert duplicates == (0 if inbox else 1)
