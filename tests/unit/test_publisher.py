from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka import errors as kafka_errors
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.structs import TopicPartition

from outbox_dispatcher import errors
from outbox_dispatcher import publisher as publisher_module
from outbox_dispatcher.dispatcher import acknowledged_keys
from outbox_dispatcher.kafka import producers as producers_module
from outbox_dispatcher.kafka.records import partition_of
from outbox_dispatcher.models import OutboxRecord
from outbox_dispatcher.publisher import KafkaPublisher, NotAttempted, Sent
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
    _txn_manager = None

    async def start(self) -> None:
        pass


class QueueingProducer:
    """The batch API over aiokafka's own accumulator (of a producer built, never started):
    submitted batches queue per partition as aiokafka queues them, and the test plays the
    sender: carry() drains a partition's first batch into a request, answer() acknowledges a
    carried batch, auto() does both for the partitions given, as soon as a batch is queued."""

    _txn_manager = None

    def __init__(self, partitions: int = 4) -> None:
        everything = set(range(partitions))
        self.client = SimpleNamespace(
            cluster=SimpleNamespace(
                partitions_for_topic=lambda topic: set(everything),
                available_partitions_for_topic=lambda topic: set(everything),
            )
        )
        self._real = AIOKafkaProducer(bootstrap_servers="127.0.0.1:1")
        self._message_accumulator = self._real._message_accumulator
        self.carried: dict[int, Any] = {}
        self.stopped = False

    def create_batch(self) -> FakeBatch:
        return FakeBatch(1000)

    async def send_batch(self, batch: FakeBatch, topic: str, *, partition: int) -> object:
        tp = TopicPartition(topic, partition)
        return await self._message_accumulator.add_batch(batch, tp, 30)

    def queued(self, partition: int) -> int:
        return sum(
            len(q)
            for tp, q in self._message_accumulator._batches.items()
            if tp.partition == partition
        )

    def carry(self, partition: int) -> None:
        tp = next(tp for tp in self._message_accumulator._batches if tp.partition == partition)
        self.carried[partition] = self._message_accumulator._pop_batch(tp)

    def answer(self, partition: int) -> None:
        self.carried.pop(partition).done(0)

    async def auto(self, *partitions: int) -> None:
        while True:
            for p in partitions:
                if self.queued(p) and p not in self.carried:
                    self.carry(p)
                    self.answer(p)
            await asyncio.sleep(0.005)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        await self._message_accumulator.close()  # aiokafka's flush: waits for every batch
        self.stopped = True


@pytest.fixture
async def queueing() -> AsyncIterator[QueueingProducer]:
    producer = QueueingProducer()
    try:
        yield producer
    finally:
        for batch in producer.carried.values():
            batch.done(0)
        await producer._real.stop()


def answers_at_each_early_settle(
    sent: Sent,
) -> tuple[list[list[int]], Callable[[], Awaitable[None]]]:
    """An `early` callback that notes which records had their answer at each call."""
    settled: list[list[int]] = []

    async def early() -> None:
        settled.append(
            [i for i, f in enumerate(sent.futures) if isinstance(f, asyncio.Future) and f.done()]
        )

    return settled, early


def reachable(publisher: KafkaPublisher) -> None:
    async def answers(seconds: float = 5.0) -> bool:
        return True

    publisher.topics.reachable = answers  # type: ignore[method-assign]


