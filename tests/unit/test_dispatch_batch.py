"""One batch's run (outbox_dispatcher/dispatch/batch.py): a real publisher over an in-memory
producer (tests/fakes.py) and a settler in memory. What is settled, when, and how often; what the
claim loop is told (stalled, parked, the outage pause); what a shutdown cancel settles."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence

import pytest
from aiokafka import errors as kafka_errors

from outbox_dispatcher import errors
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.batch import BatchRun, Settling
from outbox_dispatcher.dispatch.leases import InFlight
from outbox_dispatcher.kafka import acks as acks_module
from outbox_dispatcher.kafka import producers as producers_module
from outbox_dispatcher.kafka.publisher import KafkaPublisher
from outbox_dispatcher.metrics import Metrics
from outbox_dispatcher.models import Batch, Failure, Outcome, Result
from outbox_dispatcher.retries import RetryPolicy
from tests.fakes import (
    FakeBatch,
    FakeProducer,
    QueueingProducer,
    RecordingSettler,
    keys_for_partitions,
    publisher_with,
    rec,
)

KEYS = keys_for_partitions(6, per_partition=2)  # FakeProducer's six partitions


class SilentPartition(FakeProducer):
    """Partition `silent` takes batches and never answers them (until `answer()`), the others
    answer on the next loop turn. stop() ends what is unanswered, as a bounded close fails what
    the producer still holds."""

    def __init__(self, silent: int = 0) -> None:
        super().__init__(partitions=6)
        self.silent = silent
        self.unanswered: list[asyncio.Future[object]] = []
        self.stopped = False

    async def send_batch(self, batch: FakeBatch, topic: str, *, partition: int) -> object:
        if partition != self.silent:
            return await super().send_batch(batch, topic, partition=partition)
        future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self.unanswered.append(future)
        return future

    def answer(self) -> None:
        for future in self.unanswered:
            future.set_result("metadata")

    async def stop(self) -> None:
        self.stopped = True
        for future in self.unanswered:
            if not future.done():
                future.set_exception(errors.BrokerUnavailableError("closed"))


class SlowSettler(RecordingSettler):
    """The first settle takes a while (a cancel lands during it); shielded, it finishes."""

    def __init__(self) -> None:
        super().__init__()
        self.first_started = asyncio.Event()

    async def settle_shielded(self, batch: Batch, results: Sequence[Result]) -> int:
        changed = await super().settle_shielded(batch, results)
        if len(self.settled) == 1:
            self.first_started.set()
            await asyncio.shield(asyncio.sleep(0.2))
        return changed


def run_of(
    batch: Batch,
    publisher: KafkaPublisher,
    settler: RecordingSettler,
    stalled: asyncio.Event | None = None,
    in_flight: InFlight | None = None,
) -> BatchRun:
    settings = Settings()
    settling = Settling(settler, RetryPolicy(settings), Metrics())
    leases = InFlight() if in_flight is None else in_flight
    return BatchRun(batch, publisher, settling, leases, stalled=stalled)


@pytest.fixture(autouse=True)
def quick_close(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(producers_module, "STOP_FLUSH_SECONDS", 0.1)
    monkeypatch.setattr(acks_module, "EARLY_SETTLE_MIN_SECONDS", 0.01)


def silent_and_answered() -> tuple[Batch, SilentPartition]:
    """Rows 1-2 of a key on the silent partition 0, rows 3-4 of keys on answering ones."""
    producer = SilentPartition(silent=0)
    records = [rec(1, "t", KEYS[0][0]), rec(2, "t", KEYS[0][0])]
    records += [rec(3, "t", KEYS[1][0]), rec(4, "t", KEYS[2][0])]
    return Batch(uuid.uuid4(), records), producer


async def test_a_batch_that_is_acknowledged_whole_is_settled_once() -> None:
    records = [rec(i, "t", f"key-{i % 4}") for i in range(12)] + [rec(12, "t", None)]
    batch = Batch(uuid.uuid4(), records)
    settler, in_flight = RecordingSettler(), InFlight()
    run = run_of(batch, publisher_with(FakeProducer()), settler, in_flight=in_flight)
    task = asyncio.ensure_future(run.run())
    await asyncio.sleep(0)
    assert len(in_flight) == 13, "the lease keeper keeps the rows while they are published"
    assert await task == 0.0, "no outage: no pause"
    assert settler.settled == [list(range(13))]
    assert all(result.outcome is Outcome.PUBLISHED for result in settler.results[0])
    assert run._settling.published == 13
    assert len(in_flight) == 0, "the lease keeper lets the rows go"


async def test_the_answered_keys_are_settled_while_a_silent_partition_holds_its_own() -> None:
    """Review F10 through the parts: the keys of answering partitions are settled early, the
    claim loop is told it may go on (stalled), the lease keeper keeps only the waiting rows; the
    rest is settled once its partition answers."""
    batch, producer = silent_and_answered()
    settler, stalled, in_flight = RecordingSettler(), asyncio.Event(), InFlight()
    run = run_of(batch, publisher_with(producer), settler, stalled, in_flight)
    task = asyncio.ensure_future(run.run())
    await asyncio.wait_for(stalled.wait(), 5)
    assert settler.settled == [[3, 4]]
    assert sorted(in_flight.pairs()[0]) == [1, 2], "only the silent key's rows stay leased"
    assert not task.done() and not run.parked
    producer.answer()
    assert await asyncio.wait_for(task, 5) == 0.0
    assert settler.settled == [[3, 4], [1, 2]]
    assert all(r.outcome is Outcome.PUBLISHED for rs in settler.results for r in rs)


async def test_a_cancel_during_an_early_settle_settles_no_row_twice() -> None:
    """Review N12: a shutdown cancel that landed while an early settle ran let the shielded
    settle finish but skipped noting its rows, so the cancel path settled them a second time
    (0 rows changed: a false `lease_lost` for rows that were published)."""
    batch, producer = silent_and_answered()
    settler = SlowSettler()
    run = run_of(batch, publisher_with(producer), settler)
    task = asyncio.ensure_future(run.run())
    await asyncio.wait_for(settler.first_started.wait(), 5)
    task.cancel()
    await asyncio.wait({task}, timeout=5)
    assert task.cancelled()
    assert producer.stopped, "the producer was closed (bounded) before rows were given back"
    assert settler.settled == [[3, 4], [1, 2]], "3-4 early, 1-2 by the cancel path, once each"
    given_back = settler.results[1]
    assert [r.outcome for r in given_back] == [Outcome.RETRY, Outcome.RETRY]
    assert not any(r.counted for r in given_back), "not attempted: nothing counted"


async def test_a_cancel_marks_what_was_acknowledged_and_gives_back_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cancel before any part was settled: one settle, the acknowledged rows marked, the
    unanswered given back uncounted (their failure was the stop, not theirs)."""
    monkeypatch.setattr(acks_module, "EARLY_SETTLE_MIN_SECONDS", 3600.0)  # no early part
    batch, producer = silent_and_answered()
    settler = RecordingSettler()
    run = run_of(batch, publisher_with(producer), settler)
    task = asyncio.ensure_future(run.run())
    answered = producer.submitted
    while not (answered and all(s.future.done() for s in answered)):  # noqa: ASYNC110
        await asyncio.sleep(0.001)
    task.cancel()
    await asyncio.wait({task}, timeout=5)
    assert task.cancelled()
    assert settler.settled == [[1, 2, 3, 4]]
    outcomes = [r.outcome for r in settler.results[0]]
    assert outcomes == [Outcome.RETRY, Outcome.RETRY, Outcome.PUBLISHED, Outcome.PUBLISHED]
    assert not any(r.counted for r in settler.results[0])


