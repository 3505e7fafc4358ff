"""Waves (outbox_dispatcher/kafka/waves.py): which records of a claim go out together. A pure
function: no producer needed."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from outbox_dispatcher.kafka.records import partition_of, record_size
from outbox_dispatcher.kafka.waves import plan_waves
from outbox_dispatcher.models import OutboxRecord


def rec(i: int, topic: str | None, key: str | None) -> OutboxRecord:
    return OutboxRecord(i, topic, key, b"x", {}, uuid.uuid4(), datetime.now(UTC), 0, False)


def test_a_key_moves_to_the_next_wave_at_each_change_of_topic() -> None:
    """Finding F1 of issue 10: a key's rows for another topic (another partition) wait for the
    acks of its earlier rows; rows of one topic stay together (the producer orders them)."""
    records = [
        rec(0, "x", "k"),
        rec(1, "x", "k"),
        rec(2, "y", "k"),
        rec(3, "x", "other"),
        rec(4, "x", "k"),
        rec(5, "y", None),
        rec(6, "x", None),
        rec(7, "y", "other"),
    ]
    topics: list[str | BaseException] = [r.topic or "" for r in records]
    assert plan_waves(records, topics) == [[0, 1, 3, 5, 6], [2, 7], [4]]


def test_one_topic_is_one_wave() -> None:
    records = [rec(i, "x", f"k{i % 3}") for i in range(9)]
    assert plan_waves(records, [r.topic or "" for r in records]) == [list(range(9))]


def sized(i: int, topic: str, key: str | None, payload: int) -> OutboxRecord:
    return OutboxRecord(
        i, topic, key, b"x" * payload, {}, uuid.uuid4(), datetime.now(UTC), 0, False
    )


def test_a_wave_holds_at_most_one_producer_batch_per_partition() -> None:
    """Review F3 (issue 10 point 2): a hot key's rows in one partition never straddle two
    producer batches in flight at once; keys on other partitions fill the same wave."""
    limit = 4096
    hot = [sized(i, "t", "hot", 900) for i in range(10)]
    topics: list[str | BaseException] = ["t"] * 10
    waves = plan_waves(hot, topics, limit, lambda topic: {0, 1, 2, 3})
    assert [i for wave in waves for i in wave] == list(range(10)), "the key's order is kept"
    for wave in waves:
        assert sum(record_size(hot[i]) for i in wave) <= limit - 61
    assert len(waves) == 4
    # Another key on another partition rides along in the first wave.
    hot_partition = partition_of("hot", {0, 1, 2, 3})
    other = next(
        f"k{n}" for n in range(100) if partition_of(f"k{n}", {0, 1, 2, 3}) != hot_partition
    )
    mixed = [*hot, sized(10, "t", other, 900)]
    assert 10 in plan_waves(mixed, [*topics, "t"], limit, lambda topic: {0, 1, 2, 3})[0]


def test_keyless_rows_count_against_every_partition_of_their_topic() -> None:
    rows = [sized(0, "t", None, 3000), sized(1, "t", "k", 3000), sized(2, "u", "k2", 3000)]
    waves = plan_waves(rows, ["t", "t", "u"], 4096, lambda topic: {0, 1})
    assert waves == [[0, 2], [1]]


def test_a_record_larger_than_a_batch_is_alone_in_its_partition() -> None:
    rows = [sized(0, "t", "k", 10_000), sized(1, "t", "k", 10)]
    assert plan_waves(rows, ["t", "t"], 4096, lambda topic: {0}) == [[0], [1]]
