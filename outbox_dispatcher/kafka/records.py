"""How a claimed row becomes a Kafka record: its topic, key, value and headers (the event id,
CloudEvents), the bytes it takes in a producer batch, and the partition its key maps to.

Everything about a record's shape lives here, so that a new header option is a change of this
file (and of its setting): the publisher sends what `RecordEncoder.encode` returns, nothing else.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from aiokafka import errors as kafka_errors
from aiokafka.partitioner import murmur2

from outbox_dispatcher import errors
from outbox_dispatcher.models import OutboxRecord
from outbox_dispatcher.routing import Router

Header = tuple[str, bytes]

# What a record adds to a producer batch beyond its key, value and headers (record framing,
# varints, the event id header), rounded up, and the CloudEvents headers when they are on: the
# per-row estimate of record_size.
RECORD_OVERHEAD = 128
CLOUDEVENTS_OVERHEAD = 384
# A producer batch's own header (record batch format v2).
BATCH_HEADER = 61
# A record's framing in a batch besides the lengths of its parts: its length, attributes,
# timestamp and offset deltas, at most.
RECORD_FRAMING = 21
# The most bytes the varint length of one part of a record takes (parts under 128 MiB).
VARINT_MAX = 4

TOMBSTONE_WITHOUT_KEY = (
    "a tombstone (NULL payload) needs an ordering_key: Kafka clients refuse a record with "
    "neither key nor value; give the row a key or a payload"
)


class KafkaRecord(NamedTuple):
    """A row as the producer sends it."""

    key: bytes | None
    value: bytes | None
    headers: list[Header]
    # At most this many bytes in a producer batch (the batch's header excluded): what the
    # publisher budgets per partition and wave.
    size: int


@dataclass(frozen=True)
class RecordConfig:
    """A record's shape: its topic when the row names none, the event id header, CloudEvents,
    and the largest request (OUTBOX_KAFKA_MAX_REQUEST_BYTES)."""

    default_topic: str | None
    topic_template: str | None
    event_id_header: str
    cloudevents: bool
    cloudevents_source: str
    cloudevents_type: str
    cloudevents_content_type: str
    max_request_bytes: int


class RecordEncoder:
    """Turns claimed rows into records under one dispatcher's record config."""

    def __init__(self, config: RecordConfig) -> None:
        self._config = config
        self._router = Router(config.default_topic, config.topic_template)
        self._event_id_header = config.event_id_header
        self._reserved = config.event_id_header.casefold()
        self._cloudevents = config.cloudevents
        self._max_request = config.max_request_bytes
        self._event_id_bytes = _utf8_len(config.event_id_header) + len(str(uuid.UUID(int=0)))
        # Added to record_size's estimate of every row (see waves.plan_waves).
        self.extra = CLOUDEVENTS_OVERHEAD if config.cloudevents else 0

    def topic(self, record: OutboxRecord) -> str | errors.RoutingError:
        """The row's topic, or why it has none (the row is dead-lettered with it)."""
        if record.topic is not None:
            return record.topic
        try:
            return self._router.topic_for(record.topic, record.headers)
        except errors.RoutingError as exc:
            return exc

    def topics(self, records: Sequence[OutboxRecord]) -> list[str | errors.RoutingError]:
        """Each row's topic, or why it has none."""
        return [self.topic(r) for r in records]

    def encode(self, record: OutboxRecord) -> KafkaRecord:
        """The record for a row. Raises UnpublishableRowError for a row that can never be one,
        MessageSizeTooLargeError for one larger than OUTBOX_KAFKA_MAX_REQUEST_BYTES (both
        permanent: the row is dead-lettered)."""
        key = record.ordering_key
        value = record.payload
        if key is None and value is None:
            raise errors.UnpublishableRowError(TOMBSTONE_WITHOUT_KEY)
        headers, size = _row_headers(record, self._reserved, skip_ce_id=self._cloudevents)
        headers.append((self._event_id_header, str(record.event_id).encode()))
        size += self._event_id_bytes
        if self._cloudevents:
            extra = cloudevents_headers(record, self._config)
            headers.extend(extra)
            size += sum(_utf8_len(name) + len(data) for name, data in extra)
        key_bytes = None if key is None else key.encode()
        size += (
            RECORD_FRAMING
            + (0 if key_bytes is None else len(key_bytes))
            + (0 if value is None else len(value))
            + VARINT_MAX * (3 + 2 * len(headers))
        )
        if size + BATCH_HEADER > self._max_request:
            exact = serialized_size(key_bytes, value, headers)
            if exact > self._max_request:
                msg = (
                    f"the record is {exact} bytes serialized, larger than the maximum request "
                    f"size OUTBOX_KAFKA_MAX_REQUEST_BYTES={self._max_request}"
                )
                raise kafka_errors.MessageSizeTooLargeError(msg)
        return KafkaRecord(key_bytes, value, headers, size)