async def test_an_outage_asks_the_claim_loop_to_pause() -> None:
    """A fresh producer that cannot start (the broker is away): every row goes back uncounted
    and the claim loop pauses before its next claim."""

    class Unreachable(FakeProducer):
        async def start(self) -> None:
            raise kafka_errors.KafkaConnectionError("away")

    publisher = publisher_with(FakeProducer())
    publisher.producers.factory = lambda context: Unreachable()  # type: ignore[assignment,return-value]
    publisher.producers.condemn(RuntimeError("its sequence state is lost"))
    batch = Batch(uuid.uuid4(), [rec(1, "t", "a"), rec(2, "t", "b")])
    settler = RecordingSettler()
    assert await run_of(batch, publisher, settler).run() > 0.0
    assert [r.failure for r in settler.results[0]] == [Failure.TRANSIENT] * 2
    assert not any(r.counted for r in settler.results[0])


async def test_a_batch_waiting_only_for_requests_in_flight_is_parked() -> None:
    """Issue 25 through the run: past publish_timeout, a batch whose request the broker keeps
    refusing stays with its producer and is parked (the claim loop does not count it against
    MAX_STALLED_BATCHES); its row is settled once the broker answers."""
    queueing = QueueingProducer()
    try:
        publisher = publisher_with(queueing, publish_timeout_seconds=0.2)

        async def reachable(seconds: float = 5.0) -> bool:
            return True

        publisher.topics.reachable = reachable  # type: ignore[method-assign]
        batch = Batch(uuid.uuid4(), [rec(1, "t", KEYS[0][0])])
        settler = RecordingSettler()
        run = run_of(batch, publisher, settler)
        task = asyncio.ensure_future(run.run())
        while not queueing.queued(0):  # noqa: ASYNC110 (a fake's state)
            await asyncio.sleep(0.005)
        queueing.carry(0)  # in flight; the broker does not answer it yet
        while not run.parked:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        assert not task.done() and settler.settled == []
        queueing.answer(0)
        assert await asyncio.wait_for(task, 5) == 0.0
        assert settler.settled == [[1]]
        assert settler.results[0][0].outcome is Outcome.PUBLISHED
    finally:
        await queueing.close()
