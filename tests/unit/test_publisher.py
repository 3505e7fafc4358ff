"""A claim's delivery through the publisher (outbox_dispatcher/kafka/): its parts, its waves and
batches, the producer's replacement and retirement, over in-memory producers (tests/fakes.py);
no broker needed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka import errors as kafka_errors
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.structs import TopicPartition

from outbox_dispatcher import errors
from outbox_dispatcher.errors import NotAttempted
from outbox_dispatcher.kafka import producers as producers_module
from outbox_dispatcher.kafka.delivery import Delivery, acknowledged, outcomes_of
from outbox_dispatcher.kafka.publisher import KafkaPublisher, all_outcomes
from tests.fakes import (
    FakeBatch,
    FakeProducer,
    QueueingProducer,
    Submitted,
    keys_for_partitions,
    publisher_with,
    rec,
)


async def test_outcomes_split_acknowledged_failed_pending_and_unsent() -> None:
    loop = asyncio.get_running_loop()
    acked: asyncio.Future[object] = loop.create_future()
    acked.set_result("metadata")
    failed: asyncio.Future[object] = loop.create_future()
    boom = RuntimeError("boom")
    failed.set_exception(boom)
    pending: asyncio.Future[object] = loop.create_future()
    refused = ValueError("refused")
    marker = NotAttempted("shut down")
    answers = [acked, failed, pending, refused, None]  # None: never handed to the producer
    assert outcomes_of(answers, marker) == [None, boom, marker, refused, marker]
    pending.cancel()


class HangingProducer:
    """An old producer whose flush never ends (a partition that never acknowledges) until its
    buffered batches are failed."""

    def __init__(self) -> None:
        self.failed = asyncio.Event()
        self.stopped = False
        self._message_accumulator = self
        self._batches: dict[object, list[object]] = {}  # what internals.fail_buffered reads
        self._pending_batches: set[object] = set()

    def fail_all(self, exception: BaseException) -> None:
        self.failed.set()

    async def stop(self) -> None:
        await self.failed.wait()
        self.stopped = True


class FreshProducer:
    _txn_manager = None
    _sender = SimpleNamespace(sender_task=None)  # its sender never died (internals.sender_failure)

    async def start(self) -> None:
        pass


@pytest.fixture
async def queueing() -> AsyncIterator[QueueingProducer]:
    producer = QueueingProducer()
    try:
        yield producer
    finally:
        await producer.close()


async def answers_at_each_part(delivery: Delivery) -> tuple[list[list[int]], list[Any]]:
    """Iterate the delivery; at each part before the final one, note which records had their
    answer; returns those notes and every record's outcome."""
    settled: list[list[int]] = []
    outcomes: list[Any] = [None] * len(delivery.records)
    async for part in delivery:
        if not part.final:
            answers = enumerate(delivery.answers)
            settled.append([i for i, f in answers if isinstance(f, asyncio.Future) and f.done()])
        for i, outcome in zip(part.indices, part.outcomes, strict=True):
            outcomes[i] = outcome
    return settled, outcomes


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
    publisher = publisher_with(queueing, publish_timeout_seconds=0.2)  # type: ignore[arg-type]
    reachable(publisher)
    keys = keys_for_partitions(4, per_partition=1)
    records = [rec(0, "t", keys[0][0]), rec(1, "t", keys[1][0])]
    delivery = publisher.publish(records)
    settled: list[list[int]] = []

    async def run() -> list[Any]:
        noted, outcomes = await answers_at_each_part(delivery)
        settled.extend(noted)
        return outcomes

    sender = asyncio.ensure_future(queueing.auto(1))
    publishing = asyncio.ensure_future(run())
    try:
        await wait_for(lambda: queueing.queued(0) == 1)
        queueing.carry(0)  # in flight, unanswered: the broker refuses it for now
        await asyncio.sleep(1.0)  # five publish_timeouts
        assert not publishing.done(), "nothing given back while a request is in flight"
        assert delivery.parked
        assert delivery.settled == {1}, "the answered key was settled early"
        queueing.answer(0)  # the ISR is back: the same producer's retry is acknowledged
        assert await asyncio.wait_for(publishing, 5) == [None, None]
        assert settled and settled[0] == [1], "the answered key was settled early"
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
    publisher = publisher_with(queueing, publish_timeout_seconds=0.2)  # type: ignore[arg-type]
    reachable(publisher)
    keys = keys_for_partitions(4, per_partition=2)
    earlier = queueing._message_accumulator._append_batch(FakeBatch(10), TopicPartition("t", 0))
    queueing.carry(0)  # another claim's request, in flight
    records = [rec(0, "t", keys[0][0]), rec(1, "t", keys[1][0])]
    delivery = publisher.publish(records)

    sender = asyncio.ensure_future(queueing.auto(1))
    try:
        settled, outcomes = await asyncio.wait_for(answers_at_each_part(delivery), 5)
    finally:
        sender.cancel()
    assert isinstance(outcomes[0], errors.BrokerUnavailableError) and outcomes[1] is None
    assert delivery.final and not delivery.parked
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
    publisher = publisher_with(queueing)  # type: ignore[arg-type]
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