async def test_records_in_flight_past_publish_timeout_are_waited_for_not_given_back(
    queueing: QueueingProducer,
) -> None:
    """Issue 25: a request the broker appended and then refused (NotEnoughReplicas after the
    append) is committed once the ISR shrinks; a row given back at publish_timeout was sent
    again under a new producer id and appended twice (CI: 6 copies; the cluster test
    test_a_record_appended_before_not_enough_replicas_is_not_sent_twice: 30 of 30). Past
    publish_timeout the rows a request carried stay with their producer until it answers;
    the claim is parked, the keys answered meanwhile are settled early."""
    publisher = with_producer(queueing, publish_timeout_seconds=0.2)  # type: ignore[arg-type]
    reachable(publisher)
    keys = keys_for_partitions(4, per_partition=1)
    records = [rec(0, "t", keys[0][0]), rec(1, "t", keys[1][0])]
    sent = Sent()
    settled, early = answers_at_each_early_settle(sent)

    sender = asyncio.ensure_future(queueing.auto(1))
    publishing = asyncio.ensure_future(publisher.publish(records, sent, early=early))
    try:
        await wait_for(lambda: queueing.queued(0) == 1)
        queueing.carry(0)  # in flight, unanswered: the broker refuses it for now
        await asyncio.sleep(1.0)  # five publish_timeouts
        assert not publishing.done(), "nothing given back while a request is in flight"
        assert sent.parked
        assert settled and settled[0] == [1], "the answered key was settled early"
        queueing.answer(0)  # the ISR is back: the same producer's retry is acknowledged
        assert await asyncio.wait_for(publishing, 5) == [None, None]
        assert publisher.producers.current() is queueing, "no replacement"
    finally:
        sender.cancel()


async def test_a_batch_queued_behind_a_request_in_flight_is_given_back_at_publish_timeout(
    queueing: QueueingProducer,
) -> None:
    """A claim's batch that waits behind another claim's request in flight on the same
    partition has never been sent: at publish_timeout it is withdrawn and its rows given back
    (no copy can exist), the claim stops sending, and nothing another claim has in flight is
    touched."""
    publisher = with_producer(queueing, publish_timeout_seconds=0.2)  # type: ignore[arg-type]
    reachable(publisher)
    keys = keys_for_partitions(4, per_partition=2)
    earlier = queueing._message_accumulator._append_batch(FakeBatch(10), TopicPartition("t", 0))
    queueing.carry(0)  # another claim's request, in flight
    records = [rec(0, "t", keys[0][0]), rec(1, "t", keys[1][0])]
    sent = Sent()
    settled, early = answers_at_each_early_settle(sent)

    sender = asyncio.ensure_future(queueing.auto(1))
    try:
        outcomes = await asyncio.wait_for(publisher.publish(records, sent, early=early), 5)
    finally:
        sender.cancel()
    assert isinstance(outcomes[0], errors.BrokerUnavailableError) and outcomes[1] is None
    assert sent.final and not sent.parked
    assert settled[-1] == [0, 1], "given up: the given-back key is settled at once"
    assert queueing.queued(0) == 0, "withdrawn from the producer"
    assert not earlier.future.done(), "the other claim's request is left to the producer"


async def test_replacing_a_producer_fails_nothing_it_has_in_flight(
    queueing: QueueingProducer,
) -> None:
    """Issue 25 (review N10): the replaced producer's requests in flight, other claims'
    included, may be in the broker's log: they stay with it, and it is closed once they are
    answered. Replacement neither waits for it (review F11) nor fails them; its batches no
    request carried are failed (given back), and a submission still waiting to reach it is
    ended (review N11)."""
    publisher = with_producer(queueing)  # type: ignore[arg-type]
    publisher.producers.factory = lambda context: FreshProducer()  # type: ignore[assignment,method-assign,return-value]
    accumulator = queueing._message_accumulator
    flying = accumulator._append_batch(FakeBatch(10), TopicPartition("t", 0))
    queueing.carry(0)
    queued = accumulator._append_batch(FakeBatch(10), TopicPartition("t", 1))
    waiting = publisher.producers.submit(queueing, FakeBatch(10), "t", 1)  # type: ignore[arg-type]
    await asyncio.sleep(0.01)  # waits behind `queued`
    publisher.producers.condemn(kafka_errors.OutOfOrderSequenceNumber())
    async with asyncio.timeout(1):
        await publisher.producers.replace_if_broken()
    assert isinstance(publisher.producers.current(), FreshProducer)
    await asyncio.sleep(0.05)
    assert isinstance(queued.future.exception(), errors.BrokerUnavailableError)
    assert waiting.cancelled(), "never appended to the retired producer"
    assert not flying.future.done() and not queueing.stopped
    assert accumulator._exception is None, "nothing failed wholesale"
    queueing.answer(0)
    await wait_for(lambda: queueing.stopped)
    assert not publisher.producers.retiring