def _row_headers(
    record: OutboxRecord, reserved: str, *, skip_ce_id: bool = False
) -> tuple[list[Header], int]:
    """The row's own headers, encoded, and their names' and values' bytes. A header named like
    the event id header in any letter case is dropped (consumers that normalise header names
    would read it as the id), and so is a row's `ce_id` under CloudEvents (ce_id is the event
    id). The schema admits only string values; a row stored under an older, laxer check may
    still hold others, and is dead-lettered, not a crash."""
    own = record.headers
    if not isinstance(own, dict):
        msg = f"headers must be a JSON object of strings, not {type(own).__name__}"
        raise errors.UnpublishableRowError(msg)
    headers: list[Header] = []
    size = 0
    for name, text in own.items():
        if name.casefold() == reserved or (skip_ce_id and name == "ce_id"):
            continue
        if not isinstance(text, str):
            msg = (
                f"header {name!r} is a JSON {type(text).__name__}, not a string: Kafka header "
                "values are strings; fix the row's headers, then requeue it"
            )
            raise errors.UnpublishableRowError(msg)
        data = text.encode()
        headers.append((name, data))
        size += (len(name) if name.isascii() else len(name.encode())) + len(data)
    return headers, size


def record_headers(record: OutboxRecord, event_id_header: str) -> list[Header]:
    """The row's headers, then the event id (see _row_headers for what is dropped and refused)."""
    headers, _ = _row_headers(record, event_id_header.casefold())
    headers.append((event_id_header, str(record.event_id).encode()))
    return headers


def cloudevents_headers(record: OutboxRecord, config: RecordConfig) -> list[Header]:
    """CloudEvents Kafka binding, binary mode: the payload is the event data and the attributes
    travel as ce_* headers. ce_id is always the event id; a row's own ce_* headers win."""
    extra = [("ce_id", str(record.event_id))]
    defaults = (
        ("ce_specversion", "1.0"),
        ("ce_source", config.cloudevents_source),
        ("ce_type", config.cloudevents_type),
        ("ce_time", record.created_at.isoformat()),
        ("content-type", config.cloudevents_content_type),
    )
    extra.extend((name, value) for name, value in defaults if name not in record.headers)
    return [(name, value.encode()) for name, value in extra]


def record_size(record: OutboxRecord, extra: int = 0) -> int:
    """An upper estimate of the row's bytes in a producer batch, from the row alone (`extra`:
    what the settings add to every row, RecordEncoder.extra)."""
    size = RECORD_OVERHEAD + extra + len(record.payload or b"")
    if record.ordering_key is not None:
        size += _utf8_len(record.ordering_key)
    headers = record.headers
    if isinstance(headers, dict):
        for name, value in headers.items():
            size += _utf8_len(str(name)) + _utf8_len(str(value)) + 4
    return size


def serialized_size(key: bytes | None, value: bytes | None, headers: Sequence[Header]) -> int:
    """The bytes the producer counts a record as when it checks max_request_size: a batch header
    and the record at its largest framing (record batch format v2, lengths as zigzag varints;
    -1, an absent key or value, takes one byte)."""
    size = BATCH_HEADER + RECORD_FRAMING
    for part in (key, value):
        size += 1 if part is None else _varint_size(len(part)) + len(part)
    size += _varint_size(len(headers))
    for name, data in headers:
        name_bytes = _utf8_len(name)
        size += _varint_size(name_bytes) + name_bytes + _varint_size(len(data)) + len(data)
    return size


def _varint_size(n: int) -> int:
    return max(1, ((n << 1).bit_length() + 6) // 7)


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode())


# murmur2 is pure Python in aiokafka (microseconds a key); keys repeat claim after claim.
_KEY_HASHES: dict[str, int] = {}
_KEY_HASHES_MAX = 1 << 16


def key_hash(key: str) -> int:
    """The positive murmur2 hash of the key's UTF-8 bytes, as Kafka's default partitioners take
    it (Java's and aiokafka's alike)."""
    hashed = _KEY_HASHES.get(key)
    if hashed is None:
        if len(_KEY_HASHES) >= _KEY_HASHES_MAX:
            _KEY_HASHES.clear()
        hashed = _KEY_HASHES[key] = murmur2(key.encode()) & 0x7FFFFFFF
    return hashed


def partition_in(ordered: Sequence[int], key: str) -> int:
    """The partition of `key` among a topic's partitions sorted by id (see partition_of)."""
    return ordered[key_hash(key) % len(ordered)]


def partition_of(key: str, partitions: Collection[int]) -> int:
    """The partition the producer's default partitioner gives a key: murmur2 of the key modulo
    the number of partitions, indexing the partitions in id order (Java's client sorts them;
    aiokafka lists the cached set, which for ids 0..n-1 iterates in the same order)."""
    return partition_in(sorted(partitions), key)