async def test_a_producer_whose_sender_died_is_replaced_though_no_answer_said_so(
    queueing: QueueingProducer,
) -> None:
    """aiokafka's sender died on an error it did not expect (CI, a broker restart): the
    producer never sends again, whether or not a failed answer reached us. The next
    replace_if_broken replaces it; the drain waiters its death failed are read (else asyncio
    logs each as never retrieved)."""
    publisher = publisher_with(queueing)  # type: ignore[arg-type]
    publisher.producers.factory = lambda context: FreshProducer()  # type: ignore[assignment,method-assign,return-value]
    held = queueing._message_accumulator._append_batch(FakeBatch(10), TopicPartition("t", 0))
    death = kafka_errors.KafkaError("Unexpected error during batch delivery")
    died: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    died.set_exception(death)
    queueing._sender = SimpleNamespace(sender_task=died)  # type: ignore[misc]
    held.failure(death)  # what aiokafka's _fail_all does as its sender dies
    async with asyncio.timeout(1):
        await publisher.producers.replace_if_broken()
    assert isinstance(publisher.producers.current(), FreshProducer)
    assert held.future.exception() is death


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
    publisher = publisher_with(queueing)  # type: ignore[arg-type]
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
    answers: list[Any] = [acked(), acked(), loop.create_future(), acked(), failed, acked()]
    answers += [None, acked()]
    assert acknowledged(records, answers, final=False, already=set()) == [1, 3, 5, 7]
    assert acknowledged(records, answers, final=False, already={1, 3}) == [5, 7]
    # Given up (issue 25): nothing more is sent; every key whose rows all have their answer,
    # failures and rows not attempted included, is settled; a row in flight still holds its key.
    answers[6] = NotAttempted()
    assert acknowledged(records, answers, final=True, already={1, 3, 5, 7}) == [4, 6]


async def test_a_wave_goes_out_as_one_closed_batch_per_partition() -> None:
    """The batch API: the dispatcher builds one batch per (topic, partition) and wave; keyed
    records land where the default partitioner puts them, a wave's keyless records of a topic
    share one partition that has a leader."""
    producer = FakeProducer(partitions=6, available={1, 4})
    publisher = publisher_with(producer)
    records = [rec(i, "t", f"key-{i % 20}") for i in range(60)]
    records += [rec(60 + i, "t", None) for i in range(5)] + [rec(65, "u", "key-1")]
    outcomes = await all_outcomes(publisher.publish(records))
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
    publisher = publisher_with(producer)
    records = [rec(i, "t", "k") for i in range(5)]
    assert await all_outcomes(publisher.publish(records)) == [None] * 5
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
    publisher = publisher_with(producer)
    publisher.producers.factory = lambda context: FakeProducer(  # type: ignore[assignment,method-assign,return-value]
        partitions=1, refuse=frozenset({b"bad"}), log=log
    )
    records = [rec(i, "t", f"k{i}") for i in range(4)]
    records.insert(2, rec(9, "t", "k9", b"bad"))
    records.append(rec(10, "u", "k10", b"bad"))
    outcomes = await all_outcomes(publisher.publish(records))
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
    publisher = publisher_with(ClosedProducer())
    records = [rec(0, "t", "k"), rec(1, "t", "k")]
    outcomes = await all_outcomes(publisher.publish(records))
    assert isinstance(outcomes[0], errors.BrokerUnavailableError)
    assert isinstance(outcomes[1], NotAttempted)


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
    publisher = publisher_with(producer)
    keys = keys_for_partitions(4, per_partition=2)
    records = [rec(i, "t", key) for i, key in enumerate(k for p in range(4) for k in keys[p])]
    settled_early: list[list[int]] = []
    outcomes: list[Any] = [None] * len(records)
    delivery = publisher.publish(records)

    async def run() -> None:
        async for part in delivery:
            if not part.final:
                answers = enumerate(delivery.answers)
                done = [i for i, f in answers if isinstance(f, asyncio.Future) and f.done()]
                settled_early.append(done)
                producer.gone.set()  # the silent partition's earlier batch leaves; its rows go too
            for i, outcome in zip(part.indices, part.outcomes, strict=True):
                outcomes[i] = outcome

    await asyncio.wait_for(run(), timeout=30)
    assert outcomes == [None] * len(records)
    stuck = {i for i, r in enumerate(records) if r.ordering_key in keys[0]}
    assert settled_early and set(settled_early[0]) == set(range(len(records))) - stuck


async def test_a_delivery_sends_its_claim_once() -> None:
    publisher = publisher_with(FakeProducer())
    delivery = publisher.publish([rec(0, "t", "k")])
    assert await all_outcomes(delivery) == [None]
    with pytest.raises(errors.OutboxDispatcherError, match="iterated once"):
        await all_outcomes(delivery)
