"""One claim on its way to Kafka: iterating a Delivery sends the claim and yields its parts as the
broker answers them (models.Part), the final one last.

A key's rows go out in waves, one per topic it visits in this claim: its rows for the next topic
are handed to the producer only once every earlier row of the key is acknowledged, and not at all
once one failed. Within one topic (one partition) the idempotent producer keeps the order. The
delivery keeps every record's answer, so that a cancelled run still knows what the broker
acknowledged (those rows are marked) and what it did not (those are given back). The generator
is suspended while its caller settles a part: nothing is sent or waited for meanwhile.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass

import structlog
from aiokafka import AIOKafkaProducer

from outbox_dispatcher import errors
from outbox_dispatcher.errors import NotAttempted
from outbox_dispatcher.kafka import failures, producers
from outbox_dispatcher.kafka.acks import UNACKNOWLEDGED, Acks
from outbox_dispatcher.kafka.batches import Answer, Batches
from outbox_dispatcher.kafka.producers import NotSubmitted, Producers
from outbox_dispatcher.kafka.records import RecordEncoder
from outbox_dispatcher.kafka.topics import ClaimLookups, TopicLookup
from outbox_dispatcher.kafka.waves import plan_waves
from outbox_dispatcher.models import Failure, OutboxRecord, Part
from outbox_dispatcher.tracing import Tracer

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class DeliveryConfig:
    publish_timeout_seconds: float
    max_batch_bytes: int


class Delivery:
    """A claim's records, every record's answer, and what has been handed out in parts. It is
    iterated once: iterating it is sending the claim."""

    def __init__(
        self,
        records: Sequence[OutboxRecord],
        *,
        encoder: RecordEncoder,
        producers: Producers,
        lookup: TopicLookup,
        tracer: Tracer,
        config: DeliveryConfig,
        heartbeat: Callable[[], None],
    ) -> None:
        self.records = records
        self.topics = [encoder.topic(record) for record in records]  # or why a row has none
        self.answers: list[Answer] = [None] * len(records)
        self.failed_keys: set[str] = set()  # their later rows are not attempted
        self.topic_errors: dict[str, BaseException] = {}  # the lookups' verdicts
        # Nothing more will be sent for this claim: every record without an answer yet is being
        # retried by its producer, or will not be attempted (see stop_sending).
        self.final = False
        self.settled: set[int] = set()  # handed out in parts
        self._producers = producers
        self._lookup = lookup
        self._config = config
        self._batches = Batches(
            records, self.topics, encoder=encoder, producers=producers, lookup=lookup, tracer=tracer
        )
        self._acks = Acks(
            producers,
            lookup,
            self._batches.submitted,
            publish_timeout_seconds=config.publish_timeout_seconds,
            heartbeat=heartbeat,
        )
        self._gave_up = False  # past publish_timeout records were withdrawn unsent (see _send)
        self._iterated = False

    @property
    def parked(self) -> bool:
        """Past publish_timeout, waiting only for requests in flight that the broker refuses
        for now (see acks.Acks.parked)."""
        return self._acks.parked

    @property
    def producers_used(self) -> list[AIOKafkaProducer]:
        return self._batches.producers_used

    def __aiter__(self) -> AsyncGenerator[Part, None]:
        if self._iterated:
            msg = "a delivery is iterated once: iterating it sends the claim"
            raise errors.OutboxDispatcherError(msg)
        self._iterated = True
        return self._parts()

    async def _parts(self) -> AsyncGenerator[Part, None]:
        if self.records:
            try:
                await self._producers.replace_if_broken()
            except errors.BrokerUnavailableError as exc:
                self.answers[:] = [exc] * len(self.records)
            else:
                async with aclosing(self._send_claim()) as parts:
                    async for part in parts:
                        yield part
        yield self.final_part()

    async def _send_claim(self) -> AsyncGenerator[Part, None]:
        """The records whose topics are known go at once, the others as their topics' lookups
        answer (topics.ClaimLookups), the keys answered meanwhile yielded between."""
        lookups = ClaimLookups(self._lookup, self.records, self.topics)
        self.topic_errors = lookups.errors
        ready, later = lookups.split()
        try:
            while True:
                if ready:
                    async with aclosing(self._send(ready)) as parts:
                        async for part in parts:
                            yield part
                    if self._gave_up:
                        async with aclosing(self._given_up()) as parts:
                            async for part in parts:
                                yield part
                        return
                    done = set(ready)
                    later = [i for i in later if i not in done]
                    if later:
                        yield self.part()  # the keys acknowledged while lookups run
                if not later:
                    return
                ready = await lookups.ready(later)
        finally:
            lookups.cancel()

    async def _send(self, indices: Sequence[int]) -> AsyncGenerator[Part, None]:
        """Send records[indices] wave by wave; past publish_timeout with records withdrawn
        unsent, give up (_gave_up: the rest is not attempted)."""
        sizes = self._batches.encode(indices)
        waves = plan_waves(
            [self.records[i] for i in indices],
            [self.topics[i] for i in indices],
            self._config.max_batch_bytes,
            self._lookup.partitions,
            sizes=sizes,
        )
        queue = deque([indices[j] for j in part] for part in waves)
        while queue:
            wave = queue.popleft()
            try:
                await self._producers.replace_if_broken()
            except errors.BrokerUnavailableError as exc:
                for i in wave:
                    self.answers[i] = exc
                return
            deferred = self.send_wave(wave)
            if deferred:
                # Their partition's batch was full: they go next, before any later row of their
                # keys (which are all in later waves).
                queue.appendleft(deferred)
                held = set(deferred)
                wave = [i for i in wave if i not in held]
            async with aclosing(self.await_acks(wave)) as parts:
                async for part in parts:
                    yield part
            if self._acks.withdrew:
                self._gave_up = True
                return
            self.note_unsubmitted(wave)
            await self.retry_rejected_alone(wave)
            self.after_wave(wave)

    async def _given_up(self) -> AsyncGenerator[Part, None]:
        """publish_timeout passed and records were withdrawn unsent: nothing more is sent for
        this claim. The keys that have all their answers are yielded at once (their rows given
        back or marked), then what is in flight is waited for (drain)."""
        self.stop_sending()
        yield self.part()
        async with aclosing(self.drain()) as parts:
            async for part in parts:
                yield part

    def send_wave(self, wave: Sequence[int]) -> list[int]:
        """Hand a wave to the producer (batches.Batches.send); returns the records deferred to a
        wave of their own, next."""
        return self._batches.send(wave, self.answers, self.failed_keys, self.topic_errors)

    async def await_acks(self, wave: Sequence[int]) -> AsyncGenerator[Part, None]:
        """Wait for the wave's answers (acks.Acks.wait), yielding the keys answered meanwhile."""
        pending = {f for i in wave if isinstance(f := self.answers[i], asyncio.Future)}
        async with aclosing(self._acks.wait(pending)) as moments:
            async for _ in moments:
                yield self.part()

    async def drain(self) -> AsyncGenerator[Part, None]:
        """Wait for every request still in flight (acks.Acks.drain), yielding the keys answered
        meanwhile."""
        pending = {f for f in self.answers if isinstance(f, asyncio.Future) and not f.done()}
        async with aclosing(self._acks.drain(pending)) as moments:
            async for _ in moments:
                yield self.part()

    def note_unsubmitted(self, wave: Sequence[int]) -> None:
        """Batches of the wave that never reached the producer, as if the send had failed at
        once: a key's first row takes the failure, its later rows were not attempted on their own
        account."""
        seen: set[str] = set()
        for i in wave:
            item = self.answers[i]
            if not (isinstance(item, asyncio.Future) and item.done() and not item.cancelled()):
                continue
            problem = item.exception()
            if not isinstance(problem, NotSubmitted):
                continue
            self._producers.note(problem.cause)
            key = self.records[i].ordering_key
            self.answers[i] = NotAttempted() if key is not None and key in seen else problem.cause
            if key is not None:
                seen.add(key)
                self.failed_keys.add(key)

    def after_wave(self, wave: Sequence[int]) -> None:
        """Note what the wave's answers say about the producer, and which keys failed (their
        later rows are not attempted). Records of one batch share one future: each is looked
        at once."""
        verdicts: dict[int, bool] = {}
        for i in wave:
            answer = self.answers[i]
            if isinstance(answer, asyncio.Future):
                verdict = verdicts.get(id(answer))
                if verdict is None:
                    verdict = verdicts[id(answer)] = failed(answer)
                    if answer.done() and not answer.cancelled():
                        self._producers.note(answer.exception())
                        if rejected(answer):  # its sequence numbers were used up: a new producer
                            self._producers.condemn(exception_of(answer))
            else:
                verdict = True
            key = self.records[i].ordering_key
            if verdict and key is not None:
                self.failed_keys.add(key)

    def stop_sending(self) -> None:
        """Every record not handed to the producer yet is not attempted. The records of a batch
        the broker refused whole are not blamed either: they are not retried one by one now
        (review F9), and the refusal used up the producer's sequence numbers."""
        self.final = True
        shared: dict[int, int] = {}
        for item in self.answers:
            shared[id(item)] = shared.get(id(item), 0) + 1
        for i, item in enumerate(self.answers):
            if item is None:
                self.answers[i] = NotAttempted()
            elif rejected(item) and shared[id(item)] > 1:
                self._producers.condemn(exception_of(item), keep_earlier=True)
                self.answers[i] = NotAttempted()

    async def retry_rejected_alone(self, wave: Sequence[int]) -> None:
        """The broker refuses a whole partition batch for one bad record, and every record of
        the batch shares its one future: send the records of a refused batch again one at a
        time, so that only the record the broker refuses alone takes the blame (dead-lettered
        or counted). A record alone in its batch was refused for itself."""
        batches: dict[int, list[int]] = {}
        for i in wave:
            if rejected(self.answers[i]):
                batches.setdefault(id(self.answers[i]), []).append(i)
        suspects = sorted(i for batch in batches.values() if len(batch) > 1 for i in batch)
        if not suspects:
            return
        # The rejected batch used up sequence numbers the broker never saw: a fresh producer id.
        self._producers.condemn(exception_of(self.answers[suspects[0]]), keep_earlier=True)
        log.info("batch_rejected_retrying_alone", rows=len(suspects))
        for i in suspects:
            self.answers[i] = None  # not sent (a cancelled retry gives it back, not blames it)
        failed_keys: set[str] = set()
        for i in suspects:
            key = self.records[i].ordering_key
            if key is not None and key in failed_keys:
                self.answers[i] = NotAttempted()
                continue
            try:
                await self._producers.replace_if_broken()
            except errors.BrokerUnavailableError as exc:
                self.answers[i] = exc
            else:
                # Alone in an empty batch: never deferred; its wait has no early settle.
                self._batches.send([i], self.answers, failed_keys, {})
                pending = {f for f in (self.answers[i],) if isinstance(f, asyncio.Future)}
                async for _ in self._acks.wait(pending, early=False):
                    pass  # yields nothing without early settles
                if self._acks.withdrew:
                    self.answers[i] = errors.BrokerUnavailableError(UNACKNOWLEDGED)
            item = self.answers[i]
            if rejected(item):  # this refusal also used up a sequence number
                self._producers.condemn(exception_of(item))
            if key is not None and failed(item):
                failed_keys.add(key)

    def part(self) -> Part:
        """The rows whose key has every row answered now (acknowledged), noted as settled
        before the caller settles them: a cancel during that settle must not settle them again
        (review N12)."""
        done = self.acknowledged()
        self.settled.update(done)
        return Part(done, outcomes_of([self.answers[i] for i in done], NotAttempted()))

    def final_part(self) -> Part:
        """Every row not settled yet, with its outcome: nothing more is sent."""
        outcomes = outcomes_of(
            self.answers, errors.BrokerUnavailableError(UNACKNOWLEDGED), unsent=NotAttempted()
        )
        for outcome in outcomes:
            self._producers.note(outcome)
        rest = self.unsettled()
        self.settled.update(rest)
        return Part(rest, [outcomes[i] for i in rest], final=True)

    def unsettled(self) -> list[int]:
        return [i for i in range(len(self.records)) if i not in self.settled]

    def not_settled(self) -> list[int]:
        """The rows no part has carried yet (batch.Deliveries; here as unsettled)."""
        return self.unsettled()

    def acknowledged(self) -> list[int]:
        """Indices of rows not yet settled whose key has every row of the batch acknowledged
        (keyless rows: the row itself). A key with any row pending, failed or not yet sent waits
        for the whole batch: its rows are settled together, in one statement. Once nothing more is
        sent for the claim (final), a key whose rows all have their answer, failures included,
        is settled too: only rows still in flight wait."""
        return acknowledged(self.records, self.answers, final=self.final, already=self.settled)

    def outcomes(self, *, stopped: BaseException) -> list[BaseException | None]:
        """Every row's outcome for a run cancelled at shutdown, after abandon: an outage's
        failure, or no answer, becomes `stopped` (not attempted: the row keeps its place and is
        not counted); an acknowledgement or the row's own failure stands."""
        return [
            stopped if o is not None and failures.classify(o) is Failure.TRANSIENT else o
            for o in outcomes_of(self.answers, stopped)
        ]

    async def abandon(self, reason: str) -> None:
        """The process is stopping past its grace period: close the producers holding this
        claim's answers (bounded, Producers.close_bounded), so that every answer is settled,
        acknowledged or failed for good, before unacknowledged rows are given back (an open
        idempotent producer retries a drained batch for ever, and would deliver it after the
        re-claim did: review F4). A request in flight when the bound ends may still be appended:
        docs/guarantees.md counts that among the copies a crash can make."""
        await self._producers.close_bounded(self.producers_used, reason)
        # A submission still waiting for its partition's previous batch to leave never reached
        # the closed producer: it ends here, unacknowledged (its rows are given back). The
        # others wait on answers the close has settled: let them take those answers first (an
        # acknowledged row must not be given back).
        tasks = {t for t in self.answers if isinstance(t, asyncio.Future) and not t.done()}
        for task in tasks:
            if self._producers.handing_over(task):
                task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=producers.STOP_FLUSH_SECONDS)


