"""Publishes claimed records to Kafka: acks=all, idempotent, one producer batch per partition and
wave, built by the dispatcher (aiokafka's batch API).

Sending is split from waiting so that a cancelled wait still knows which records the broker had
acknowledged (those are marked) and which it had not (those are given back).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
from aiokafka import AIOKafkaProducer
from aiokafka import errors as kafka_errors

from outbox_dispatcher import errors
from outbox_dispatcher.errors import NotAttempted as NotAttempted
from outbox_dispatcher.errors import TopicMissingError as TopicMissingError
from outbox_dispatcher.kafka import failures, internals, producers
from outbox_dispatcher.kafka.producers import NotSubmitted, Producers
from outbox_dispatcher.kafka.records import (
    KafkaRecord,
    RecordEncoder,
    partition_in,
)
from outbox_dispatcher.kafka.topics import TopicLookup
from outbox_dispatcher.kafka.waves import plan_waves
from outbox_dispatcher.models import OutboxRecord
from outbox_dispatcher.settings import Settings
from outbox_dispatcher.tracing import Tracer

log = structlog.get_logger(__name__)

# A wave whose acks are missing this long after it was sent settles the keys already acknowledged
# and lets the claim loop go on, so that one partition that does not acknowledge holds back only
# its own keys (review F10). Sooner once one partition has answered: the others normally answer
# within EARLY_SETTLE_FACTOR times as long (they share the broker's round trip), so a wave still
# waiting after that (at least EARLY_SETTLE_MIN_SECONDS) has a partition that does not answer.
EARLY_SETTLE_SECONDS = 0.25
EARLY_SETTLE_MIN_SECONDS = 0.05
EARLY_SETTLE_FACTOR = 3.0


@dataclass
class Sent:
    """Per record: the delivery future, the exception that prevented sending, or None while it
    has not been handed to the producer."""

    futures: list[asyncio.Future[object] | BaseException | None] = field(default_factory=list)
    # The producers that hold its futures: closing them settles every future (see abandon).
    producers: list[AIOKafkaProducer] = field(default_factory=list)
    # Each submission's producer and batch builder: what withdraw_unsent looks for.
    batches: dict[asyncio.Future[object], tuple[AIOKafkaProducer, Any]] = field(
        default_factory=dict
    )
    # Nothing more will be sent for this claim: every record without an answer yet is being
    # retried by its producer, or will not be attempted (see KafkaPublisher._stop_sending).
    final: bool = False
    # Past publish_timeout, waiting only for requests in flight (the broker answers, refusing
    # them for now): nothing the claim loop could do would help, see dispatcher.MAX_STALLED_BATCHES.
    parked: bool = False


class KafkaPublisher:
    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._encoder = RecordEncoder(settings)
        self._tracer = Tracer(settings.tracing)
        self.producers = Producers(settings)
        self.topics = TopicLookup(self.producers, settings)

    @property
    def producer(self) -> AIOKafkaProducer:
        return self.producers.current()

    async def start(self) -> None:
        await self.producers.start()

    async def stop(self) -> None:
        """Flush and close the producers (bounded: the process is stopping, see
        Producers.stop)."""
        await self.producers.stop()

    async def broker_reachable(self, seconds: float = 5.0) -> bool:
        return await self.topics.reachable(seconds)

    async def abandon(self, sent: Sent, reason: str) -> None:
        """The process is stopping past its grace period: close the producers holding sent's
        futures (bounded, see _close), so that every future is settled, acknowledged or failed
        for good, before unacknowledged rows are given back (an open idempotent producer retries
        a drained batch for ever, and would deliver it after the re-claim did: review F4). A
        request in flight when the bound ends may still be appended: docs/guarantees.md counts
        that among the copies a crash can make."""
        await self.producers.close_bounded(sent.producers, reason)
        # A submission still waiting for its partition's previous batch to leave never reached
        # the closed producer: it ends here, unacknowledged (its rows are given back). The
        # others wait on answers the close has settled: let them take those answers first (an
        # acknowledged row must not be given back).
        tasks = {t for t in sent.futures if isinstance(t, asyncio.Future) and not t.done()}
        for task in tasks:
            if self.producers.handing_over(task):
                task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=producers.STOP_FLUSH_SECONDS)

    async def publish(
        self,
        records: Sequence[OutboxRecord],
        sent: Sent,
        heartbeat: Callable[[], None] = lambda: None,
        early: Callable[[], Awaitable[None]] | None = None,
    ) -> list[BaseException | None]:
        """Publish a claim and return each record's outcome (None: acknowledged). `early` is
        called when a wave's acks take longer than EARLY_SETTLE_SECONDS (sooner once one
        partition answered), then every EARLY_SETTLE_SECONDS in which later answers came while
        some are still missing (the caller settles the keys already acknowledged).

        A key's rows go out in waves, one per topic it visits in this claim: its rows for the
        next topic are handed to the producer only once every earlier row of the key is
        acknowledged, and not at all once one failed. Within one topic (one partition) the
        idempotent producer keeps the order. `sent` is filled as records are handed over, so
        that a cancelled publish still knows what it sent."""
        sent.futures = [None] * len(records)
        if not records:
            return []
        topics = [self._encoder.topic(record) for record in records]
        try:
            await self.producers.replace_if_broken()
        except errors.BrokerUnavailableError as exc:
            sent.futures = [exc] * len(records)
            return self.outcomes(sent, exc)
        # Topics without metadata yet are looked up, each on its own, while every key without a
        # row for such a topic goes out at once: a topic that does not exist takes
        # publish_timeout to be found missing, and other keys must not wait for it (guarantee 5).
        # The keys with a row for a looked-up topic go out once its lookup has answered.
        unknown = self.topics.unknown({t for t in topics if isinstance(t, str)})
        lookups = {t: asyncio.ensure_future(self.topics.errors_for({t})) for t in unknown}
        topic_errors: dict[str, BaseException] = {}
        now: list[int] = list(range(len(records)))
        later: list[int] = []
        if unknown:
            waiting_keys = {
                r.ordering_key
                for r, t in zip(records, topics, strict=True)
                if t in unknown and r.ordering_key is not None
            }
            later = [
                i
                for i, (r, t) in enumerate(zip(records, topics, strict=True))
                if t in unknown or (r.ordering_key is not None and r.ordering_key in waiting_keys)
            ]
            waiting = set(later)
            now = [i for i in now if i not in waiting]
        failed_keys: set[str] = set()
        try:
            if now and await self._publish_part(
                records, topics, now, sent, heartbeat, early, topic_errors, failed_keys
            ):
                return await self._given_up(sent, heartbeat, early)
            if now and later and early is not None:
                await early()  # settle the keys already acknowledged while lookups run
            pending = dict(lookups)
            while later:
                # Each key goes once every topic it has a row for has answered its lookup.
                if pending:
                    await asyncio.wait(pending.values(), return_when=asyncio.FIRST_COMPLETED)
                for t, lookup in list(pending.items()):
                    if lookup.done():
                        topic_errors |= lookup.result()
                        del pending[t]
                blocked = {
                    records[i].ordering_key
                    for i in later
                    if topics[i] in pending and records[i].ordering_key is not None
                }
                ready = [
                    i
                    for i in later
                    if topics[i] not in pending and records[i].ordering_key not in blocked
                ]
                if not ready:
                    continue
                if await self._publish_part(
                    records, topics, ready, sent, heartbeat, early, topic_errors, failed_keys
                ):
                    return await self._given_up(sent, heartbeat, early)
                done = set(ready)
                later = [i for i in later if i not in done]
                if later and early is not None:
                    await early()
        finally:
            for lookup in lookups.values():
                if not lookup.done():
                    lookup.cancel()
                elif not lookup.cancelled():
                    lookup.exception()  # retrieved: a lookup nobody waited for fails quietly
        return self._final_outcomes(sent)

    async def _given_up(
        self,
        sent: Sent,
        heartbeat: Callable[[], None],
        early: Callable[[], Awaitable[None]] | None,
    ) -> list[BaseException | None]:
        """publish_timeout passed and records were withdrawn unsent (_await_acks): nothing more
        is sent for this claim. The keys that have all their answers are settled at once (their
        rows given back or marked), then what is in flight is waited for (_drain)."""
        self._stop_sending(sent)
        if early is not None:
            await early()
        await self._drain(sent, heartbeat, early)
        return self._final_outcomes(sent)

    def _stop_sending(self, sent: Sent) -> None:
        """Every record not handed to the producer yet is not attempted. The records of a batch
        the broker refused whole are not blamed either: they are not retried one by one now
        (review F9), and the refusal used up the producer's sequence numbers."""
        sent.final = True
        shared: dict[int, int] = {}
        for item in sent.futures:
            shared[id(item)] = shared.get(id(item), 0) + 1
        for i, item in enumerate(sent.futures):
            if item is None:
                sent.futures[i] = NotAttempted()
            elif isinstance(item, asyncio.Future) and _rejected(item) and shared[id(item)] > 1:
                self.producers.condemn(_exception_of(item), keep_earlier=True)
                sent.futures[i] = NotAttempted()

    async def _publish_part(
        self,
        records: Sequence[OutboxRecord],
        topics: Sequence[str | BaseException],
        indices: Sequence[int],
        sent: Sent,
        heartbeat: Callable[[], None],
        early: Callable[[], Awaitable[None]] | None,
        topic_errors: Mapping[str, BaseException],
        failed_keys: set[str],
    ) -> bool:
        """Send records[indices] wave by wave (see publish); True if given up on after
        publish_timeout (the rest is not attempted)."""
        encoded = self._encode(records, topics, indices)
        sizes = [item.size if isinstance(item, KafkaRecord) else 0 for item in encoded]
        waves = plan_waves(
            [records[i] for i in indices],
            [topics[i] for i in indices],
            self._settings.kafka_max_batch_bytes,
            self.topics.partitions,
            sizes=sizes,
        )
        encoding = dict(zip(indices, encoded, strict=True))
        queue = deque([indices[j] for j in part] for part in waves)
        while queue:
            wave = queue.popleft()
            try:
                await self.producers.replace_if_broken()
            except errors.BrokerUnavailableError as exc:
                for i in wave:
                    sent.futures[i] = exc
                return False
            deferred = await self._send_wave(
                records, topics, encoding, wave, sent, topic_errors, failed_keys
            )
            if deferred:
                # Their partition's batch was full: they go next, before any later row of their
                # keys (which are all in later waves).
                queue.appendleft(deferred)
                held = set(deferred)
                wave = [i for i in wave if i not in held]
            if await self._await_acks(sent, wave, heartbeat, early):
                return True
            self._unsubmitted(records, wave, sent, failed_keys)
            await self._retry_rejected_alone(records, topics, encoding, wave, sent, heartbeat)
            self._after_wave(records, wave, sent, failed_keys)
        return False

    def _encode(
        self,
        records: Sequence[OutboxRecord],
        topics: Sequence[str | BaseException],
        indices: Sequence[int],
    ) -> list[KafkaRecord | BaseException | None]:
        """Each record as the producer will send it, or why it cannot be one (None: its topic
        failed already)."""
        encoder = self._encoder
        encoded: list[KafkaRecord | BaseException | None] = []
        for i in indices:
            if not isinstance(topics[i], str):
                encoded.append(None)
                continue
            try:
                encoded.append(encoder.encode(records[i]))
            except (errors.UnpublishableRowError, kafka_errors.KafkaError) as exc:
                encoded.append(exc)
        return encoded

    def _after_wave(
        self,
        records: Sequence[OutboxRecord],
        wave: Sequence[int],
        sent: Sent,
        failed_keys: set[str],
    ) -> None:
        """Note what the wave's answers say about the producer, and which keys failed (their
        later rows are not attempted). Records of one batch share one future: each is looked
        at once."""
        failed: dict[int, bool] = {}
        for i in wave:
            answer = sent.futures[i]
            if isinstance(answer, asyncio.Future):
                verdict = failed.get(id(answer))
                if verdict is None:
                    verdict = failed[id(answer)] = _failed(answer)
                    if answer.done() and not answer.cancelled():
                        self.producers.note(answer.exception())
                        if _rejected(answer):  # its sequence numbers were used up: a new producer
                            self.producers.condemn(_exception_of(answer))
            else:
                verdict = True
            key = records[i].ordering_key
            if verdict and key is not None:
                failed_keys.add(key)

    async def _send_wave(
        self,
        records: Sequence[OutboxRecord],
        topics: Sequence[str | BaseException],
        encoded: Mapping[int, KafkaRecord | BaseException | None],
        wave: Sequence[int],
        sent: Sent,
        topic_errors: Mapping[str, BaseException],
        failed_keys: set[str],
    ) -> list[int]:
        """Hand a wave to the producer as one batch per (topic, partition), built here and
        submitted whole (aiokafka's batch API), so that the dispatcher decides which records
        share a produce request and the producer does no work per record. A record of a key
        that failed earlier is not attempted; one that cannot be sent gets why. Returns the
        records that found their partition's batch full (an estimate fell short), with the later
        rows of their keys: they go out in a wave of their own, next."""
        producer = self.producer
        batches: dict[tuple[str, int], tuple[Any, list[int]]] = {}
        ordered: dict[str, list[int] | None] = {}  # topic: its partitions by id
        keyless: dict[str, int] = {}  # topic: the partition of its keyless records in this wave
        deferred: list[int] = []
        deferred_keys: set[str] = set()
        for i in wave:
            record, topic, item = records[i], topics[i], encoded[i]
            key = record.ordering_key
            if key is not None:
                if key in failed_keys:
                    sent.futures[i] = NotAttempted()
                    continue
                if key in deferred_keys:
                    deferred.append(i)
                    continue
            target = self._target(topic, item, topic_errors, ordered)
            if isinstance(target, BaseException):
                sent.futures[i] = target
                if key is not None:
                    failed_keys.add(key)
                continue
            topic, item, partitions = target
            if key is not None:
                partition = partition_in(partitions, key)
            else:
                partition = keyless.get(topic, -1)
                if partition < 0:
                    partition = keyless[topic] = self.topics.keyless_partition(topic, partitions)
            slot = batches.get((topic, partition))
            if slot is None:
                slot = batches[(topic, partition)] = (producer.create_batch(), [])
            builder, members = slot
            if (
                builder.append(key=item.key, value=item.value, timestamp=None, headers=item.headers)
                is None
            ):
                deferred.append(i)
                if key is not None:
                    deferred_keys.add(key)
                continue
            members.append(i)
        if batches and (not sent.producers or sent.producers[-1] is not producer):
            sent.producers.append(producer)
        for (topic, partition), (builder, members) in batches.items():
            # Left open, the batch waits OUTBOX_KAFKA_LINGER_MS before it is sent, as the
            # producer's own batches did (closed, it would go at once; nothing else appends to
            # it: the dispatcher never uses send()).
            spans = [self._tracer.start(records[i], topic) for i in members]
            # Submitted concurrently: aiokafka's send_batch waits until the partition's previous
            # batch has left, and a partition that does not answer must not hold back the
            # submission (and so the acks and the early settle) of the wave's other partitions.
            submission = self.producers.submit(producer, builder, topic, partition)
            sent.batches[submission] = (producer, builder)
            for i in members:
                sent.futures[i] = submission
            for span in spans:
                self._tracer.end_on_ack(span, submission)
        return deferred

    def _unsubmitted(
        self,
        records: Sequence[OutboxRecord],
        wave: Sequence[int],
        sent: Sent,
        failed_keys: set[str],
    ) -> None:
        """Batches of the wave that never reached the producer, as if the send had failed at
        once: a key's first row takes the failure, its later rows were not attempted on their own
        account."""
        seen: set[str] = set()
        for i in wave:
            item = sent.futures[i]
            if not (isinstance(item, asyncio.Future) and item.done() and not item.cancelled()):
                continue
            problem = item.exception()
            if not isinstance(problem, NotSubmitted):
                continue
            self.producers.note(problem.cause)
            key = records[i].ordering_key
            sent.futures[i] = NotAttempted() if key is not None and key in seen else problem.cause
            if key is not None:
                seen.add(key)
                failed_keys.add(key)

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
            known = self.topics.partitions(topic)
            partitions = ordered[topic] = sorted(known) if known else None
        if partitions is None:
            return errors.BrokerUnavailableError(
                f"the producer knows no partitions of topic {topic!r} yet"
            )
        return topic, item, partitions

    async def _await_acks(
        self,
        sent: Sent,
        indices: Sequence[int],
        heartbeat: Callable[[], None],
        early: Callable[[], Awaitable[None]] | None = None,
    ) -> bool:
        """Wait for the broker's answers to sent[indices]. True once publish_timeout has passed
        with the broker answering and some of them withdrawn unsent (see _withdraw): the rest of
        the claim is not attempted, and what is in flight is waited for (_drain). While the
        broker is unreachable, keep waiting: the producer retries by itself and the lease keeper
        keeps the rows ours, so an outage ends in delivery, not in duplicates. Requests in flight
        are never failed: a request the broker appended and then answered with an error (a
        follower out of the ISR: NOT_ENOUGH_REPLICAS_AFTER_APPEND, REQUEST_TIMED_OUT) is
        committed once the ISR shrinks, and only its producer's own retry is recognised by the
        broker as that append; a row given back would be sent again under another producer id
        and appended twice (issue 25)."""
        pending = {f for i in indices if isinstance(f := sent.futures[i], asyncio.Future)}
        if pending and early is not None:
            pending = await self._await_first_answers(pending, heartbeat, early)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._settings.publish_timeout_seconds
        while pending:
            heartbeat()  # waiting for a broker is not being stuck
            remaining = deadline - loop.time()
            if remaining > 0:
                # With `early`, the answers that came meanwhile are settled every
                # EARLY_SETTLE_SECONDS while others are missing: a partition that answers after
                # the early settle (e.g. behind another partition's retries on the same broker)
                # must not wait for the silent one. Coalesced, not one settle per answer: a wave
                # of many partitions that lingers past the early settle would otherwise add a
                # statement per partition.
                step = remaining if early is None else min(remaining, EARLY_SETTLE_SECONDS)
                done, pending = await asyncio.wait(pending, timeout=step)
                if early is not None and done and pending:
                    await early()
                continue
            if not await self.topics.reachable():
                log.warning("broker_unreachable_waiting", unacknowledged=len(pending))
            elif withdrawn := self._withdraw(sent, pending):
                log.warning(
                    "publish_timed_out",
                    given_back=len(withdrawn),
                    in_flight=len(pending - withdrawn),
                )
                await asyncio.wait(withdrawn, timeout=producers.STOP_FLUSH_SECONDS)
                return True
            else:
                sent.parked = True
                log.warning(
                    "publish_waiting_for_broker",
                    in_flight=len(pending),
                    why=_IN_FLIGHT,
                )
            deadline = loop.time() + self._settings.publish_timeout_seconds
        return False

    async def _await_first_answers(
        self,
        pending: set[asyncio.Future[object]],
        heartbeat: Callable[[], None],
        early: Callable[[], Awaitable[None]],
    ) -> set[asyncio.Future[object]]:
        """The early settle (review F10): once EARLY_SETTLE_SECONDS have passed, or sooner once
        one partition answered (EARLY_SETTLE_FACTOR times its wait, at least
        EARLY_SETTLE_MIN_SECONDS), settle what is acknowledged; returns what is still pending."""
        loop = asyncio.get_running_loop()
        heartbeat()
        limit = min(EARLY_SETTLE_SECONDS, self._settings.publish_timeout_seconds)
        started = loop.time()
        done, pending = await asyncio.wait(
            pending, timeout=limit, return_when=asyncio.FIRST_COMPLETED
        )
        if pending and done:
            first = loop.time() - started
            wait = min(limit, max(EARLY_SETTLE_MIN_SECONDS, EARLY_SETTLE_FACTOR * first))
            if wait > first:
                _, pending = await asyncio.wait(pending, timeout=wait - first)
        if pending:
            await early()
        return pending

    def _withdraw(
        self, sent: Sent, pending: set[asyncio.Future[object]]
    ) -> set[asyncio.Future[object]]:
        """The pending submissions that never reached the broker, ended now: those still
        waiting to be handed to their producer, and batches the producer still queues behind a
        request in flight on the same partition (internals.withdraw_unsent). Their rows can be
        given back with no copy left anywhere."""
        withdrawn: set[asyncio.Future[object]] = set()
        unsent = errors.BrokerUnavailableError(_UNACKNOWLEDGED)
        for future in pending:
            if self.producers.handing_over(future):
                future.cancel()
                withdrawn.add(future)
                continue
            producer, builder = sent.batches.get(future, (None, None))
            if producer is not None and internals.withdraw_unsent(producer, unsent, [builder]):
                withdrawn.add(future)
        return withdrawn

    async def _drain(
        self,
        sent: Sent,
        heartbeat: Callable[[], None],
        early: Callable[[], Awaitable[None]] | None,
    ) -> None:
        """Once the claim was given up on: wait for every request still in flight, however long
        the broker refuses it (see _await_acks), settling the keys answered meanwhile."""
        pending = {f for f in sent.futures if isinstance(f, asyncio.Future) and not f.done()}
        loop = asyncio.get_running_loop()
        warned = loop.time()
        while pending:
            sent.parked = True
            heartbeat()
            done, pending = await asyncio.wait(pending, timeout=EARLY_SETTLE_SECONDS)
            if early is not None and done:
                await early()
            if pending and loop.time() - warned >= self._settings.publish_timeout_seconds:
                warned = loop.time()
                log.warning("publish_waiting_for_broker", in_flight=len(pending), why=_IN_FLIGHT)

    async def _retry_rejected_alone(
        self,
        records: Sequence[OutboxRecord],
        topics: Sequence[str | BaseException],
        encoded: Mapping[int, KafkaRecord | BaseException | None],
        indices: Sequence[int],
        sent: Sent,
        heartbeat: Callable[[], None],
    ) -> None:
        """The broker refuses a whole partition batch for one bad record, and every record of
        the batch shares its one future: send the records of a refused batch again one at a
        time, so that only the record the broker refuses alone takes the blame (dead-lettered
        or counted). A record alone in its batch was refused for itself."""
        batches: dict[int, list[int]] = {}
        for i in indices:
            item = sent.futures[i]
            if isinstance(item, asyncio.Future) and _rejected(item):
                batches.setdefault(id(item), []).append(i)
        suspects = sorted(i for batch in batches.values() if len(batch) > 1 for i in batch)
        if not suspects:
            return
        # The rejected batch used up sequence numbers the broker never saw: a fresh producer id.
        self.producers.condemn(_exception_of(sent.futures[suspects[0]]), keep_earlier=True)
        log.info("batch_rejected_retrying_alone", rows=len(suspects))
        for i in suspects:
            sent.futures[i] = None  # not sent (a cancelled retry gives it back, not blames it)
        failed_keys: set[str] = set()
        for i in suspects:
            key = records[i].ordering_key
            if key is not None and key in failed_keys:
                sent.futures[i] = NotAttempted()
                continue
            try:
                await self.producers.replace_if_broken()
            except errors.BrokerUnavailableError as exc:
                sent.futures[i] = exc
            else:
                # Alone in an empty batch: never deferred.
                await self._send_wave(records, topics, encoded, [i], sent, {}, failed_keys)
                if await self._await_acks(sent, [i], heartbeat):
                    sent.futures[i] = errors.BrokerUnavailableError(_UNACKNOWLEDGED)
            item = sent.futures[i]
            if isinstance(item, asyncio.Future) and _rejected(item):
                # This refusal also used up a sequence number.
                self.producers.condemn(_exception_of(item))
            if key is not None and _failed(item):
                failed_keys.add(key)

    def _final_outcomes(self, sent: Sent) -> list[BaseException | None]:
        outcomes = self.outcomes(
            sent, errors.BrokerUnavailableError(_UNACKNOWLEDGED), unsent=NotAttempted()
        )
        for outcome in outcomes:
            self.producers.note(outcome)
        return outcomes

    @staticmethod
    def outcomes(
        sent: Sent,
        unacknowledged: BaseException,
        total: int | None = None,
        *,
        unsent: BaseException | None = None,
    ) -> list[BaseException | None]:
        """None for an acknowledged record, else why it is not acknowledged. Records never handed
        to the producer (None in `sent`, or past its end up to `total`) get `unsent`, by default
        `unacknowledged`."""
        not_sent = unacknowledged if unsent is None else unsent
        results: list[BaseException | None] = []
        for item in sent.futures:
            if item is None:
                results.append(not_sent)
            elif isinstance(item, BaseException):
                results.append(item)
            elif not item.done() or item.cancelled():
                results.append(unacknowledged)
            else:
                problem = item.exception()
                results.append(problem.cause if isinstance(problem, NotSubmitted) else problem)
        missing = (total or 0) - len(results)
        results.extend([not_sent] * max(0, missing))
        return results


