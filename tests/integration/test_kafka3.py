"""The end-to-end smoke test against a Kafka 3.x broker (deploy/local/services.sh kafka3-start,
3.9 in KRaft mode), since many managed clusters still run 3.x: rows in, records out, judged by
the checker. The rest of the suite runs against the local 4.x broker."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from tests.checker import verdict_for

from .helpers import insert_sequenced, running, wait_all_settled

# The first run on a machine fetches the 3.x jars through Maven (a few minutes, once).
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


@pytest.fixture
async def kafka3_topics(kafka3_bootstrap: str) -> AsyncIterator[list[str]]:
    names = [f"k3-{uuid.uuid4().hex[:12]}" for _ in range(2)]
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka3_bootstrap)
    await admin.start()
    try:
        await admin.create_topics(
            [NewTopic(n, num_partitions=3, replication_factor=1) for n in names]
        )
        yield names
        await admin.delete_topics(names)
    finally:
        await admin.close()


async def test_publishes_in_order_to_a_kafka_3_broker(
    conn: asyncpg.Connection,
    database_url: str,
    kafka3_bootstrap: str,
    kafka3_topics: list[str],
    make_settings: Any,
) -> None:
    first, second = kafka3_topics
    keys, per_key = 20, 25
    await insert_sequenced(conn, first, keys, per_key)
    await insert_sequenced(conn, second, keys, per_key, first_seq=per_key)
    # A keyed tombstone and an unkeyed row: the record shapes a broker may treat differently.
    await conn.execute("SELECT outbox_enqueue($1, 'tomb', NULL)", first)
    await conn.execute("SELECT outbox_enqueue_json($1, NULL, '{\"n\": 1}'::jsonb)", second)
    async with running(make_settings(kafka_bootstrap_servers=kafka3_bootstrap)):
        await wait_all_settled(conn, 60)
    verdict = await verdict_for(database_url, kafka3_bootstrap, kafka3_topics, timeout=60)
    summary = verdict.summary()
    assert verdict.ok, summary
    assert verdict.delivered == 2 * keys * per_key + 2, summary
    assert verdict.duplicates == 0, summary
    assert verdict.dead == [], summary
