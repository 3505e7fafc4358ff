"""Ceilings for the benchmark: Kafka alone and PostgreSQL alone, each driven the dispatcher's way.

The dispatcher's throughput means little on its own; these two numbers say how close it gets to
what its Kafka client and its database can do by themselves with the same settings, batch size
and concurrency. Nothing here logs: every function returns its numbers to the harness.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import asyncpg
from aiokafka import AIOKafkaProducer
from pydantic import SecretStr

from outbox_dispatcher.config.names import quote_identifier
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.claimer import Claimer
from outbox_dispatcher.dispatch.settler import Settler
from outbox_dispatcher.dispatch.supervisor import configs_of
from outbox_dispatcher.kafka.publisher import KafkaPublisher
from outbox_dispatcher.models import Batch, Outcome, Result
from outbox_dispatcher.store import DispatchStore, Statements, db

_OWNER = "benchmark-pg-only"
_PUBLISHED = Result(Outcome.PUBLISHED)


@dataclass(frozen=True, slots=True)
class _Record:
    key: bytes
    value: bytes
    headers: list[tuple[str, bytes]]


def _records(count: int, payload_size: int, keys: int, header: str) -> list[_Record]:
    value = b"x" * payload_size
    return [
        _Record(f"key-{i % keys}".encode(), value, [(header, str(uuid.uuid4()).encode())])
        for i in range(count)
    ]


def _batches(records: list[_Record], size: int) -> Iterator[list[_Record]]:
    for start in range(0, len(records), size):
        yield records[start : start + size]


async def _produce_loop(
    producer: AIOKafkaProducer, topic: str, batches: Iterator[list[_Record]]
) -> None:
    """One claim loop's publishing: hand a whole batch to the producer, then wait for its acks.
    The loops share one iterator, so each takes the next batch as a claim would."""
    for batch in batches:
        futures = [
            await producer.send(topic, value=r.value, key=r.key, headers=r.headers) for r in batch
        ]
        await asyncio.gather(*futures)  # a failed record fails the benchmark


async def _produce_batches_loop(
    producer: AIOKafkaProducer, topic: str, batches: Iterator[list[_Record]]
) -> None:
    """As _produce_loop, through the batch API: split the claim by partition as send() would,
    fill one BatchBuilder per partition (another when one is full), submit each with
    send_batch, then wait for the round's acks."""
    for batch in batches:
        by_partition: defaultdict[int, list[_Record]] = defaultdict(list)
        for r in batch:
            partition = producer._partition(topic, None, r.key, r.value, r.key, r.value)
            by_partition[partition].append(r)
        futures = []
        for partition, records in by_partition.items():
            builder = producer.create_batch()
            for r in records:
                # Full: submit it and start another (an empty batch always takes a record).
                while not builder.append(
                    key=r.key, value=r.value, timestamp=None, headers=r.headers
                ):
                    futures.append(await producer.send_batch(builder, topic, partition=partition))
                    builder = producer.create_batch()
            futures.append(await producer.send_batch(builder, topic, partition=partition))
        await asyncio.gather(*futures)  # a failed batch fails the benchmark


async def _timed_produce(
    bootstrap_servers: str,
    topic: str,
    count: int,
    payload_size: int,
    keys: int,
    settings: Settings,
    loop: Callable[[AIOKafkaProducer, str, Iterator[list[_Record]]], Coroutine[Any, Any, None]],
) -> float:
    """Seconds for `claim_tasks` copies of `loop` to publish `count` prepared records with the
    dispatcher's own producer, sharing one iterator of `batch_size` batches. Building the
    records, starting the producer and the topic's first metadata fetch are not timed."""
    settings = settings.model_copy(update={"kafka_bootstrap_servers": bootstrap_servers})
    records = _records(count, payload_size, keys, settings.event_id_header)
    publisher = KafkaPublisher(configs_of(settings).publisher)
    await publisher.start()
    try:
        producer = publisher.producers.current()
        await producer.partitions_for(topic)
        batches = _batches(records, settings.batch_size)
        started = time.perf_counter()
        async with asyncio.TaskGroup() as tg:
            for _ in range(settings.claim_tasks):
                tg.create_task(loop(producer, topic, batches))
        elapsed = time.perf_counter() - started
    finally:
        await publisher.stop()
    return elapsed


async def kafka_only(
    bootstrap_servers: str,
    topic: str,
    count: int,
    payload_size: int,
    keys: int,
    settings: Settings,
) -> float:
    """Seconds to publish `count` prepared records with the dispatcher's own producer (same
    settings, same send-a-batch-then-wait pattern, `claim_tasks` loops). Building the records,
    starting the producer and the topic's first metadata fetch are not timed."""
    return await _timed_produce(
        bootstrap_servers, topic, count, payload_size, keys, settings, _produce_loop
    )


async def kafka_only_batch_api(
    bootstrap_servers: str,
    topic: str,
    count: int,
    payload_size: int,
    keys: int,
    settings: Settings,
) -> float:
    """As kafka_only, but through aiokafka's batch API (create_batch/send_batch) instead of one
    send() per record: says how much of the Kafka ceiling is per-record overhead in send()
    rather than the broker. Same records, partitions, producer settings and concurrency."""
    return await _timed_produce(
        bootstrap_servers, topic, count, payload_size, keys, settings, _produce_batches_loop
    )


@dataclass(frozen=True, slots=True)
class _Pending:
    """Counts the rows still to drain (neither published nor dead)."""

    pool: asyncpg.Pool
    table: str

    async def count(self) -> int:
        value: int = await self.pool.fetchval(
            f"SELECT count(*) FROM {self.table} WHERE published_at IS NULL AND dead_at IS NULL"
        )
        return value


async def _drain_loop(claimer: Claimer, settler: Settler, pending: _Pending) -> int:
    """Claim and mark as published, skipping Kafka; stop on an empty table, or after two empty
    claims in a row (other loops may briefly hold every remaining key)."""
    marked = 0
    empty = 0
    while True:
        batch: Batch | None = await claimer.claim()
        if batch is None:
            empty += 1
            if empty >= 2 or await pending.count() == 0:
                return marked
            continue
        empty = 0
        marked += await settler.settle(batch, [_PUBLISHED] * len(batch.records))


async def pg_only(database_url: str, settings: Settings) -> tuple[int, float]:
    """Drain the (pre-filled) outbox with the dispatcher's claim and mark and no publishing:
    `claim_tasks` loops on one pool. Returns (rows marked published, seconds); creating the pool
    is not timed."""
    settings = settings.model_copy(update={"database_url": SecretStr(database_url)})
    queries = Statements.for_table(settings.db_schema, settings.table)
    pool = await db.create_pool(settings)
    try:
        claimer = Claimer(DispatchStore(pool, queries), settings, _OWNER)
        settler = Settler(DispatchStore(pool, queries), retry_for=settings.lease_seconds)
        table = f"{quote_identifier(settings.db_schema)}.{quote_identifier(settings.table)}"
        pending = _Pending(pool, table)
        started = time.perf_counter()
        async with asyncio.TaskGroup() as tg:
            loops = [
                tg.create_task(_drain_loop(claimer, settler, pending))
                for _ in range(settings.claim_tasks)
            ]
        elapsed = time.perf_counter() - started
    finally:
        await pool.close()
    return sum(loop.result() for loop in loops), elapsed
