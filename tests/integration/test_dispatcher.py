"""The dispatcher in-process against real PostgreSQL and Kafka."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import orjson
import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from outbox_dispatcher import errors
from outbox_dispatcher.dispatch import leases
from outbox_dispatcher.dispatch.supervisor import Dispatcher

from .helpers import (
    Services,
    check,
    consume,
    count,
    event_ids,
    insert_sequenced,
    running,
    wait_all_settled,
    wait_until,
)

pytestmark = pytest.mark.integration


async def test_rows_become_kafka_records_with_key_value_headers_and_event_id(
    conn: asyncpg.Connection, services: Services, topic: str, make_settings: Any
) -> None:
    keyed = await conn.fetchval(
        "SELECT outbox_enqueue($1, 'order-7', '\\x00ff'::bytea, "
        '\'{"traceparent": "00-4bf92f-00f067-01", "x-tenant": "acme"}\')',
        topic,
    )
    tombstone = await conn.fetchval("SELECT outbox_enqueue($1, 'order-7', NULL)", topic)
    unkeyed = await conn.fetchval(
        "SELECT outbox_enqueue_json($1, NULL, '{\"n\": 1}'::jsonb)", topic
    )
    async with running(make_settings()):
        await wait_all_settled(conn, 30)
    records = await consume(services.kafka_bootstrap_servers, topic, 3)
    by_id = {dict(r.headers)["event-id"].decode(): r for r in records}
    assert set(by_id) == {str(keyed), str(tombstone), str(unkeyed)}
    first = by_id[str(keyed)]
    assert (first.key, first.value) == (b"order-7", b"\x00\xff")
    assert dict(first.headers) == {
        "traceparent": b"00-4bf92f-00f067-01",
        "x-tenant": b"acme",
        "event-id": str(keyed).encode(),
    }
    assert by_id[str(tombstone)].value is None
    assert by_id[str(tombstone)].offset > first.offset  # same key, same partition, in order
    assert by_id[str(unkeyed)].key is None
    assert orjson.loads(by_id[str(unkeyed)].value or b"") == {"n": 1}
    assert dict(by_id[str(unkeyed)].headers)["content-type"] == b"application/json"
    marked = await conn.fetch("SELECT published_at, lease_token, attempts FROM outbox")
    assert all(r["published_at"] and r["lease_token"] is None for r in marked)


async def test_custom_event_id_header(
    conn: asyncpg.Connection, services: Services, topic: str, make_settings: Any
) -> None:
    event_id = await conn.fetchval("SELECT outbox_enqueue($1, 'k', 'v'::bytea)", topic)
    async with running(make_settings(event_id_header="ce_id")):
        await wait_all_settled(conn, 30)
    consumer_records = await consume(services.kafka_bootstrap_servers, topic, 1)
    assert [dict(r.headers) for r in consumer_records] == [{"ce_id": str(event_id).encode()}]


async def test_oversized_payload_is_dead_lettered_while_other_keys_flow(
    conn: asyncpg.Connection, services: Services, topic: str, make_settings: Any
) -> None:
    await insert_sequenced(conn, topic, keys=5, per_key=20)
    big = await conn.fetchval(
        "SELECT outbox_enqueue($1, 'key-big', $2::bytea)", topic, b"x" * 2_000_000
    )
    async with running(make_settings(batch_size=10)):
        await wait_all_settled(conn, 60)
    row = await conn.fetchrow("SELECT * FROM outbox WHERE event_id = $1", big)
    assert row["dead_at"] is not None and row["published_at"] is None
    assert "MessageSizeTooLargeError" in row["last_error"]
    assert row["last_error"].startswith("permanent error, not retried")
    assert await count(conn, "published_at IS NOT NULL") == 100
    verdict = check(
        await consume(services.kafka_bootstrap_servers, topic, 100),
        await event_ids(conn) - {str(big)},
    )
    assert (verdict.lost, verdict.reordered, verdict.unexpected) == ([], [], [])


async def test_a_notification_wakes_the_dispatcher_long_before_the_next_poll(
    conn: asyncpg.Connection, topic: str, make_settings: Any
) -> None:
    async with running(make_settings(poll_interval_seconds=300)) as dispatcher:
        # Let every claim task go idle (its first claim finds nothing), then write.
        await asyncio.sleep(1)
        await conn.fetchval("SELECT outbox_enqueue($1, 'k', 'v'::bytea)", topic)

        async def published() -> bool:
            return dispatcher.published == 1

        await wait_until(published, 20, "the row to be published on NOTIFY")


async def test_writers_notify_only_while_a_dispatcher_waits(
    conn: asyncpg.Connection, database_url: str, topic: str
) -> None:
    """The notification's commit-time lock is what capped writers' commit rate: writers send one
    only while some dispatcher has announced that it waits (and not after its announcement
    lapsed)."""
    heard: list[str] = []
    listener = await asyncpg.connect(database_url)
    try:
        await listener.add_listener("public.outbox", lambda *args: heard.append(args[2]))

        async def write_and_listen() -> int:
            heard.clear()
            await conn.fetchval("SELECT outbox_enqueue($1, 'k', 'v'::bytea)", topic)
            await asyncio.sleep(0.5)
            return len(heard)

        assert await write_and_listen() == 0
        await conn.execute("INSERT INTO outbox_waiting VALUES ('d1', now() + interval '1 minute')")
        assert await write_and_listen() == 1
        await conn.execute("UPDATE outbox_waiting SET until = now() - interval '1 second'")
        assert await write_and_listen() == 0
    finally:
        await listener.close()


def claims_made(dispatcher: Dispatcher) -> float:
    """Claims of every loop so far, empty ones included (the claim histogram's count)."""
    return sum(
        sample.value
        for metric in dispatcher.metrics.claim_duration.collect()
        for sample in metric.samples
        if sample.name.endswith("_count")
    )


async def claims_for_a_trickle(
    dispatcher: Dispatcher, conn: asyncpg.Connection, topic: str
) -> float:
    """The claims made while 30 rows are written one by one over 3 s (after a first row)."""
    await conn.fetchval("SELECT outbox_enqueue($1, 'k', 'v'::bytea)", topic)
    await wait_all_settled(conn, 20)
    before = claims_made(dispatcher)
    for _ in range(30):
        await conn.fetchval("SELECT outbox_enqueue($1, 'k', 'v'::bytea)", topic)
        await asyncio.sleep(0.1)
    await wait_all_settled(conn, 20)
    return claims_made(dispatcher) - before


async def test_a_steady_trickle_is_claimed_on_notifications_not_by_fast_polling(
    conn: asyncpg.Connection, topic: str, make_settings: Any
) -> None:
    """With LISTEN, loops wait for writers' notifications between batches. Version 6 polled
    every 10 ms for a second after each batch instead, about 100 mostly empty claims a second
    per loop at any steady rate: a cost per claim the database paid whatever the rate."""
    async with running(make_settings(claim_tasks=2)) as dispatcher:
        made = await claims_for_a_trickle(dispatcher, conn, topic)
    # About two claims per notification (the batch, then one that finds nothing) and the
    # polling fallback of two loops (every 0.2 s here): some 90 for 3 s; polling fast made 600.
    assert made < 200, f"{made:.0f} claims for 30 rows written over 3 s"


async def test_a_loop_waits_for_the_next_notification_after_a_batch_that_drained_the_table(
    conn: asyncpg.Connection, topic: str, make_settings: Any
) -> None:
    """The steady path's claim says whether it left new rows behind the batch: when it did not,
    the loop waits for the next notification (one that came while the batch was published is
    kept) instead of claiming again at once, a claim that finds nothing (engine review 3: 12 %
    of a steady cycle). One claim per row of a trickle, not two; every row goes out."""
    async with running(make_settings(claim_tasks=1, poll_interval_seconds=5.0)) as dispatcher:
        made = await claims_for_a_trickle(dispatcher, conn, topic)
    # 30 notifications, one claim each (two each before: the batch, then an empty claim).
    assert made <= 36, f"{made:.0f} claims for 30 rows written over 3 s"


async def test_polling_still_works_without_listen(
    conn: asyncpg.Connection, topic: str, make_settings: Any
) -> None:
    async with running(make_settings(listen=False)):
        await asyncio.sleep(0.5)
        await conn.fetchval("SELECT outbox_enqueue($1, 'k', 'v'::bytea)", topic)
        await wait_all_settled(conn, 20)


async def test_a_dead_loop_stops_the_whole_dispatcher(
    make_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(*_: object, **__: object) -> None:
        await asyncio.sleep(0.2)
        raise RuntimeError("reclaimer bug")

    monkeypatch.setattr(leases, "reclaim", broken)
    dispatcher = Dispatcher(make_settings())
    with pytest.raises(ExceptionGroup) as caught:
        await asyncio.wait_for(dispatcher.run(), 30)
    assert caught.group_contains(RuntimeError, match="reclaimer bug")


async def test_a_loop_that_returns_is_a_dead_loop_too(
    make_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def gives_up(*_: object, **__: object) -> None:
        await asyncio.sleep(0.2)

    monkeypatch.setattr(leases, "keep_leases", gives_up)
    with pytest.raises(ExceptionGroup) as caught:
        await asyncio.wait_for(Dispatcher(make_settings()).run(), 30)
    assert caught.group_contains(errors.LoopDiedError, match="lease-keeper")


async def test_an_unreachable_broker_at_start_is_a_clear_error(make_settings: Any) -> None:
    settings = make_settings(kafka_bootstrap_servers="127.0.0.1:1", publish_timeout_seconds=2)
    with pytest.raises(errors.BrokerUnavailableError, match="OUTBOX_KAFKA_BOOTSTRAP_SERVERS"):
        await asyncio.wait_for(Dispatcher(settings).run(), 60)


async def test_an_unreachable_database_at_start_is_a_clear_error(make_settings: Any) -> None:
    settings = make_settings(database_url="postgresql://outbox:outbox@127.0.0.1:1/outbox")
    with pytest.raises(errors.DatabaseUnavailableError, match="OUTBOX_DATABASE_URL"):
        await asyncio.wait_for(Dispatcher(settings).run(), 60)


@pytest.mark.slow
async def test_broker_outage_dead_letters_nothing_and_recovers(
    conn: asyncpg.Connection, services: Services, make_topic: Any, make_settings: Any
) -> None:
    known, unseen = await make_topic(), await make_topic()
    settings = make_settings(
        publish_timeout_seconds=3, lease_seconds=4, max_attempts=1, backoff_max_seconds=2
    )
    await insert_sequenced(conn, known, keys=10, per_key=10)
    async with running(settings):
        await wait_all_settled(conn, 60)
        await services.broker("stop")
        try:
            # Rows for a topic the producer knows, and for one whose metadata it never fetched.
            await insert_sequenced(conn, known, keys=10, per_key=10, first_seq=10)
            await insert_sequenced(conn, unseen, keys=10, per_key=10)
            # Longer than a lease, with max_attempts=1: an outage may not cost a single attempt,
            # and nothing is marked that the broker did not acknowledge.
            await asyncio.sleep(12)
            assert await count(conn, "dead_at IS NOT NULL") == 0
            assert await count(conn, "published_at IS NULL") == 200
        finally:
            await services.broker("start")
        await wait_all_settled(conn, 120)
    assert await count(conn, "dead_at IS NOT NULL") == 0
    for topic, expected in ((known, 200), (unseen, 100)):
        records = await consume(services.kafka_bootstrap_servers, topic, expected, timeout=60)
        ids = {
            str(r["event_id"])
            for r in await conn.fetch("SELECT event_id FROM outbox WHERE topic = $1", topic)
        }
        verdict = check(records, ids)
        assert (verdict.lost, verdict.reordered, verdict.unexpected) == ([], [], [])


async def test_recovers_when_its_database_connections_are_killed(
    conn: asyncpg.Connection, services: Services, topic: str, make_settings: Any
) -> None:
    async with running(make_settings()) as dispatcher:
        await insert_sequenced(conn, topic, keys=5, per_key=10)
        await wait_all_settled(conn, 30)
        killed = await conn.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = 'outbox-dispatcher'"
        )
        assert killed >= 2  # the pool's and the LISTEN connection
        await insert_sequenced(conn, topic, keys=5, per_key=10, first_seq=10)
        await wait_all_settled(conn, 60)
        assert not dispatcher.stopping.is_set()
    verdict = check(
        await consume(services.kafka_bootstrap_servers, topic, 100), await event_ids(conn)
    )
    assert (verdict.lost, verdict.reordered, verdict.unexpected) == ([], [], [])


async def test_rows_without_a_topic_are_routed_by_template_or_default(
    conn: asyncpg.Connection, services: Services, make_topic: Any, make_settings: Any
) -> None:
    routed, fallback = await make_topic(), await make_topic()
    suffix = routed.removeprefix("test-")
    by_template = await conn.fetchval(
        "SELECT outbox_enqueue(NULL, 'k', 'a'::bytea, $1::jsonb)", f'{{"aggregate": "{suffix}"}}'
    )
    by_default = await conn.fetchval("SELECT outbox_enqueue(NULL, 'k', 'b'::bytea)")
    unroutable = await conn.fetchval(
        "SELECT outbox_enqueue(NULL, 'j', 'c'::bytea, '{\"aggregate\": \"not valid\"}')"
    )
    settings = make_settings(topic_template="test-{aggregate}", default_topic=fallback)
    async with running(settings):
        await wait_all_settled(conn, 30)
    [first] = await consume(services.kafka_bootstrap_servers, routed, 1)
    [second] = await consume(services.kafka_bootstrap_servers, fallback, 1)
    assert dict(first.headers)["event-id"] == str(by_template).encode()
    assert dict(second.headers)["event-id"] == str(by_default).encode()
    dead = await conn.fetchrow("SELECT * FROM outbox WHERE event_id = $1", unroutable)
    assert dead["dead_at"] is not None
    assert "made 'test-not valid' from the row's headers" in dead["last_error"]
    assert dead["last_error"].endswith("which is not a valid topic name")


async def test_a_row_without_topic_or_routing_is_dead_lettered_with_the_reason(
    conn: asyncpg.Connection, topic: str, make_settings: Any
) -> None:
    orphan = await conn.fetchval("SELECT outbox_enqueue(NULL, 'k', 'x'::bytea)")
    fine = await conn.fetchval("SELECT outbox_enqueue($1, 'k', 'y'::bytea)", topic)
    async with running(make_settings()):
        await wait_all_settled(conn, 30)
    rows = {r["event_id"]: r for r in await conn.fetch("SELECT * FROM outbox")}
    assert rows[fine]["published_at"] is not None  # skip policy: the key goes on
    assert rows[orphan]["dead_at"] is not None
    assert "neither OUTBOX_TOPIC_TEMPLATE nor OUTBOX_DEFAULT_TOPIC" in rows[orphan]["last_error"]


async def test_delete_on_publish_removes_acknowledged_rows_and_keeps_dead_ones(
    conn: asyncpg.Connection, services: Services, topic: str, make_settings: Any
) -> None:
    await insert_sequenced(conn, topic, keys=3, per_key=10)
    expected = await event_ids(conn)
    big = await conn.fetchval(
        "SELECT outbox_enqueue($1, 'key-0', $2::bytea)", topic, b"x" * 2_000_000
    )
    async with running(make_settings(delete_on_publish=True, batch_size=7)):
        await wait_all_settled(conn, 30)
    left = await conn.fetch("SELECT event_id, dead_at IS NOT NULL AS dead FROM outbox")
    assert [(r["event_id"], r["dead"]) for r in left] == [(big, True)], "only the dead row stays"
    verdict = check(await consume(services.kafka_bootstrap_servers, topic, 30), expected)
    assert (verdict.lost, verdict.reordered, verdict.unexpected) == ([], [], [])


@contextlib.asynccontextmanager
async def small_topic(
    bootstrap: str, max_message_bytes: int = 4096, config: dict[str, str] | None = None
) -> AsyncIterator[str]:
    """A one-partition topic whose broker refuses records above `max_message_bytes` (the
    producer's own limit is far higher, so the refusal is the broker's, asynchronous)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    name = f"small-{uuid.uuid4().hex[:12]}"
    try:
        await admin.create_topics(
            [
                NewTopic(
                    name,
                    num_partitions=1,
                    replication_factor=1,
                    topic_configs={"max.message.bytes": str(max_message_bytes), **(config or {})},
                )
            ]
        )
        yield name
        with contextlib.suppress(Exception):
            await admin.delete_topics([name])
    finally:
        await admin.close()


async def test_other_keys_do_not_wait_for_a_topic_that_cannot_be_found(
    conn: asyncpg.Connection, services: Services, topic: str, make_settings: Any
) -> None:
    """A topic that does not exist takes publish_timeout to be found missing (its metadata
    lookup waits for the broker to create it; this one it refuses: its name collides with an
    existing topic's). Keys of the same claim on known topics go out meanwhile: they are
    published and marked while the missing topic's row has not failed yet."""
    name = f"clash_{uuid.uuid4().hex[:12]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=services.kafka_bootstrap_servers)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, num_partitions=1, replication_factor=1)])
        await conn.execute(
            "INSERT INTO outbox (topic, ordering_key, payload) VALUES ($1, 'poison', 'x')",
            name.replace("_", "."),
        )
        await conn.executemany(
            "INSERT INTO outbox (topic, ordering_key, payload) VALUES ($1, $2, 'x')",
            [(topic, f"key-{k}") for k in range(20)],
        )
        async with running(make_settings(claim_tasks=1, publish_timeout_seconds=15)):

            async def others_published() -> bool:
                return (
                    await count(conn, "ordering_key <> 'poison' AND published_at IS NOT NULL") == 20
                )

            await wait_until(others_published, 60, "the other keys' rows to be published")
            poison = await conn.fetchrow(
                "SELECT attempts, published_at, dead_at FROM outbox WHERE ordering_key = 'poison'"
            )
    finally:
        with contextlib.suppress(Exception):
            await admin.delete_topics([name])
        await admin.close()
    assert poison is not None
    # Its lookup (15 s) was still running: the claim's other keys did not wait for it.
    assert tuple(poison) == (0, None, None)


@pytest.mark.parametrize("policy", ["skip", "block"])
async def test_a_key_across_topics_waits_for_its_earlier_row_to_be_acknowledged(
    policy: str, conn: asyncpg.Connection, services: Services, topic: str, make_settings: Any
) -> None:
    """Finding F1 of issue 10 (review F2): row 1 of key K goes to a topic whose broker refuses it
    (asynchronously, after the send), row 2 of K to another topic in the same claim. Row 2 must
    not be sent before row 1 is acknowledged: under `block` it stays unpublished behind the dead
    row, under `skip` it is published only after row 1 was settled."""
    async with small_topic(services.kafka_bootstrap_servers) as small:
        first = await conn.fetchval("SELECT outbox_enqueue($1, 'K', $2::bytea)", small, b"x" * 8192)
        second = await conn.fetchval("SELECT outbox_enqueue($1, 'K', 'after'::bytea)", topic)
        async with running(make_settings(dead_letter_policy=policy, batch_size=50)):

            async def first_dead() -> bool:
                return await count(conn, f"event_id = '{first}' AND dead_at IS NOT NULL") == 1

            await wait_until(first_dead, 30, "row 1 to be dead-lettered by the broker's refusal")
            if policy == "skip":
                await wait_all_settled(conn, 30)
            else:
                await asyncio.sleep(2)  # room for a wrong publish of row 2
        rows = {
            str(r["event_id"]): r
            for r in await conn.fetch("SELECT event_id, published_at, dead_at FROM outbox")
        }
        assert rows[str(first)]["published_at"] is None
        if policy == "block":
            assert rows[str(second)]["published_at"] is None, "row 2 went out behind a dead row 1"
            assert await consume(services.kafka_bootstrap_servers, topic, 0, timeout=3) == []
        else:
            assert rows[str(second)]["published_at"] > rows[str(first)]["dead_at"], (
                "row 2 was settled with row 1, so it was sent before row 1's answer"
            )


@pytest.mark.parametrize("case", ["oversized", "keyless_on_compacted"])
async def test_a_broker_rejection_dead_letters_only_the_refused_record(
    case: str, conn: asyncpg.Connection, services: Services, make_settings: Any
) -> None:
    """Finding F4 of issue 10 (review F9): the broker refuses a whole partition batch for one
    record (larger than the topic's max.message.bytes; keyless on a compacted topic, error 87,
    which aiokafka 0.14 reports as UnknownError); the 30 small rows of other keys that shared
    the batch are published with no attempt counted, and only the refused record is dead, with
    the broker's reason."""
    config = {"cleanup.policy": "compact"} if case == "keyless_on_compacted" else {}
    async with small_topic(services.kafka_bootstrap_servers, config=config) as small:
        if case == "oversized":
            bad = await conn.fetchval(
                "SELECT outbox_enqueue($1, 'big', $2::bytea)", small, b"x" * 8192
            )
            reason = "TooLarge"
        else:
            bad = await conn.fetchval("SELECT outbox_enqueue($1, NULL, 'v'::bytea)", small)
            reason = "UnknownError"
        await insert_sequenced(conn, small, keys=10, per_key=3)
        # linger: every record of the claim shares one producer batch.
        settings = make_settings(batch_size=100, kafka_linger_ms=200, max_attempts=1)
        async with running(settings):
            await wait_all_settled(conn, 60)
        dead = await conn.fetch("SELECT event_id, last_error FROM outbox WHERE dead_at IS NOT NULL")
        assert [str(r["event_id"]) for r in dead] == [str(bad)]
        assert reason in dead[0]["last_error"], dead[0]["last_error"]
        assert await count(conn, "published_at IS NOT NULL AND attempts = 0") == 30
        verdict = check(
            await consume(services.kafka_bootstrap_servers, small, 30),
            await event_ids(conn) - {str(bad)},
        )
        assert (verdict.lost, verdict.reordered, verdict.unexpected) == ([], [], [])
        assert verdict.duplicates == 0