def outcomes_of(
    answers: Sequence[Answer], unacknowledged: BaseException, *, unsent: BaseException | None = None
) -> list[BaseException | None]:
    """None for an acknowledged record, else why it is not acknowledged. Records never handed
    to the producer (None) get `unsent`, by default `unacknowledged`."""
    not_sent = unacknowledged if unsent is None else unsent
    results: list[BaseException | None] = []
    for item in answers:
        if item is None:
            results.append(not_sent)
        elif isinstance(item, BaseException):
            results.append(item)
        elif not item.done() or item.cancelled():
            results.append(unacknowledged)
        else:
            problem = item.exception()
            results.append(problem.cause if isinstance(problem, NotSubmitted) else problem)
    return results


def acknowledged(
    records: Sequence[OutboxRecord], answers: Sequence[Answer], *, final: bool, already: set[int]
) -> list[int]:
    """See Delivery.acknowledged."""

    def answered(i: int) -> bool:
        item = answers[i]
        if isinstance(item, asyncio.Future):
            return item.done() and (final or (not item.cancelled() and not item.exception()))
        return final and item is not None

    key_done: dict[str, bool] = {}
    for i, record in enumerate(records):
        key = record.ordering_key
        if key is not None:
            key_done[key] = key_done.get(key, True) and answered(i)
    return [
        i
        for i, record in enumerate(records)
        if i not in already
        and answered(i)
        and (record.ordering_key is None or key_done[record.ordering_key])
    ]


def failed(item: Answer) -> bool:
    """A record that is not (or not yet) acknowledged: its key's later rows must wait."""
    if item is None or isinstance(item, BaseException):
        return True
    return not item.done() or item.cancelled() or item.exception() is not None


def rejected(item: Answer) -> bool:
    """The broker refused the record's batch (an error that is neither an outage nor the
    producer's own state): the refusal may be another record's fault."""
    if not isinstance(item, asyncio.Future) or not item.done() or item.cancelled():
        return False
    return failures.is_rejection(item.exception())


def exception_of(item: Answer) -> BaseException:
    """The exception of a rejected batch (what marks the producer for replacement)."""
    if isinstance(item, asyncio.Future) and item.done() and not item.cancelled():
        exc = item.exception()
        if exc is not None:
            return exc
    return errors.BrokerUnavailableError("the broker refused a batch")
