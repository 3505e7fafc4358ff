"""A claim's records as producer batches: each wave is one batch per (topic, partition), built
here and submitted whole (aiokafka's batch API), so that the dispatcher decides which records
share a produce request and the producer does no work per record."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Container, Mapping, MutableSequence, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka import errors as kafka_errors

from outbox_dispatcher import errors
from outbox_dispatcher.errors import NotAttempted
from outbox_dispatcher.kafka.producers import Producers
from outbox_dispatcher.kafka.records import KafkaRecord, RecordEncoder, partition_in
from outbox_dispatcher.kafka.topics import TopicLookup
from outbox_dispatcher.models import OutboxRecord
from outbox_dispatcher.tracing import Tracer

# A record's answer: the submission that carries its batch (a future: acknowledged, failed, or
# still pending), the exception that kept it from being sent, or None while it has not been
# handed to a producer.
Answer = asyncio.Future[object] | BaseException | None

# (topic, partition): the batch builder and the indices of its records.
_Batches = dict[tuple[str, int], tuple[Any, list[int]]]


@dataclass(eq=False)
class Batches:
    """The batches of one claim, wave after wave, and the producers they went to."""

    records: Sequence[OutboxRecord]
    topics: Sequence[str | BaseException]
    _: KW_ONLY
    encoder: RecordEncoder
    producers: Producers
    lookup: TopicLookup
    tracer: Tracer
    # Exactly-once: why a row of a (topic, partition) must wait (exactly_once/stalls.py), if it
    # must; and the rows (by id) that go in a producer batch of their own (a batch the broker
    # refused whole held them: kafka/exactly_once/publisher.py).
    held: Callable[[tuple[str, int]], BaseException | None] | None = None
    alone: Container[int] = frozenset()
    # The producers that hold the claim's answers: closing them settles every answer.
    producers_used: list[AIOKafkaProducer] = field(default_factory=list, init=False)
    # Each submission's producer and batch builder: what a withdrawal looks for.
    submitted: dict[asyncio.Future[object], tuple[AIOKafkaProducer, Any]] = field(
        default_factory=dict, init=False
    )
    # Each submission's (topic, partition).
    where: dict[asyncio.Future[object], tuple[str, int]] = field(default_factory=dict, init=False)
    _encoded: dict[int, KafkaRecord | BaseException | None] = field(
        default_factory=dict, init=False, repr=False
    )

    def encode(self, indices: Sequence[int]) -> list[int]:
        """Encode records[indices] as the producer will send them (or note why one cannot be
        one; None: its topic failed already); returns each one's bytes in a batch at most."""
        sizes = []
        for i in indices:
            item: KafkaRecord | BaseException | None = None
            if isinstance(self.topics[i], str):
                try:
                    item = self.encoder.encode(self.records[i])
                except (errors.UnpublishableRowError, kafka_errors.KafkaError) as exc:
                    item = exc
            self._encoded[i] = item
            sizes.append(item.size if isinstance(item, KafkaRecord) else 0)
        return sizes

    def send(
        self,
        wave: Sequence[int],
        answers: MutableSequence[Answer],
        failed_keys: set[str],
        topic_errors: Mapping[str, BaseException],
    ) -> list[int]:
        """Hand a wave to the current producer and note each record's answer: its submission,
        or, for a record of a key that failed earlier, NotAttempted, or why it cannot be sent
        (its key then fails). Returns the records that found their partition's batch full (an
        estimate fell short), with the later rows of their keys: they go out in a wave of their
        own, next."""
        producer = self.producers.current()
        batches, deferred = self._fill(producer, wave, answers, failed_keys, topic_errors)
        if batches and (not self.producers_used or self.producers_used[-1] is not producer):
            self.producers_used.append(producer)
        for (topic, partition), (builder, members) in batches.items():
            # Left open, the batch waits OUTBOX_KAFKA_LINGER_MS before it is sent, as the
            # producer's own batches did (closed, it would go at once; nothing else appends to
            # it: the dispatcher never uses send()).
            spans = [self.tracer.start(self.records[i], topic) for i in members]
            # Submitted concurrently: aiokafka's send_batch waits until the partition's previous
            # batch has left, and a partition that does not answer must not hold back the
            # submission (and so the acks and the early settle) of the wave's other partitions.
            submission = self.producers.submit(producer, builder, topic, partition)
            self.submitted[submission] = (producer, builder)
            self.where[submission] = (topic, partition)
            for i in members:
                answers[i] = submission
            for span in spans:
                self.tracer.end_on_ack(span, submission)
        return deferred

    def _fill(
        self,
        producer: AIOKafkaProducer,
        wave: Sequence[int],
        answers: MutableSequence[Answer],
        failed_keys: set[str],
        topic_errors: Mapping[str, BaseException],
    ) -> tuple[_Batches, list[int]]:
        """The wave's batches, each with its members, and the records deferred (see send)."""
        batches: _Batches = {}
        ordered: dict[str, list[int] | None] = {}  # topic: its partitions by id
        keyless: dict[str, int] = {}  # topic: the partition of its keyless records in this wave
        deferred: list[int] = []
        deferred_keys: set[str] = set()
        for i in wave:
            key = self.records[i].ordering_key
            if key is not None:
                if key in failed_keys:
                    answers[i] = NotAttempted()
                    continue
                if key in deferred_keys:
                    deferred.append(i)
                    continue
            target = self._target(self.topics[i], self._encoded[i], topic_errors, ordered)
            if isinstance(target, BaseException):
                answers[i] = target
                if key is not None:
                    failed_keys.add(key)
                continue
            topic, item, partitions = target
            if key is not None:
                partition = partition_in(partitions, key)
            else:
                partition = keyless.get(topic, -1)
                if partition < 0:
                    partition = keyless[topic] = self.lookup.keyless_partition(topic, partitions)
            if self.held is not None and (wait := self.held((topic, partition))) is not None:
                answers[i] = wait
                if key is not None:
                    failed_keys.add(key)
                continue
            slot = batches.get((topic, partition))
            alone = self.records[i].id in self.alone
            if slot is None:
                slot = batches[(topic, partition)] = (producer.create_batch(), [])
            builder, members = slot
            if (
                (alone and members)
                or (members and self.records[members[0]].id in self.alone)
                or builder.append(
                    key=item.key, value=item.value, timestamp=None, headers=item.headers
                )
                is None
            ):
                # Full (or one of the two must be alone): in a wave of its own, next.
                deferred.append(i)
                if key is not None:
                    deferred_keys.add(key)
                continue
            members.append(i)
        return batches, deferred

    def _target(
        self,
        topic: str | BaseException,
        item: KafkaRecord | BaseException | None,
        topic_errors: Mapping[str, BaseException],
        ordered: dict[str, list[int] | None],
    ) -> tuple[str, KafkaRecord, list[int]] | BaseException:
        """The record, its topic and the topic's partitions by id (`ordered` caches them for a
        wave), or why the record cannot be sent."""
        if isinstance(topic, BaseException):
            return topic
        problem = topic_errors.get(topic)
        if problem is not None:
            return problem
        if not isinstance(item, KafkaRecord):
            return item if item is not None else errors.UnpublishableRowError()
        if topic in ordered:
            partitions = ordered[topic]
        else:
            known = self.lookup.partitions(topic)
            partitions = ordered[topic] = sorted(known) if known else None
        if partitions is None:
            return errors.BrokerUnavailableError(
                f"the producer knows no partitions of topic {topic!r} yet"
            )
        return topic, item, partitions
