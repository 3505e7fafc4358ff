"""Exactly-once's progress topic as it must be (docs/design/exactly-once.md, review E10): one
partition (a reader takes the last record of an id in log order), compacted and nothing else (a
dead owner's last record is kept however late its takeover comes), replicated up to 3 copies
with min.insync.replicas 2 (1 below 3 brokers). Created so when missing at start; checked at
start and before every read of it (a takeover, a commit without an answer): a topic deleted
while dispatchers run is made again by their next send with the broker's defaults, and what it
held is gone, so the mode stops with ProgressTopicError rather than decide from it. At start a
missing topic is created only while no key of the table is leased or holds the reconcile duty
(`unsettled`): otherwise it was deleted or renamed with batches in it that a takeover needs.
A topic one broker does not know yet (created just now by another dispatcher, the metadata still
on its way) is asked about again for PROPAGATION_SECONDS before it is called missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog
from aiokafka import errors as kafka_errors
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from outbox_dispatcher import errors
from outbox_dispatcher.kafka import internals
from outbox_dispatcher.kafka.exactly_once import progress
from outbox_dispatcher.kafka.tls import ConnectionConfig

log = structlog.get_logger(__name__)

# Small segments, so that what a takeover reads past the compacted part stays short.
TOPIC_CONFIG = {
    "cleanup.policy": "compact",
    "segment.ms": "600000",
    "min.cleanable.dirty.ratio": "0.1",
}
UNKNOWN_TOPIC = kafka_errors.UnknownTopicOrPartitionError.errno
# How long a topic missing from one broker's answer is asked about again: a topic made by another
# dispatcher a moment ago reaches every broker's metadata within a few hundred milliseconds.
PROPAGATION_SECONDS = 10.0
ASK_AGAIN_SECONDS = 0.25


class ProgressTopicError(errors.OutboxDispatcherError):
    """The progress topic is not as exactly-once needs it, or is gone: the mode stops (what the
    topic says cannot be trusted to decide which rows were committed)."""

    retriable = False


@dataclass(frozen=True)
class Needed:
    """What the topic must have on a cluster of `brokers` brokers."""

    brokers: int

    @property
    def replicas(self) -> int:
        return min(3, self.brokers)

    @property
    def min_insync(self) -> int:
        return 2 if self.replicas >= 3 else 1

    def config(self) -> dict[str, str]:
        return TOPIC_CONFIG | {"min.insync.replicas": str(self.min_insync)}

    def problems(self, partitions: int, replicas: int, config: dict[str, str]) -> list[str]:
        found = []
        if partitions != 1:
            found.append(f"{partitions} partitions (1 needed)")
        if config.get("cleanup.policy") != "compact":
            found.append(f"cleanup.policy={config.get('cleanup.policy')} (compact needed)")
        if replicas < self.replicas:
            found.append(f"replication factor {replicas} ({self.replicas} needed)")
        if int(config.get("min.insync.replicas", "1")) < self.min_insync:
            found.append(
                f"min.insync.replicas={config.get('min.insync.replicas')} "
                f"({self.min_insync} needed)"
            )
        return found


async def ensure(
    connection: ConnectionConfig, topic: str, unsettled: Callable[[], Awaitable[int]]
) -> None:
    """At start: create the topic if it is missing and nothing needs what it held (no key
    leased or holding the reconcile duty: `unsettled`), else check it."""
    admin = AIOKafkaAdminClient(**progress.client_options(connection))
    await admin.start()
    try:
        needed = Needed(len((await admin.describe_cluster())["brokers"]))
        if not await _listed(admin, topic, wait=0.0):
            keys = await unsettled()
            if keys and not await _listed(admin, topic, wait=PROPAGATION_SECONDS):
                missing = (
                    f"it does not exist, while {keys} keys of the table are leased or hold the "
                    "reconcile duty (their committed batches were in it: deleted, or "
                    "OUTBOX_PROGRESS_TOPIC changed?). If no dispatcher ever used it (a first "
                    "start beside dispatchers of at-least-once), create it yourself"
                )
                raise ProgressTopicError(_advice(topic, needed, [missing]))
            if not keys:
                await _create(admin, topic, needed)
                return
        await _check(admin, topic, needed)
    finally:
        await admin.close()


async def _create(admin: AIOKafkaAdminClient, topic: str, needed: Needed) -> None:
    """Make the topic as needed; one made a moment ago by another dispatcher is checked."""
    with contextlib.suppress(kafka_errors.TopicAlreadyExistsError):
        new = NewTopic(topic, 1, needed.replicas, topic_configs=needed.config())
        await admin.create_topics([new])
        log.info("progress_topic_created", topic=topic, replicas=needed.replicas)
        return
    await _check(admin, topic, needed)


async def check(connection: ConnectionConfig, topic: str) -> None:
    """Before a read: the topic exists and is still as needed (ProgressTopicError if not)."""
    admin = AIOKafkaAdminClient(**progress.client_options(connection))
    await admin.start()
    try:
        await _check(admin, topic, Needed(len((await admin.describe_cluster())["brokers"])))
    finally:
        await admin.close()


async def _listed(admin: AIOKafkaAdminClient, topic: str, wait: float) -> bool:
    """Whether the topic exists, asked again for `wait` seconds while an answer lacks it."""
    deadline = time.monotonic() + wait
    while topic not in await admin.list_topics():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(ASK_AGAIN_SECONDS)
    return True


async def _check(admin: AIOKafkaAdminClient, topic: str, needed: Needed) -> None:
    deadline = time.monotonic() + PROPAGATION_SECONDS
    while (found := await _described(admin, topic)) is None:
        if time.monotonic() >= deadline:
            raise ProgressTopicError(_advice(topic, needed, ["it does not exist (deleted?)"]))
        await asyncio.sleep(ASK_AGAIN_SECONDS)
    partitions, replicas, config = found
    if problems := needed.problems(partitions, replicas, config):
        raise ProgressTopicError(_advice(topic, needed, problems))


async def _described(
    admin: AIOKafkaAdminClient, topic: str
) -> tuple[int, int, dict[str, str]] | None:
    """The topic's partition count, least replication and configuration; None while the broker
    asked does not know it."""
    [described] = await admin.describe_topics([topic])
    if described["error_code"] == UNKNOWN_TOPIC or not described["partitions"]:
        return None
    partitions = described["partitions"]
    config = await internals.topic_config(admin, topic)
    if config is None:
        return None
    return len(partitions), min(len(p["replicas"]) for p in partitions), config


def _advice(topic: str, needed: Needed, found: list[str]) -> str:
    return (
        f"the progress topic {topic!r} is not as exactly-once needs it: {'; '.join(found)}. "
        f"It must have 1 partition, cleanup.policy=compact, replication factor "
        f"{needed.replicas} and min.insync.replicas {needed.min_insync}. Fix its settings with "
        "kafka-configs.sh --alter; a wrong partition count or replication, or a topic deleted "
        "or made again while dispatchers ran, cannot be fixed in place: stop every dispatcher of "
        "the tables that use it, reconcile their unmarked batches (docs/design/exactly-once.md), "
        "and start them on a new topic (OUTBOX_PROGRESS_TOPIC) that has those settings"
    )
