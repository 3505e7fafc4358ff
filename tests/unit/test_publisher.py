from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime

import pytest
from aiokafka import errors as kafka_errors

from outbox_dispatcher import errors
from outbox_dispatcher import publisher as publisher_module
from outbox_dispatcher.dispatcher import acknowledged_keys
from outbox_dispatcher.models import OutboxRecord
from outbox_dispatcher.publisher import KafkaPublisher, NotAttempted, Sent, _waves
from outbox_dispatcher.records import partition_of, record_size
from outbox_dispatcher.settings import Settings


async def test_outcomes_split_acknowledged_failed_pending_and_unsent() -> None:
    loop = asyncio.get_running_loop()
    acked: asyncio.Future[object] = loop.create_future()
    acked.set_result("metadata")
    failed: asyncio.Future[object] = loop.create_future()
    boom = RuntimeError("boom")
    failed.set_exception(boom)
    pending: asyncio.Future[object] = loop.create_future()
    refused = ValueError("refused")
    sent = Sent([acked, failed, pending, refused])
    marker = NotAttempted("shut down")
    assert KafkaPublisher.outcomes(sent, marker, total=5) == [None, boom, marker, refused, marker]
    pending.cancel()


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
    assert _waves(records, topics) == [[0, 1, 3, 5, 6], [2, 7], [4]]


def test_one_topic_is_one_wave() -> None:
    records = [rec(i, "x", f"k{i % 3}") for i in range(9)]
    assert _waves(records, [r.topic or "" for r in records]) == [list(range(9))]


class HangingProducer:
    """An old producer whose flush never ends (a partition that never acknowledges) until its
    buffered batches are failed."""

    def __init__(self) -> None:
        self.failed = asyncio.Event()
        self.stopped = False
        self._message_accumulator = self

    def fail_all(self, exception: BaseException) -> None:
        self.failed.set()

    async def stop(self) -> None:
        await self.failed.wait()
        self.stopped = True


class FreshProducer:
    async def start(self) -> None:
        pass


async def test_replacing_a_producer_does_not_wait_unbounded_for_the_old_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Finding F5 of issue 10 (review F11): the old producer's stop() flushes batches a
    partition may never acknowledge; replacement fails them past a bound, and the lock is not
    held meanwhile (another loop's send goes on with the fresh producer)."""
    monkeypatch.setattr(publisher_module, "STOP_FLUSH_SECONDS", 0.3)
    publisher = KafkaPublisher(Settings())
    old = HangingProducer()
    publisher._producer = old  # type: ignore[assignment]
    publisher._build = lambda context: FreshProducer()  # type: ignore[assignment,method-assign,return-value]
    publisher._broken = kafka_errors.OutOfOrderSequenceNumber()
    loop = asyncio.get_running_loop()
    started = loop.time()
    replacing = asyncio.ensure_future(publisher._replace_if_broken())
    await asyncio.sleep(0.1)
    assert isinstance(publisher._producer, FreshProducer)
    assert not publisher._replacing.locked(), "the old producer is closed outside the lock"
    async with asyncio.timeout(5):
        await replacing
    assert 0.3 <= loop.time() - started < 2
    assert old.failed.is_set() and old.stopped


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
    waves = _waves(hot, topics, limit, lambda topic: {0, 1, 2, 3})
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
    assert 10 in _waves(mixed, [*topics, "t"], limit, lambda topic: {0, 1, 2, 3})[0]


def test_keyless_rows_count_against_every_partition_of_their_topic() -> None:
    rows = [sized(0, "t", None, 3000), sized(1, "t", "k", 3000), sized(2, "u", "k2", 3000)]
    waves = _waves(rows, ["t", "t", "u"], 4096, lambda topic: {0, 1})
    assert waves == [[0, 2], [1]]


def test_a_record_larger_than_a_batch_is_alone_in_its_partition() -> None:
    rows = [sized(0, "t", "k", 10_000), sized(1, "t", "k", 10)]
    assert _waves(rows, ["t", "t"], 4096, lambda topic: {0}) == [[0], [1]]


async def test_early_settling_takes_only_keys_with_every_row_acknowledged() -> None:
    """Review F10: while a batch waits for a partition that does not acknowledge, the keys whose
    rows are all acknowledged are settled at once; a key with any row pending, failed or not yet
    sent (a later wave) waits for the batch."""
    loop = asyncio.get_running_loop()

    def acked() -> asyncio.Future[object]:
        future: asyncio.Future[object] = loop.create_future()
        future.set_result("metadata")
        return future

    failed: asyncio.Future[object] = loop.create_future()
    failed.set_exception(RuntimeError("refused"))
    records = [rec(0, "x", "a"), rec(1, "x", "b"), rec(2, "y", "a"), rec(3, "x", None)]
    records += [rec(4, "x", None), rec(5, "x", "c"), rec(6, "x", "d"), rec(7, "y", "e")]
    sent = Sent([acked(), acked(), loop.create_future(), acked(), failed, acked(), None, acked()])
    assert acknowledged_keys(records, sent, set()) == [1, 3, 5, 7]
    assert acknowledged_keys(records, sent, {1, 3}) == [5, 7]


class ClosedProducer:
    async def send(self, *args: object, **kwargs: object) -> None:
        raise errors.BrokerUnavailableError("the producer was replaced")


async def test_a_send_on_a_producer_being_retired_is_a_transient_failure_not_a_crash() -> None:
    """A claim loop whose send waited on a producer that another loop closed (failing its
    buffered batches) gets that failure as the record's outcome; the loop does not die."""
    publisher = KafkaPublisher(Settings())
    publisher._producer = ClosedProducer()  # type: ignore[assignment]
    outcome = await publisher._send_one(rec(0, "t", "k"), "t", Sent())
    assert isinstance(outcome, errors.BrokerUnavailableError)
