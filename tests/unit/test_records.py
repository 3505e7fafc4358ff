"""How a row becomes a Kafka record (outbox_dispatcher/kafka/records.py): no broker needed."""

from __future__ import annotations

import random
import uuid
from datetime import UTC, datetime

import pytest
from aiokafka import errors as kafka_errors
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.record.default_records import DefaultRecordBatchBuilder

from outbox_dispatcher import errors
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.supervisor import configs_of
from outbox_dispatcher.kafka import failures
from outbox_dispatcher.kafka.records import (
    BATCH_HEADER,
    RecordEncoder,
    cloudevents_headers,
    partition_of,
    record_headers,
    record_size,
    serialized_size,
)
from outbox_dispatcher.models import Failure, OutboxRecord


def encoder_for(settings: Settings) -> RecordEncoder:
    return RecordEncoder(configs_of(settings).publisher.records)


EVENT_ID = uuid.UUID("0192a5f0-0000-7000-8000-000000000001")
CREATED = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def row(
    key: str | None = "k",
    payload: bytes | None = b"x",
    headers: dict[str, str] | None = None,
    topic: str | None = "t",
) -> OutboxRecord:
    return OutboxRecord(1, topic, key, payload, headers or {}, EVENT_ID, CREATED, 0, False)


def test_headers_carry_the_event_id_and_it_cannot_be_forged() -> None:
    record = row(
        headers={
            "traceparent": "00-ab",
            "event-id": "forged",
            "Event-ID": "forged",
            "EVENT-id": "x",
        }
    )
    assert record_headers(record, "event-id") == [
        ("traceparent", b"00-ab"),
        ("event-id", str(EVENT_ID).encode()),
    ]
    encoded = encoder_for(Settings()).encode(record)
    assert encoded.headers == record_headers(record, "event-id")
    assert (encoded.key, encoded.value) == (b"k", b"x")


def test_a_header_that_is_not_a_string_makes_the_row_unpublishable() -> None:
    record = row(headers={"n": 1})  # type: ignore[dict-item]
    with pytest.raises(errors.UnpublishableRowError, match="'n' is a JSON int"):
        encoder_for(Settings()).encode(record)
    with pytest.raises(errors.UnpublishableRowError, match="JSON object of strings"):
        encoder_for(Settings()).encode(row(headers=["a"]))  # type: ignore[arg-type]


def test_a_tombstone_needs_a_key() -> None:
    encoder = encoder_for(Settings())
    with pytest.raises(errors.UnpublishableRowError, match="tombstone"):
        encoder.encode(row(key=None, payload=None))
    assert encoder.encode(row(payload=None)).value is None
    assert encoder.encode(row(key=None)).key is None


def test_cloudevents_headers_follow_the_event_id_and_the_rows_own_win() -> None:
    settings = Settings(cloudevents=True, cloudevents_source="/orders")
    record = row(headers={"ce_type": "order.created", "ce_id": "forged", "a": "b"})
    names = [name for name, _ in encoder_for(settings).encode(record).headers]
    assert names == [
        "ce_type",
        "a",
        "event-id",
        "ce_id",
        "ce_specversion",
        "ce_source",
        "ce_time",
        "content-type",
    ]
    ce = dict(cloudevents_headers(record, configs_of(settings).publisher.records))
    assert ce["ce_id"] == str(EVENT_ID).encode() and ce["ce_source"] == b"/orders"
    assert ce["ce_time"] == CREATED.isoformat().encode()
    assert "ce_type" not in ce


def test_the_routed_topic_or_why_there_is_none() -> None:
    assert encoder_for(Settings()).topic(row(topic="mine")) == "mine"
    routed = encoder_for(Settings(topic_template="events.{agg}"))
    assert routed.topic(row(topic=None, headers={"agg": "orders"})) == "events.orders"
    assert isinstance(routed.topic(row(topic=None)), errors.RoutingError)


@pytest.mark.parametrize(
    "headers",
    [{}, {"a": "b"}, {"é-name": "välue", "x" * 200: "y" * 300}],
)
@pytest.mark.parametrize("payload", [None, b"", b"p" * 100, b"p" * 20_000])
@pytest.mark.parametrize("key", [None, "k", "ключ" * 40])
def test_sizes_match_the_producers_count_and_bound_the_bytes_in_a_batch(
    key: str | None, payload: bytes | None, headers: dict[str, str]
) -> None:
    """serialized_size is what aiokafka's send() compares with max_request_size; `size` is an
    upper bound of what the record takes in a batch (a wave budgets with it), and record_size,
    the estimate from the row alone, bounds it too."""
    if key is None and payload is None:
        return
    for settings in (Settings(), Settings(cloudevents=True)):
        encoder = encoder_for(settings)
        record = row(key, payload, headers)
        encoded = encoder.encode(record)
        assert serialized_size(
            encoded.key, encoded.value, encoded.headers
        ) == DefaultRecordBatchBuilder.estimate_size_in_bytes(
            encoded.key, encoded.value, encoded.headers
        )
        builder = DefaultRecordBatchBuilder(2, 0, 0, -1, -1, 0, 1 << 30)
        builder.append(0, None, encoded.key, encoded.value, encoded.headers)
        in_batch = builder.size() - BATCH_HEADER
        assert in_batch <= encoded.size <= in_batch + 64 + 8 * len(encoded.headers)
        assert record_size(record, encoder.extra) >= in_batch


def test_a_record_over_the_request_limit_is_refused_as_the_producer_would() -> None:
    limit = 4096
    encoder = encoder_for(Settings(kafka_max_request_bytes=limit))
    fits = row(payload=b"p" * 3800)
    size = serialized_size(b"k", fits.payload, encoder.encode(fits).headers)
    exact = row(payload=b"p" * (3800 + limit - size))
    encoder.encode(exact)  # exactly the limit: sent
    over = row(payload=b"p" * (3801 + limit - size))
    with pytest.raises(kafka_errors.MessageSizeTooLargeError) as refused:
        encoder.encode(over)
    assert "larger than the maximum request size" in str(refused.value)
    assert failures.classify(refused.value) is Failure.PERMANENT


def test_partitions_are_the_default_partitioners() -> None:
    """Keyed records go where aiokafka's (and Java's) default partitioner would put them."""
    rng = random.Random(7)
    partitioner = DefaultPartitioner()
    for n in (1, 2, 3, 6, 12, 50):
        partitions = set(range(n))
        for _ in range(200):
            key = "".join(rng.choice("abcdefghé-0123456789") for _ in range(rng.randint(0, 24)))
            assert partition_of(key, partitions) == partitioner(
                key.encode(), list(partitions), list(partitions)
            ), (key, n)
