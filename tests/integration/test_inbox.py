"""The consumer-side inbox against real duplicates: a dispatcher that published but never marked
(as if it crashed between the two) makes the next one publish the same events again."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import orjson
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient

from outbox_dispatcher.dispatch.settler import Settler
from outbox_dispatcher.dispatch.supervisor import Dispatcher
from outbox_dispatcher.inbox import Inbox, MissingEventIdError

from .helpers import Services, consume, insert_sequenced, running, wait_all_settled, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture
async def inbox_pool(database_url: str) -> Any:
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=4)
    try:
        yield pool
    finally:
        await pool.close()


async def test_redelivered_events_are_processed_once(
    conn: asyncpg.Connection,
    inbox_pool: asyncpg.Pool,
    services: Services,
    topic: str,
    make_settings: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await insert_sequenced(conn, topic, keys=5, per_key=20)
    settings = make_settings(lease_seconds=1.0)

    async def mark_lost(*_: object) -> int:
        return 0  # the broker acknowledged, the mark never reached the database

    with monkeypatch.context() as patch:
        patch.setattr(Settler, "settle_shielded", mark_lost)
        crashing = Dispatcher(settings)
        task = asyncio.create_task(crashing.run())

        async def all_published_once() -> bool:
            return crashing.published >= 100

        await wait_until(all_published_once, 30, "the first dispatcher to publish everything")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    async with running(settings):  # takes the rows over once their leases expire
        await wait_all_settled(conn, 60)
    records = await consume(services.kafka_bootstrap_servers, topic, 200)

    inbox = Inbox(inbox_pool)
    await inbox.create()
    await inbox.create()  # idempotent
    await conn.execute("CREATE TABLE effects (event_id uuid, seq integer)")

    async def apply(c: Any, record: Any) -> None:
        seq = orjson.loads(record.value)["seq"]
        await c.execute("INSERT INTO effects VALUES ($1, $2)", inbox.event_id(record), seq)

    outcomes = [await inbox.handle(r, apply) for r in records]
    assert outcomes.count(True) == 100
    assert outcomes.count(False) == len(records) - 100 >= 100
    assert tuple(await conn.fetchrow("SELECT count(*), count(DISTINCT event_id) FROM effects")) == (
        100,
        100,
    )


@dataclass
class FakeRecord:
    headers: list[tuple[str, bytes]]
    topic: str = "t"
    partition: int = 0
    offset: int = 7


async def test_a_failing_handler_records_nothing_so_a_redelivery_runs_it_again(
    inbox_pool: asyncpg.Pool,
) -> None:
    inbox = Inbox(inbox_pool, table="consumer_inbox")
    await inbox.create()
    record = FakeRecord([("event-id", str(uuid.uuid4()).encode())])
    calls = []

    async def flaky(_: Any, r: Any) -> None:
        calls.append(r)
        if len(calls) == 1:
            raise RuntimeError("handler failed")

    with pytest.raises(RuntimeError):
        await inbox.handle(record, flaky)
    assert await inbox_pool.fetchval("SELECT count(*) FROM consumer_inbox") == 0
    assert await inbox.handle(record, flaky) is True
    assert await inbox.handle(record, flaky) is False
    assert len(calls) == 2
    row = await inbox_pool.fetchrow(
        "SELECT topic, kafka_partition, kafka_offset FROM consumer_inbox"
    )
    assert tuple(row) == ("t", 0, 7)


async def test_records_without_an_event_id_are_refused(inbox_pool: asyncpg.Pool) -> None:
    inbox = Inbox(inbox_pool)

    async def never(*_: Any) -> None:
        raise AssertionError

    with pytest.raises(MissingEventIdError, match="no event id header"):
        await inbox.handle(FakeRecord([("other", b"x")]), never)
    with pytest.raises(MissingEventIdError, match="not a UUID"):
        await inbox.handle(FakeRecord([("event-id", b"nope")]), never)


def _documented_consumer() -> str:
    """The Python block of docs/consumers.md's Python section, as it stands."""
    text = (Path(__file__).parents[2] / "docs" / "consumers.md").read_text("utf-8")
    section = text.split("## Python: `outbox_dispatcher.inbox.Inbox`", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


async def test_the_documented_python_consumer_runs_as_written(
    services: Services, database_url: str, conn: asyncpg.Connection, topic: str
) -> None:
    code = _documented_consumer()
    assert "enable_auto_commit=False" in code and "group_id=" in code
    namespace: dict[str, Any] = {}
    exec(compile(code, "docs/consumers.md", "exec"), namespace)  # noqa: S102 - our own docs

    ids = [uuid.uuid4() for _ in range(3)]
    producer = AIOKafkaProducer(bootstrap_servers=services.kafka_bootstrap_servers)
    await producer.start()
    try:
        for event_id in [*ids, ids[0]]:  # the first one redelivered
            await producer.send_and_wait(
                topic, b"v", key=b"k", headers=[("event-id", str(event_id).encode())]
            )
    finally:
        await producer.stop()
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

        async def committed() -> int:
            offsets = await admin.list_consumer_group_offsets("orders-projection")
            return sum(m.offset for tp, m in offsets.items() if tp.topic == topic)

        async def done() -> bool:
            return await committed() == 4

        await wait_until(done, timeout=60, what="the consumer to commit all four records")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await admin.close()
    applied = [r["event_id"] for r in await conn.fetch("SELECT event_id FROM applied")]
    assert sorted(applied) == sorted(str(i) for i in ids)  # the duplicate was skipped
    assert await conn.fetchval("SELECT count(*) FROM inbox") == 3