async def wait_for(condition: Any, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():  # noqa: ASYNC110 (a fake's state; nothing to wait on)
            await asyncio.sleep(0.005)


async def test_stopping_closes_a_retired_producer_within_the_bound(
    monkeypatch: pytest.MonkeyPatch, queueing: QueueingProducer
) -> None:
    """A retired producer waits for its requests in flight as long as the process runs; the
    process's stop bounds it (STOP_FLUSH_SECONDS), failing what is left."""
    monkeypatch.setattr(producers_module, "STOP_FLUSH_SECONDS", 0.2)
    publisher = with_producer(queueing)  # type: ignore[arg-type]
    publisher.producers.factory = lambda context: FreshProducer()  # type: ignore[assignment,method-assign,return-value]
    flying = queueing._message_accumulator._append_batch(FakeBatch(10), TopicPartition("t", 0))
    queueing.carry(0)
    publisher.producers.condemn(kafka_errors.OutOfOrderSequenceNumber())
    await publisher.producers.replace_if_broken()
    publisher.producers.use(None)  # the fresh one is not ours to close here
    async with asyncio.timeout(3):
        await publisher.stop()
    assert isinstance(flying.future.exception(), errors.BrokerUnavailableError)
    queueing.carried.clear()


class SenderEndsInKeyError(HangingProducer):
    """aiokafka 0.14: a request still in flight when its batch was failed re-enqueues it on its
    way out, and the sender (so stop()) ends in KeyError."""

    async def stop(self) -> None:
        await super().stop()
        raise KeyError("MessageBatch")


async def test_closing_a_producer_whose_sender_ends_in_key_error_is_quiet(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """make chaos (NotEnoughReplicas for 120 s): every close past the flush bound left an
    unretrieved KeyError in the log; the producer is discarded either way."""
    monkeypatch.setattr(producers_module, "STOP_FLUSH_SECONDS", 0.05)
    old = SenderEndsInKeyError()
    async with asyncio.timeout(5):
        await producers_module.close_bounded(old, "test")  # type: ignore[arg-type]
    assert old.failed.is_set() and old.stopped


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
    # Given up (issue 25): nothing more is sent; every key whose rows all have their answer,
    # failures and rows not attempted included, is settled; a row in flight still holds its key.
    sent.futures[6] = NotAttempted()
    sent.final = True
    assert acknowledged_keys(records, sent, {1, 3, 5, 7}) == [4, 6]


class FakeBatch:
    """A producer batch that holds up to `room` records (aiokafka's BatchBuilder holds bytes)."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.records: list[tuple[bytes | None, bytes | None]] = []
        self.closed = False

    def append(
        self,
        *,
        timestamp: int | None,
        key: bytes | None,
        value: bytes | None,
        headers: list[tuple[str, bytes]],
    ) -> object | None:
        if self.closed or len(self.records) >= self.room:
            return None
        self.records.append((key, value))
        return object()

    def close(self) -> None:
        self.closed = True


@dataclass
class Submitted:
    topic: str
    partition: int
    batch: FakeBatch
    future: asyncio.Future[object]
    # Whether every batch submitted before it was answered when it was submitted.
    after_acks: bool


class FakeProducer:
    """The batch API of a producer whose broker answers each batch on the next loop turn,
    refusing a batch that holds a value in `refuse`."""

    _txn_manager = None  # not idempotent: no producer id to log
    _message_accumulator = SimpleNamespace(_batches={})  # nothing queued to withdraw

    def __init__(
        self,
        partitions: int = 6,
        available: set[int] | None = None,
        room: int = 1000,
        refuse: frozenset[bytes] = frozenset(),
        log: list[Submitted] | None = None,
    ) -> None:
        everything = set(range(partitions))
        self.client = SimpleNamespace(
            cluster=SimpleNamespace(
                partitions_for_topic=lambda topic: set(everything),
                available_partitions_for_topic=lambda topic: set(
                    everything if available is None else available
                ),
            )
        )
        self.room = room
        self.refuse = refuse
        self.submitted: list[Submitted] = [] if log is None else log

    def create_batch(self) -> FakeBatch:
        return FakeBatch(self.room)

    async def send_batch(self, batch: FakeBatch, topic: str, *, partition: int) -> object:
        future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        answered = all(s.future.done() for s in self.submitted)
        self.submitted.append(Submitted(topic, partition, batch, future, answered))
        if any(value in self.refuse for _, value in batch.records):
            error = kafka_errors.CorruptRecordException("refused")
            asyncio.get_running_loop().call_soon(future.set_exception, error)
        else:
            asyncio.get_running_loop().call_soon(future.set_result, "metadata")
        return future

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


def with_producer(producer: FakeProducer, **settings: Any) -> KafkaPublisher:
    publisher = KafkaPublisher(Settings(**settings))
    publisher.producers.use(producer)  # type: ignore[arg-type]
    return publisher


async def test_a_wave_goes_out_as_one_closed_batch_per_partition() -> None:
    """The batch API: the dispatcher builds one batch per (topic, partition) and wave; keyed
    records land where the default partitioner puts them, a wave's keyless records of a topic
    share one partition that has a leader."""
    producer = FakeProducer(partitions=6, available={1, 4})
    publisher = with_producer(producer)
    records = [rec(i, "t", f"key-{i % 20}") for i in range(60)]
    records += [rec(60 + i, "t", None) for i in range(5)] + [rec(65, "u", "key-1")]
    outcomes = await publisher.publish(records, Sent())
    assert outcomes == [None] * len(records)
    targets = [(s.topic, s.partition) for s in producer.submitted]
    assert len(targets) == len(set(targets)), "one batch per partition and wave"
    # Left open: the producer lingers OUTBOX_KAFKA_LINGER_MS before sending it, as before.
    assert not any(s.batch.closed for s in producer.submitted)
    partitioner = DefaultPartitioner()
    where = {(key, s.topic): s.partition for s in producer.submitted for key, _ in s.batch.records}
    for r in records:
        if r.ordering_key is not None:
            key = r.ordering_key.encode()
            expected = partitioner(key, list(range(6)), list(range(6)))
            assert where[(key, r.topic or "")] == expected
    keyless = [s for s in producer.submitted if any(k is None for k, _ in s.batch.records)]
    assert len(keyless) == 1 and keyless[0].partition in {1, 4}
    # key-1's row for topic u waits for its rows in t (a wave each).
    assert producer.submitted[-1].topic == "u" and producer.submitted[-1].after_acks


async def test_a_full_batch_sends_the_rest_of_its_keys_rows_in_the_next_wave() -> None:
    """When a partition's batch has no room left (the size estimate fell short), the key's
    remaining rows wait for the acks of the batch before them: never two batches of one
    partition in flight at once (review F3), and the key's order is kept."""
    producer = FakeProducer(partitions=1, room=2)
    publisher = with_producer(producer)
    records = [rec(i, "t", "k") for i in range(5)]
    assert await publisher.publish(records, Sent()) == [None] * 5
    assert [[k for k, _ in s.batch.records] for s in producer.submitted] == [
        [b"k", b"k"],
        [b"k", b"k"],
        [b"k"],
    ]
    assert all(s.after_acks for s in producer.submitted)


async def test_a_refused_batch_is_sent_again_one_record_at_a_time() -> None:
    """The broker refuses a whole batch for one record and every record of it shares the
    batch's future: each is sent again alone, and only the refused one fails. A record alone
    in its batch was refused for itself: it is not sent again."""
    log: list[Submitted] = []
    producer = FakeProducer(partitions=1, refuse=frozenset({b"bad"}), log=log)
    publisher = with_producer(producer)
    publisher.producers.factory = lambda context: FakeProducer(  # type: ignore[assignment,method-assign,return-value]
        partitions=1, refuse=frozenset({b"bad"}), log=log
    )
    records = [rec(i, "t", f"k{i}") for i in range(4)]
    records.insert(
        2, OutboxRecord(9, "t", "k9", b"bad", {}, uuid.uuid4(), datetime.now(UTC), 0, False)
    )
    records.append(
        OutboxRecord(10, "u", "k10", b"bad", {}, uuid.uuid4(), datetime.now(UTC), 0, False)
    )
    outcomes = await publisher.publish(records, Sent())
    assert [type(o).__name__ for o in outcomes] == [
        "NoneType",
        "NoneType",
        "CorruptRecordException",
        "NoneType",
        "NoneType",
        "CorruptRecordException",
    ]
    sizes = [(s.topic, len(s.batch.records)) for s in log]
    assert sizes == [("t", 5), ("u", 1)] + [("t", 1)] * 5


class ClosedProducer(FakeProducer):
    async def send_batch(self, batch: FakeBatch, topic: str, *, partition: int) -> object:
        raise errors.BrokerUnavailableError("the producer was replaced")


async def test_a_send_on_a_producer_being_retired_is_a_transient_failure_not_a_crash() -> None:
    """A claim loop whose send waited on a producer that another loop closed (failing its
    buffered batches) gets that failure as the record's outcome; the loop does not die. The
    key's later row in the same batch is not attempted (it did nothing wrong)."""
    publisher = with_producer(ClosedProducer())
    records = [rec(0, "t", "k"), rec(1, "t", "k")]
    outcomes = await publisher.publish(records, Sent())
    assert isinstance(outcomes[0], errors.BrokerUnavailableError)
    assert isinstance(outcomes[1], NotAttempted)


async def test_the_answered_keys_are_settled_soon_after_the_first_ack_not_at_the_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review F10, one partition silent: once another partition of the wave has answered, the
    answered keys are settled after EARLY_SETTLE_FACTOR times that answer's wait (at least
    EARLY_SETTLE_MIN_SECONDS), not after the EARLY_SETTLE_SECONDS cap (here an hour: a publisher
    that waited for the cap would never call `early` within the test)."""
    monkeypatch.setattr(publisher_module, "EARLY_SETTLE_SECONDS", 3600.0)
    monkeypatch.setattr(publisher_module, "EARLY_SETTLE_MIN_SECONDS", 0.01)
    loop = asyncio.get_running_loop()
    answered: asyncio.Future[object] = loop.create_future()
    silent: asyncio.Future[object] = loop.create_future()
    loop.call_soon(answered.set_result, "metadata")
    early_called = asyncio.Event()

    async def early() -> None:
        assert answered.done()
        assert not silent.done()
        early_called.set()
        silent.set_result("metadata")  # then the wave completes

    publisher = KafkaPublisher(Settings(publish_timeout_seconds=7200))
    sent = Sent([answered, silent])
    waiting = asyncio.ensure_future(publisher._await_acks(sent, [0, 1], lambda: None, early))
    await asyncio.wait_for(early_called.wait(), timeout=30)
    assert await waiting is False


async def test_partitions_answering_after_the_early_settle_are_settled_before_publish_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review F10, one partition silent and three slower than the first: the slower
    partitions' keys are settled soon after they answer (in one settle: answers are coalesced
    over EARLY_SETTLE_SECONDS), not after the silent one's publish_timeout and the close of its
    producer (make chaos, NotEnoughReplicas on one topic for 120 s: the other topic's partitions
    on the same broker answered after the retrying one's 100 ms backoff, just past the early
    settle; their keys waited 9 s and the other topic's p99 was 7.8 s)."""
    monkeypatch.setattr(publisher_module, "EARLY_SETTLE_MIN_SECONDS", 0.01)
    monkeypatch.setattr(publisher_module, "EARLY_SETTLE_SECONDS", 0.3)
    loop = asyncio.get_running_loop()
    first: asyncio.Future[object] = loop.create_future()
    slower = [loop.create_future() for _ in range(3)]
    silent: asyncio.Future[object] = loop.create_future()
    loop.call_soon(first.set_result, "metadata")
    calls: list[tuple[bool, list[bool], bool]] = []
    second_call = asyncio.Event()

    async def early() -> None:
        calls.append((first.done(), [f.done() for f in slower], silent.done()))
        if len(calls) == 1:
            for n, future in enumerate(slower):
                loop.call_later(0.02 * (n + 1), future.set_result, "metadata")
        else:
            second_call.set()

    publisher = KafkaPublisher(Settings(publish_timeout_seconds=7200))
    sent = Sent([first, *slower, silent])
    waiting = asyncio.ensure_future(
        publisher._await_acks(sent, [0, 1, 2, 3, 4], lambda: None, early)
    )
    try:
        await asyncio.wait_for(second_call.wait(), timeout=30)
    finally:
        silent.set_result("metadata")
    assert await waiting is False
    assert calls == [
        (True, [False, False, False], False),
        (True, [True, True, True], False),  # one settle for the three later answers
    ]


class OnePartitionStuck(FakeProducer):
    """A producer whose partition 0 still holds an earlier batch that its broker does not
    answer: aiokafka's send_batch for partition 0 waits until that batch has left."""

    def __init__(self) -> None:
        super().__init__(partitions=4)
        self.gone = asyncio.Event()

    async def send_batch(self, batch: FakeBatch, topic: str, *, partition: int) -> object:
        if partition == 0:
            await self.gone.wait()
        return await super().send_batch(batch, topic, partition=partition)


async def test_a_partition_whose_submission_waits_does_not_hold_back_the_others() -> None:
    """Review F10 with the batch API: send_batch waits for the partition's previous batch to
    leave, and a wave submitted one partition after the other left every later partition's
    batch (and the early settle of its keys) waiting behind a silent one, publish_timeout long
    (CI's blackholed-partition test: the healthy keys' p99 was 4.0 s)."""
    producer = OnePartitionStuck()
    publisher = with_producer(producer)
    keys = keys_for_partitions(4, per_partition=2)
    records = [rec(i, "t", key) for i, key in enumerate(k for p in range(4) for k in keys[p])]
    settled_early: list[list[int]] = []
    sent = Sent()

    async def early() -> None:
        settled_early.append(
            [i for i, f in enumerate(sent.futures) if isinstance(f, asyncio.Future) and f.done()]
        )
        producer.gone.set()  # the silent partition's earlier batch leaves; its rows go too

    outcomes = await asyncio.wait_for(publisher.publish(records, sent, early=early), timeout=30)
    assert outcomes == [None] * len(records)
    stuck = {i for i, r in enumerate(records) if r.ordering_key in keys[0]}
    assert settled_early and set(settled_early[0]) == set(range(len(records))) - stuck


def keys_for_partitions(partitions: int, per_partition: int) -> dict[int, list[str]]:
    """`per_partition` keys for each partition under the default partitioner."""
    found: dict[int, list[str]] = {p: [] for p in range(partitions)}
    n = 0
    while any(len(keys) < per_partition for keys in found.values()):
        key = f"k{n}"
        keys = found[partition_of(key, set(range(partitions)))]
        if len(keys) < per_partition:
            keys.append(key)
        n += 1
    return found
