"""The one module that reaches below aiokafka's public API (AIOKafkaProducer's documented methods).

aiokafka 0.14 offers no public way to fail buffered batches, to ask for metadata without
auto-creating topics, to read the cached cluster metadata, to ask several brokers for it at once,
or to open one raw connection; the dispatcher needs each. Every reach is here, behind a small
function, and tests/unit/test_broker.py names each private attribute used, so that an aiokafka
upgrade that moves one fails there, clearly, rather than in an outage. The version is pinned in
pyproject.toml.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Collection, Iterable
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.client import ConnectionGroup
from aiokafka.cluster import ClusterMetadata
from aiokafka.conn import AIOKafkaConnection, create_conn
from aiokafka.errors import KafkaError
from aiokafka.producer import sender as aiokafka_sender
from aiokafka.protocol.metadata import MetadataRequest

# How many brokers a metadata lookup asks at once (see _first_answer).
ASKED_AT_ONCE = 3

# aiokafka retries an AddPartitionsToTxn refused with CONCURRENT_TRANSACTIONS (the previous
# transaction's markers not written yet, KAFKA-5477) after sender.BACKOFF_OVERRIDE, 20 ms, which
# every transaction begun right after another paid: 24 ms a transaction, back to back, on one
# local broker; 5.7 ms with 2 ms (exactly-once, kafka/exactly_once/publisher.py).
TRANSACTION_RETRY_SECONDS = 0.002


async def topic_config(admin: AIOKafkaAdminClient, topic: str) -> dict[str, str] | None:
    """A topic's configuration, every entry, or None when the broker asked does not know the
    topic (aiokafka exports no ConfigResource: the progress topic's check,
    kafka/exactly_once/topic.py)."""
    [response] = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
    resource = response.to_object()["resources"][0]
    if resource["error_code"]:
        return None
    return {str(e["config_names"]): str(e["config_value"]) for e in resource["config_entries"]}


async def describe_topics(admin: AIOKafkaAdminClient, topics: list[str]) -> list[Any]:
    """The topics' metadata (partitions, leaders, in-sync replicas) as describe_topics returns
    it, never creating a missing topic (the admin client's own request lets the broker do so)."""
    request = MetadataRequest(topics, allow_auto_topic_creation=False)
    response = await admin._send_request(request)
    topics_found: list[Any] = response.to_object()["topics"]
    return topics_found


def read_fatal_error(producer: AIOKafkaProducer) -> BaseException | None:
    """The error that ended a transactional producer's transaction (a fence), read from its
    transaction manager's waiter, which nothing awaits once the producer is replaced (asyncio
    would log it as never retrieved); None when there is none."""
    manager = producer._txn_manager
    waiter = None if manager is None else manager._transaction_waiter
    if waiter is None or not waiter.done() or waiter.cancelled():
        return None
    found: BaseException | None = waiter.exception()
    return found


def sender_failure(producer: AIOKafkaProducer) -> BaseException | None:
    """The error that ended the producer's sender task, None while it runs. aiokafka's sender
    dies on a fence and on any error it did not expect (CI met one as a broker restarted under
    an exactly-once load; aiokafka issues 1004 and 1151 report others): it fails the batches it
    holds, with a bare KafkaError naming that error as its cause, and puts its transaction
    manager in its fatal state, where begin, commit and abort fail an assertion. The producer
    never sends again: it is replaced (Producers.replace_if_broken), and a transaction of its
    is past ending (kafka/exactly_once/endings.py)."""
    task = producer._sender.sender_task
    if task is None or not task.done() or task.cancelled():
        return None
    found: BaseException | None = task.exception()
    return found


def quicken_transaction_retries() -> None:
    """Retry a partition's addition to a transaction after 2 ms, not 20 (process-wide)."""
    aiokafka_sender.BACKOFF_OVERRIDE = TRANSACTION_RETRY_SECONDS


def held_batches(producer: AIOKafkaProducer) -> list[Any]:
    """The batches the producer holds now (read_drains reads their waiters' failures later)."""
    accumulator = producer._message_accumulator
    held: list[Any] = [b for queue in accumulator._batches.values() for b in queue]
    held.extend(accumulator._pending_batches)
    return held


def read_drains(batches: Collection[Any]) -> None:
    """The batches' drain waiters' failures, read: a sender that died (a fence) failed them,
    and nobody waits on them (else asyncio reports each as never retrieved)."""
    for batch in batches:
        waiter = batch._drain_waiter
        if waiter.done() and not waiter.cancelled():
            waiter.exception()


def fail_buffered(producer: AIOKafkaProducer, exception: BaseException) -> None:
    """Fail every batch the producer still holds, those a request has carried included (what
    aiokafka's own Sender._fail_all does when its sender dies), so that stop() need not wait
    for a broker that is away. Only for a process that is stopping, or a transaction given up
    (nothing of it is committed): a batch a request carried may be in the broker's log already.
    The batches' drain waiters, which nobody waits on any more, have their failure read (else
    asyncio reports each as never retrieved)."""
    accumulator = producer._message_accumulator
    held = [b for queue in accumulator._batches.values() for b in queue]
    held.extend(accumulator._pending_batches)
    accumulator.fail_all(exception)
    for batch in held:
        waiter = batch._drain_waiter
        if waiter.done() and not waiter.cancelled():
            waiter.exception()


def withdraw_unsent(
    producer: AIOKafkaProducer,
    exception: BaseException,
    builders: Collection[object] | None = None,
) -> int:
    """Fail the batches the producer holds that no produce request has carried yet (those of
    `builders` only, when given), and return how many: none of them can be in the broker's
    log, so their records may be given back and sent again by anyone. A batch a request has
    carried (aiokafka counts its drains in retry_count) is left alone: the broker may have
    appended it, and only this producer's retries, under the same producer id and sequence
    numbers, are recognised by the broker as that append (issue 25). A withdrawn batch used no
    sequence number (they are assigned when a batch is drained). Its drain waiter is released,
    so that a submission waiting behind it appends its own batch."""
    accumulator = producer._message_accumulator
    wanted = None if builders is None else {id(b) for b in builders}
    withdrawn = 0
    for tp, queue in list(accumulator._batches.items()):
        for batch in list(queue):
            if batch.retry_count or (wanted is not None and id(batch._builder) not in wanted):
                continue
            queue.remove(batch)
            withdrawn += 1
            if not batch.future.done():
                batch.future.set_exception(exception)
            if not batch._drain_waiter.done():
                batch._drain_waiter.set_result(None)
        if not queue:
            del accumulator._batches[tp]
    return withdrawn


def producer_id(producer: AIOKafkaProducer) -> int | None:
    """The producer id the broker gave this idempotent producer (None before it has one), for
    the logs: the broker's log names each batch's producer id."""
    manager = producer._txn_manager
    if manager is None or not manager.has_pid():
        return None
    pid: int = manager.producer_id
    return pid


def track_topics(producer: AIOKafkaProducer, topics: Iterable[str]) -> None:
    """Keep `topics` in the producer's metadata refreshes. aiokafka fetches every topic's
    metadata until it tracks one (the first send() to a topic tracks it), then only those it
    tracks, and a refresh replaces the whole cache: a topic known from the first answer, never
    tracked, dropped out at the next refresh, and a batch already handed over for it waited for
    a leader that no refresh brought back (an exactly-once transaction stalled at its first
    claim, the progress record's send() having tracked its own topic)."""
    producer.client._topics.update(topics)


def known_partitions(producer: AIOKafkaProducer, topic: str) -> set[int] | None:
    """The topic's partitions in the producer's cached metadata; None when it has none yet
    (a send would then block on a metadata request)."""
    partitions: set[int] | None = producer.client.cluster.partitions_for_topic(topic)
    return partitions


def available_partitions(producer: AIOKafkaProducer, topic: str) -> set[int] | None:
    """The topic's partitions with a known leader in the producer's cached metadata (None: no
    metadata for it yet)."""
    partitions: set[int] | None = producer.client.cluster.available_partitions_for_topic(topic)
    return partitions


async def all_metadata(producer: AIOKafkaProducer) -> ClusterMetadata:
    """Every topic's metadata from a broker, naming no topic, so that nothing is auto-created;
    raises when no broker answers."""
    return await producer.client.fetch_all_metadata()


async def answers(producer: AIOKafkaProducer) -> None:
    """Returns once a broker answered a Metadata request naming no topic: connected brokers are
    asked first (_first_answer), then, if none is connected or none answered, aiokafka's own
    round of every known broker. Raises when no broker answers."""
    with contextlib.suppress(KafkaError, OSError):
        if await _first_answer(producer, MetadataRequest([])) is not None:
            return
    await producer.client.fetch_all_metadata()


async def topic_error_codes(producer: AIOKafkaProducer, topics: list[str]) -> dict[str, int] | None:
    """Per topic, the error code of a Metadata request (v4+) with allow_auto_topic_creation=false
    (0: it exists), asked of connected brokers first (_first_answer), else of a random one; None
    when the producer knows no broker to ask. Raises what the request raises (KafkaError,
    OSError)."""
    request = MetadataRequest(topics, allow_auto_topic_creation=False)
    response = await _first_answer(producer, request)
    if response is None:
        client = producer.client
        node = client.get_random_node()
        if node is None:
            return None
        response = await client.send(node, request)
    return {entry[1]: entry[0] for entry in response.topics}


async def load_topics(producer: AIOKafkaProducer, topics: list[str]) -> bool:
    """Fetch `topics`' metadata into the producer's cache from the first connected broker to
    answer, and track them (aiokafka's periodic refresh then keeps them; tracking them through
    its add_topic would also start a refresh from a random broker at once). The request names
    every topic already cached too: a response replaces the whole cache. False when no broker
    is connected or the answer names no broker; raises what the request raises when no broker
    asked answers. A topic still being created may come back without partitions: the
    producer's partitions_for() then waits for it the usual way."""
    client = producer.client
    cached: set[str] = client.cluster.topics()
    response = await _first_answer(producer, MetadataRequest(sorted(cached | set(topics))))
    if response is None or not response.brokers:
        return False
    client.cluster.update_metadata(response)
    client._topics.update(topics)
    return True


async def _first_answer(producer: AIOKafkaProducer, request: MetadataRequest) -> Any:
    """The first answer to `request` from up to ASKED_AT_ONCE brokers the producer is connected
    to, asked at once (None when it is connected to none).

    aiokafka asks one broker at a time, in random order, each within the request timeout, and
    opens one connection at a time for all brokers: a broker that never completes a connection
    or never answers (a network partition that drops packets) made a lookup wait a whole
    request timeout, and every connection the producer was opening meanwhile, so every key of
    the topic, about one time in three (CI, the blackholed-partition test). Only brokers
    already connected are asked: a silent one among them costs its request, not a connection.
    Raises the last failure when every broker asked failed."""
    client = producer.client
    nodes = [
        node.nodeId
        for node in client.cluster.brokers()
        if (conn := client._conns.get((node.nodeId, ConnectionGroup.DEFAULT))) is not None
        and conn.connected()
    ]
    if not nodes:
        return None
    pending = {
        asyncio.ensure_future(client.send(node, request))
        for node in random.sample(nodes, min(ASKED_AT_ONCE, len(nodes)))
    }
    failure: BaseException | None = None
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for asked in done:
                failure = asked.exception()
                if failure is None:
                    return asked.result()
    finally:
        for asked in pending:
            asked.cancel()  # aiokafka drops the answer of a cancelled request
    assert failure is not None  # noqa: S101 (every broker asked failed)
    raise failure


async def open_connection(host: str, port: int, **options: Any) -> AIOKafkaConnection:
    """One connection to one broker, authenticated the way the producer's would be (options:
    aiokafka.conn.create_conn's keywords); the caller closes it."""
    return await create_conn(host, port, **options)
