"""Exactly-once (review E14): whether the partitions a transaction stalled on are short of
in-sync replicas, read from the cluster's metadata and the topics' min.insync.replicas.

A partition that does not acknowledge is held (stalls.py) because it is taken for short of
replicas. Brokers with transaction verification (KIP-890 part 1, 3.6+) answer a producer of
aiokafka's Produce version NOT_ENOUGH_REPLICAS also when the transaction coordinator is in trouble
(CONCURRENT_TRANSACTIONS, COORDINATOR_NOT_AVAILABLE, NOT_COORDINATOR, ...), and aiokafka retries
it without end: healthy partitions then stalled, were held with doubling holds, and the alert
pointed at their replicas. A partition whose in-sync replicas are enough, with a leader, is not
held: the lane's new id (a new coordinator, most likely) carries its rows at once, and their
error says where to look.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import structlog
from aiokafka.admin import AIOKafkaAdminClient

from outbox_dispatcher import errors
from outbox_dispatcher.kafka import internals
from outbox_dispatcher.kafka.exactly_once import progress
from outbox_dispatcher.kafka.exactly_once.stalls import TopicPartition
from outbox_dispatcher.kafka.tls import ConnectionConfig

log = structlog.get_logger(__name__)

# Of the partitions given, those short of in-sync replicas (or whose state is unknown).
ShortOfReplicas = Callable[[set[TopicPartition]], Awaitable[set[TopicPartition]]]
CHECK_SECONDS = 3.0


def checker(connection: ConnectionConfig, seconds: float = CHECK_SECONDS) -> ShortOfReplicas:
    """The check against the cluster; when it cannot be read in time, every partition is taken
    for short (held, as before the check)."""

    async def short(partitions: set[TopicPartition]) -> set[TopicPartition]:
        try:
            async with asyncio.timeout(seconds):
                return await short_of_replicas(connection, partitions)
        except Exception as exc:  # noqa: BLE001 - unknown: held, as a short partition is
            log.info("replicas_unread", error=errors.describe(exc))
            return set(partitions)

    return short


async def every_one_short(partitions: set[TopicPartition]) -> set[TopicPartition]:
    """No check (tests, and the behaviour before it): every partition is taken for short."""
    return set(partitions)


async def short_of_replicas(
    connection: ConnectionConfig, partitions: set[TopicPartition]
) -> set[TopicPartition]:
    admin = AIOKafkaAdminClient(**progress.client_options(connection))
    await admin.start()
    try:
        topics = sorted({topic for topic, _ in partitions})
        described = await internals.describe_topics(admin, topics)
        minimums = {t: await _min_insync(admin, t) for t in topics}
        return short_among(partitions, described, minimums)
    finally:
        await admin.close()


async def _min_insync(admin: AIOKafkaAdminClient, topic: str) -> int:
    config = await internals.topic_config(admin, topic) or {}
    return int(config.get("min.insync.replicas") or 1)


def short_among(
    partitions: Iterable[TopicPartition],
    described: Sequence[Mapping[str, Any]],
    minimums: Mapping[str, int],
) -> set[TopicPartition]:
    """Of `partitions`, those without a leader, with fewer in-sync replicas than their topic's
    min.insync.replicas, with an error, or not described at all (`described`: the metadata's
    topics, as aiokafka's describe_topics returns them)."""
    healthy: set[TopicPartition] = set()
    for topic in described:
        name = str(topic["topic"])
        if topic["error_code"]:
            continue
        for p in topic["partitions"]:
            enough = len(p["isr"]) >= minimums.get(name, 1)
            if not p["error_code"] and p["leader"] >= 0 and enough:
                healthy.add((name, int(p["partition"])))
    return set(partitions) - healthy


class CoordinatorTroubleError(errors.NotAttempted):
    """The record's partition did not acknowledge a transaction in time although it has a leader
    and enough in-sync replicas: most likely the transaction coordinator's trouble, which brokers
    with transaction verification (KIP-890) answer as NOT_ENOUGH_REPLICAS. The row was not
    published; it goes again at once under the lane's new transactional id."""

    def __init__(self, partitions: Iterable[TopicPartition], why: str) -> None:
        names = ", ".join(sorted(f"{t}-{p}" for t, p in partitions))
        super().__init__(
            f"given up: partitions {names} {why}, though they have a leader and their in-sync "
            "replicas are enough: the transaction coordinator is most likely in trouble (KIP-890 "
            "verification reports it as NotEnoughReplicas); check the brokers leading "
            "__transaction_state (kafka-transactions.sh describe --transactional-id ...)"
        )