_UNACKNOWLEDGED = "the broker did not acknowledge within OUTBOX_PUBLISH_TIMEOUT_SECONDS"
_IN_FLIGHT = (
    "the broker answers but refuses or does not confirm records a request carried (e.g. "
    "NotEnoughReplicas); they may be in its log already, so they are retried by the same "
    "producer until it answers, never given back to be sent twice"
)


def _failed(item: asyncio.Future[object] | BaseException | None) -> bool:
    """A record that is not (or not yet) acknowledged: its key's later rows must wait."""
    if item is None or isinstance(item, BaseException):
        return True
    return not item.done() or item.cancelled() or item.exception() is not None


def _rejected(future: asyncio.Future[object]) -> bool:
    """The broker refused the record's batch (an error that is neither an outage nor the
    producer's own state): the refusal may be another record's fault."""
    if not future.done() or future.cancelled():
        return False
    return failures.is_rejection(future.exception())


def _exception_of(item: asyncio.Future[object] | BaseException | None) -> BaseException:
    """The exception of a rejected batch (what marks the producer for replacement)."""
    if isinstance(item, asyncio.Future) and item.done() and not item.cancelled():
        exc = item.exception()
        if exc is not None:
            return exc
    return errors.BrokerUnavailableError("the broker refused a batch")


def _consume(future: asyncio.Future[object]) -> None:
    """Retrieve a late result so that asyncio does not warn about it."""
    if not future.cancelled():
        future.exception()
