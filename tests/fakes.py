"""In-memory fakes of our seams for unit tests: a producer's batch API (FakeProducer, FakeBatch),
one over aiokafka's own accumulator (QueueingProducer), and a settler that records its settles.

They live with the tests, not in the package: the producers mimic attributes below aiokafka's
public API (`_message_accumulator`, `_txn_manager`) that kafka/internals.py reaches, and only that
module may name them in the package (tests/unit/test_broker.py); nor does a sidecar need test
doubles installed.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka import errors as kafka_errors
from aiokafka.structs import TopicPartition

from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.supervisor import configs_of
from outbox_dispatcher.kafka.publisher import KafkaPublisher
from outbox_dispatcher.kafka.records import partition_of
from outbox_dispatcher.models import Batch, OutboxRecord, Result


def rec(i: int, topic: str | None, key: str | None, payload: bytes = b"x") -> OutboxRecord:
    return OutboxRecord(i, topic, key, payload, {}, uuid.uuid4(), datetime.now(UTC), 0, False)


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
    _sender = SimpleNamespace(sender_task=None)  # its sender never died (internals.sender_failure)
    _message_accumulator = SimpleNamespace(_batches={}, _pending_batches=set())  # nothing queued

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
            _topics=set(),  # what aiokafka's metadata refresh names (internals.track_topics)
            cluster=SimpleNamespace(
                partitions_for_topic=lambda topic: set(everything),
                available_partitions_for_topic=lambda topic: set(
                    everything if available is None else available
                ),
            ),
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


class QueueingProducer:
    """The batch API over aiokafka's own accumulator (of a producer built, never started):
    submitted batches queue per partition as aiokafka queues them, and the test plays the
    sender: carry() drains a partition's first batch into a request, answer() acknowledges a
    carried batch, auto() does both for the partitions given, as soon as a batch is queued."""

    _txn_manager = None
    _sender = SimpleNamespace(sender_task=None)  # its sender never died (internals.sender_failure)

    def __init__(self, partitions: int = 4) -> None:
        everything = set(range(partitions))
        self.client = SimpleNamespace(
            _topics=set(),  # what aiokafka's metadata refresh names (internals.track_topics)
            cluster=SimpleNamespace(
                partitions_for_topic=lambda topic: set(everything),
                available_partitions_for_topic=lambda topic: set(everything),
            ),
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

    async def close(self) -> None:
        """End the test: answer what is still carried, stop the real producer built."""
        for batch in self.carried.values():
            batch.done(0)
        await self._real.stop()


def publisher_with(producer: object, **settings: Any) -> KafkaPublisher:
    """A publisher (under `settings`) whose producer is `producer`, as if started."""
    publisher = KafkaPublisher(configs_of(Settings(**settings)).publisher)
    publisher.producers.use(producer)  # type: ignore[arg-type]
    return publisher


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


class RecordingSettler:
    """A settler in memory: records each settle's row ids and results, changes every row."""

    def __init__(self) -> None:
        self.settled: list[list[int]] = []
        self.results: list[list[Result]] = []

    async def settle_shielded(self, batch: Batch, results: Sequence[Result]) -> int:
        self.settled.append([r.id for r in batch.records])
        self.results.append(list(results))
        return len(batch.records)


IDENTITY = "5f0c2a55-0000-4000-8000-000000000001"  # the outbox's identity in the fakes


class HandDriven:
    """The publisher of a delivery whose moves a test makes by hand: it only answers the
    outbox's identity (a delivery compares it with its transactions')."""

    def __init__(self, identity: str = IDENTITY) -> None:
        self.identity = identity

    def current_identity(self) -> str:
        return self.identity

    def parts(self, d: Any) -> Any:
        raise NotImplementedError("the test drives this delivery's moves itself")


class FakeProgressStore:
    """The exactly-once wing's store seam (kafka/exactly_once/store.ProgressStore) over no
    table: nobody registered or lost, no row pending, every key's duty cleared, nothing needed
    under `identity`, nobody beating. A test passes `needed` or `beating` to answer otherwise,
    or subclasses it."""

    def __init__(
        self,
        identity: str = IDENTITY,
        needed: Any = None,
        beating: Any = None,
    ) -> None:
        self.identity = identity
        self._needed = needed
        self._beating = beating

    async def live(self) -> Sequence[Any]:
        return []

    async def record(self, ids: Sequence[str]) -> None:
        pass

    async def lost(self, keys: Any, owners: Sequence[str]) -> Sequence[Any]:
        return []

    async def pending(self, pairs: list[tuple[int, int]], identity: str) -> list[OutboxRecord]:
        return []

    async def reconciled(self, keys: list[tuple[str, bool]]) -> int:
        return len(keys)

    async def needed(self, pairs: list[tuple[int, int]]) -> tuple[str, set[int]]:
        if self._needed is not None:
            found: tuple[str, set[int]] = await self._needed(pairs)
            return found
        return self.identity, set()

    async def beating(self) -> set[str]:
        if self._beating is not None:
            found: set[str] = await self._beating()
            return found
        return set()

    async def unsettled(self) -> int:
        return 0

    async def running(self) -> Sequence[Any]:
        return []

    async def silent(self) -> Sequence[Any]:
        return []

    async def forget(self, silent: Any, ids: Sequence[str]) -> bool:
        return False
