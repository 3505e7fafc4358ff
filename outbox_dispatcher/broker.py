"""The one module that reaches below aiokafka's public API (AIOKafkaProducer's documented methods).

aiokafka 0.14 offers no public way to fail buffered batches, to ask for metadata without
auto-creating topics, to read the cached cluster metadata, or to open one raw connection; the
dispatcher needs each. Every reach is here, behind a small function, and
tests/unit/test_broker.py names each private attribute used, so that an aiokafka upgrade that
moves one fails there, clearly, rather than in an outage. The version is pinned in pyproject.toml.
"""

from __future__ import annotations

from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.cluster import ClusterMetadata
from aiokafka.conn import AIOKafkaConnection, create_conn
from aiokafka.protocol.metadata import MetadataRequest


def fail_buffered(producer: AIOKafkaProducer, exception: BaseException) -> None:
    """Fail every batch the producer still buffers (what aiokafka's own Sender._fail_all does
    when its sender dies), so that stop() need not wait for a broker that is away."""
    producer._message_accumulator.fail_all(exception)


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


async def topic_error_codes(producer: AIOKafkaProducer, topics: list[str]) -> dict[str, int] | None:
    """Per topic, the error code of a Metadata request (v4+) with allow_auto_topic_creation=false
    (0: it exists); None when the producer knows no broker to ask. Raises what the request
    raises (KafkaError, OSError)."""
    client = producer.client
    node = client.get_random_node()
    if node is None:
        return None
    response = await client.send(node, MetadataRequest(topics, allow_auto_topic_creation=False))
    return {entry[1]: entry[0] for entry in response.topics}


async def open_connection(host: str, port: int, **options: Any) -> AIOKafkaConnection:
    """One connection to one broker, authenticated the way the producer's would be (options:
    aiokafka.conn.create_conn's keywords); the caller closes it."""
    return await create_conn(host, port, **options)
