"""Exactly-once publication (OUTBOX_DELIVERY=exactly-once; docs/design/exactly-once.md).

A claim's records go out in one Kafka transaction, ended by the dispatcher's progress record
(kafka/progress.py), under the dispatcher's own transactional id; its rows are marked only once
the transaction committed. A claim that took rows over from a lost claim first fences every
other dispatcher's transactional id and reads the committed progress: its rows that a lost
claim committed are marked, not sent again. A commit whose outcome is unknown is settled by the
progress once the producer is replaced (its successor's start ends the transaction), and if
that cannot be read the rows stay leased, unsettled, for the next takeover to decide.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence

import structlog
from aiokafka import errors as kafka_errors

from outbox_dispatcher import errors
from outbox_dispatcher.kafka import failures, internals, progress
from outbox_dispatcher.kafka.batches import Answer, Batches
from outbox_dispatcher.kafka.producers import NotSubmitted, Producers
from outbox_dispatcher.kafka.progress import ProgressConfig, ProgressUnavailableError
from outbox_dispatcher.kafka.publisher import PublisherConfig
from outbox_dispatcher.kafka.records import RecordEncoder
from outbox_dispatcher.kafka.topics import TopicLookup
from outbox_dispatcher.models import OutboxRecord, Part
from outbox_dispatcher.tracing import Tracer

log = structlog.get_logger(__name__)

# IllegalOperation: aiokafka refuses a send or a commit of a producer whose transaction a fatal
# error (a fence) ended.
KAFKA_TROUBLE = (kafka_errors.KafkaError, kafka_errors.IllegalOperation, OSError, TimeoutError)
FENCES_AT_ONCE = 8
UNKNOWN: BaseException = errors.BrokerUnavailableError("the transaction's outcome is unknown")
NOTHING_SENT = errors.NotAttempted("nothing of the batch could be sent")
REPLACED = "the producer was replaced after the claim: its rows are given back, not sent"
_AnyOwners = Callable[[], Awaitable[Sequence[str]]]
_PendingRows = Callable[[list[int]], Awaitable[Sequence[OutboxRecord]]]


class TransactionAbortedError(errors.OutboxDispatcherError):
    """The batch's Kafka transaction was aborted (a record of it failed, or a takeover fenced
    this dispatcher): read_committed consumers saw none of it; retried, not counted."""

    retriable = True
    failure = errors.BrokerUnavailableError.failure


class TransactionFencedError(TransactionAbortedError, errors.NotAttempted):
    """The batch's transaction was ended by a fence (another dispatcher's takeover, or the
    broker's transaction timeout), or its producer was replaced since the claim: nothing of it
    is visible; the broker answers, so its rows are retried at once, without the outage pause."""


class TransactionalDelivery:
    """One claim in one transaction: one part, the final one, once the transaction ended. If
    its outcome is unknown no row is in it (a partial settle would release their keys): the
    claim stays leased, and the takeover that follows its expiry reads the progress."""

    def __init__(self, publisher: TransactionalPublisher, records: Sequence[OutboxRecord]) -> None:
        self.records = list(records)  # grows by the rows a takeover adopts (see adopt)
        self.parked = False
        self.settled: set[int] = set()
        self.tag = uuid.uuid4().hex  # this batch in progress records
        self.sent: list[int] = []  # ids in the transaction, for the progress record
        self.begun = False  # a transaction of it was begun: unknown rows may be in Kafka
        self.committed = False
        # The producer when the claim was made: one that replaced it (this dispatcher was
        # fenced, as by a takeover of a hung owner) never sends the claim (see _send_and_commit).
        self.producer = publisher.producers.current()
        self._publisher = publisher
        self._outcomes: list[BaseException | None] = [UNKNOWN] * len(records)

    def __aiter__(self) -> AsyncGenerator[Part, None]:
        return self._parts()

    async def _parts(self) -> AsyncGenerator[Part, None]:
        await self._publisher.transact(self)
        yield self.final_part()

    def final_part(self) -> Part:
        known = [] if self.undecided() else list(range(len(self.records)))
        self.settled.update(known)
        return Part(known, [self._outcomes[i] for i in known], final=True)

    def decide(self, indices: Sequence[int], outcome: BaseException | None) -> None:
        for i in indices:
            self._outcomes[i] = outcome

    def adopt(self, rows: Sequence[OutboxRecord]) -> None:
        """Rows of this claim's keys that a lost claim committed beyond its batch: settled with
        it, published (its settle marks any row of a key its lease holds)."""
        self.records.extend(rows)
        self._outcomes.extend([None] * len(rows))

    def undecided(self) -> list[int]:
        return [i for i, o in enumerate(self._outcomes) if o is UNKNOWN]

    def outcomes(self, *, stopped: BaseException) -> list[BaseException | None]:
        """At a shutdown cancel: what is decided; the rest `stopped` (see unsettled)."""
        return [stopped if o is UNKNOWN else o for o in self._outcomes]

    def unsettled(self) -> list[int]:
        """The rows a shutdown cancel may settle: none while a begun transaction's outcome is
        unknown (they stay leased), else every row not settled yet."""
        if self.begun and self.undecided():
            return []
        return [i for i in range(len(self.records)) if i not in self.settled]


class TransactionalPublisher:
    """KafkaPublisher's face for exactly-once: one transactional producer, one transaction at a
    time; `others` names the dispatchers a takeover fences (the live ones of the table)."""

    def __init__(
        self,
        config: PublisherConfig,
        progress_config: ProgressConfig,
        owner: str,
        others: _AnyOwners,
        pending: _PendingRows,
    ) -> None:
        self.owner = owner
        self.transactional_id = progress_config.transactional_id(owner)
        self._progress = progress_config
        producer = dataclasses.replace(
            config.producer,
            transactional_id=self.transactional_id,
            transaction_timeout_seconds=progress_config.timeout_seconds,
        )
        self._producer_config = producer
        self._connection = producer.connection
        self.producers = Producers(producer)
        self.topics = TopicLookup(self.producers, config.topics)
        self._encoder = RecordEncoder(config.records)
        self._tracer = Tracer(config.tracing)
        self._ack_seconds = producer.connection.request_timeout_seconds
        self._others = others
        self._pending = pending
        self._turn = asyncio.Lock()  # one transaction at a time: one producer
        self.unmarked: dict[str, list[int]] = {}  # tag: ids committed, not seen marked

    async def start(self) -> None:
        """Start the producer (its first transaction fences an earlier one of this id) and
        create the progress topic if it is missing."""
        internals.quicken_transaction_retries()
        await self.producers.start()
        try:
            await progress.ensure_topic(self._connection, self._progress.topic)
        except KAFKA_TROUBLE as exc:
            await self.producers.stop()
            raise errors.BrokerUnavailableError(errors.describe(exc)) from exc

    async def stop(self) -> None:
        await self.producers.stop()

    def publish(
        self, records: Sequence[OutboxRecord], heartbeat: Callable[[], None] = lambda: None
    ) -> TransactionalDelivery:
        return TransactionalDelivery(self, records)

    async def abandon(self, delivery: TransactionalDelivery, reason: str) -> None:
        """A shutdown past its grace: close the producer within the bound; an open transaction
        is then aborted by the broker (never committed), its rows stay leased."""
        await self.producers.close_bounded([self.producers.current()], reason)

    async def reachable(self, seconds: float = 5.0) -> bool:
        return await self.topics.reachable(seconds)

    def marked(self, delivery: TransactionalDelivery, *, every_row: bool) -> None:
        """The batch's mark is in the database: later progress records leave it out (only when
        it changed every row: a row another claim took over may be that claim's to reconcile)."""
        if every_row:
            self.unmarked.pop(delivery.tag, None)

    async def transact(self, d: TransactionalDelivery) -> None:
        """Decide every row of the delivery: published (in its transaction, or by a lost claim),
        failed, or unknown."""
        async with self._turn:
            try:
                await self._reconcile(d)
            except ProgressUnavailableError as exc:
                log.warning("takeover_waits_for_progress", rows=len(d.records), error=str(exc))
                return  # every row unknown: leased until a takeover can read the progress
            await self._send_and_commit(d)

    async def _reconcile(self, d: TransactionalDelivery) -> None:
        """Rows taken over from a lost claim: those it committed are published already, and so
        are its committed rows of the same keys that did not fit in this batch (the takeover's
        room is its batch size): adopted, so that the key is not released with them pending."""
        reclaimed = {r.id for r in d.records if r.reclaimed}
        if not reclaimed:
            return
        committed = await self.committed_elsewhere()
        done = reclaimed & committed
        d.decide([i for i, r in enumerate(d.records) if r.id in done], None)
        keys = {r.ordering_key for r in d.records if r.reclaimed and r.ordering_key is not None}
        beyond = sorted(committed - {r.id for r in d.records})
        if keys and beyond:
            try:
                rows = [r for r in await self._pending(beyond) if r.ordering_key in keys]
            except Exception as exc:  # the database is away: the rows wait
                raise ProgressUnavailableError(errors.describe(exc)) from exc
            d.adopt(rows)
            done |= {r.id for r in rows}
        if done:
            log.info("takeover_found_committed", rows=len(done), reclaimed=len(reclaimed))

    async def committed_elsewhere(self) -> set[int]:
        """The ids of every committed transaction not seen marked: every other dispatcher's id
        fenced first, then the progress read to its end (this dispatcher's own from memory)."""
        try:
            listed = await self._others()
        except Exception as exc:  # the database is away: the rows wait
            raise ProgressUnavailableError(errors.describe(exc)) from exc
        try:
            owners = [o for o in listed if o != self.owner]
            limit = asyncio.Semaphore(FENCES_AT_ONCE)

            async def fence(owner: str) -> None:
                async with limit:
                    tid = self._progress.transactional_id(owner)
                    await progress.fence(self._producer_config, tid)

            await asyncio.gather(*(fence(o) for o in owners))
            values = await self.read_progress()
        except KAFKA_TROUBLE as exc:
            raise ProgressUnavailableError(errors.describe(exc)) from exc
        mine = {i for ids in self.unmarked.values() for i in ids}
        return mine | progress.committed_ids(self._progress, values)

    async def read_progress(self) -> list[bytes | None]:
        """The progress topic's committed records (its partitions as the producer knows them)."""
        topic = self._progress.topic
        partitions = await self.producers.current().partitions_for(topic)
        return await progress.read_committed(
            self._connection, topic, partitions, max(self._ack_seconds, 10.0)
        )

    async def _send_and_commit(self, d: TransactionalDelivery) -> None:
        try:
            await self.producers.replace_if_broken()  # first: a fresh producer knows no topic
        except errors.BrokerUnavailableError as exc:
            d.decide(d.undecided(), TransactionAbortedError(errors.describe(exc)))
            return
        indices = d.undecided()
        if not indices:
            return
        if self.producers.current() is not d.producer:
            # Replaced since the claim (fenced, or its state lost): the lease may have expired
            # meanwhile and another claim sent the rows; given back, never sent by this one.
            d.decide(indices, TransactionFencedError(REPLACED))
            return
        topics = [self._encoder.topic(r) for r in d.records]
        named = {t for i in indices if isinstance(t := topics[i], str)}
        problems = await self.topics.errors_for(named) if named else {}
        batches = Batches(
            d.records,
            topics,
            encoder=self._encoder,
            producers=self.producers,
            lookup=self.topics,
            tracer=self._tracer,
        )
        producer = self.producers.current()
        try:
            d.begun = True
            await producer.begin_transaction()
        except KAFKA_TROUBLE as exc:
            self.producers.condemn(exc)
            d.decide(indices, TransactionAbortedError(errors.describe(exc)))
            return
        answers: list[Answer] = [None] * len(d.records)
        failure = await self._send_all(d, batches, indices, answers, problems)
        # Refused before sending (no topic, a topic missing, too large; the later rows of
        # their keys not attempted): decided with their error, never in the transaction.
        refused = {i: a for i in indices if isinstance(a := answers[i], BaseException)}
        for i, refusal in refused.items():
            d.decide([i], refusal)
        sent = [i for i in indices if i not in refused]
        if failure is not None or not sent:
            failed_at, cause = failure or (None, NOTHING_SENT)
            await self._abort(d, sent, failed_at, cause)
            return
        await self._commit(d, sent)

    async def _send_all(
        self,
        d: TransactionalDelivery,
        batches: Batches,
        indices: list[int],
        answers: list[Answer],
        problems: dict[str, BaseException],
    ) -> tuple[int | None, BaseException] | None:
        """Hand every record to the producer as batches (kafka/batches.py) and the progress
        record after them, then wait for all the acks at once: the first failure (the row's
        index, None for the progress record; the error), or None. No waves: nothing of the
        transaction is visible before its commit, so a key's change of topic needs no ack first,
        and a failed batch aborts the whole transaction (no gap can follow it)."""
        batches.encode(indices)
        failed_keys: set[str] = set()
        pending = indices
        while pending:
            deferred = set(batches.send(pending, answers, failed_keys, problems))
            if len(deferred) == len(pending):  # not one fits an empty batch: never happens
                return pending[0], errors.UnpublishableRowError("no producer batch takes it")
            pending = [i for i in pending if i in deferred]
        handed = [i for i in indices if isinstance(answers[i], asyncio.Future)]
        d.sent = [d.records[i].id for i in handed]
        submissions: list[asyncio.Future[object]] = [
            a for a in dict.fromkeys(answers[i] for i in handed) if isinstance(a, asyncio.Future)
        ]
        value = progress.record_value(self._progress, self.owner, {**self.unmarked, d.tag: d.sent})
        try:
            acked = await self.producers.current().send(
                self._progress.topic, value, key=self.transactional_id.encode()
            )
        except KAFKA_TROUBLE as exc:
            await asyncio.gather(*submissions, return_exceptions=True)  # their answers, read
            return None, exc
        results: list[object] = await asyncio.gather(acked, *submissions, return_exceptions=True)
        if isinstance(results[0], BaseException):
            return None, results[0]
        for submission, result in zip(submissions, results[1:], strict=True):
            if isinstance(result, BaseException):
                cause = result.cause if isinstance(result, NotSubmitted) else result
                return next(i for i in handed if answers[i] is submission), cause
        return None

    async def _abort(
        self,
        d: TransactionalDelivery,
        indices: list[int],
        failed_at: int | None,
        cause: BaseException,
    ) -> None:
        """Nothing of the transaction is committed (it never asked to be): the failed row gets
        its error, the others are retried uncounted. A fenced producer is past aborting (the
        fence aborted it): it is replaced."""
        if _is_fencing(cause):
            internals.read_fatal_error(self.producers.current())
            self.producers.condemn(cause)
            # Now, not at the next batch: claims made from here on are the fresh producer's.
            with contextlib.suppress(errors.BrokerUnavailableError):
                await self.producers.replace_if_broken()
        else:
            try:
                async with asyncio.timeout(self._progress.timeout_seconds):
                    await self.producers.current().abort_transaction()
            except KAFKA_TROUBLE as exc:
                # The broker is away: the successor's start aborts it (or the broker's timeout).
                self.producers.condemn(exc)
        d.sent.clear()
        aborted = TransactionFencedError if _is_fencing(cause) else TransactionAbortedError
        d.decide(indices, aborted(errors.describe(cause)))
        if failed_at is not None and not _is_fencing(cause):
            d.decide([failed_at], cause)  # its own error: classified as any publish failure

    async def _commit(self, d: TransactionalDelivery, indices: list[int]) -> None:
        try:
            async with asyncio.timeout(self._progress.timeout_seconds):
                await self.producers.current().commit_transaction()
        except (*KAFKA_TROUBLE, asyncio.CancelledError) as exc:
            self.producers.condemn(exc if isinstance(exc, Exception) else UNKNOWN)
            log.warning("commit_unknown", rows=len(d.sent), error=errors.describe(exc))
            if isinstance(exc, asyncio.CancelledError):
                raise  # left unknown, leased: the next takeover reads the progress
            await self._resolve(d, indices)
            return
        self.unmarked[d.tag] = list(d.sent)
        d.committed = True
        d.decide(indices, None)

    async def _resolve(self, d: TransactionalDelivery, indices: list[int]) -> None:
        """A commit without an answer: a fresh producer under the id ends the transaction (its
        start waits for the commit in progress), then the progress says which way it went."""
        try:
            await self.producers.replace_if_broken()
            async with asyncio.timeout(self._progress.timeout_seconds):
                producer = self.producers.current()
                await producer.begin_transaction()
                await producer.abort_transaction()
            values = await self.read_progress()
        except (*KAFKA_TROUBLE, errors.BrokerUnavailableError) as exc:
            log.warning("commit_outcome_unread", rows=len(d.sent), error=errors.describe(exc))
            return  # unknown: the rows stay leased for a takeover to decide
        mine = progress.last_batches(self._progress, values).get(self.owner, {})
        if d.tag in mine:
            self.unmarked[d.tag] = list(d.sent)
            d.committed = True
            d.decide(indices, None)
        else:
            d.decide(indices, TransactionAbortedError("the commit did not take"))


def _is_fencing(exc: BaseException) -> bool:
    """The producer is past its transaction: its state lost (failures.PRODUCER_STATE, a fence
    among them), or aiokafka refusing a producer a fatal error ended."""
    return failures.is_producer_state(exc) or isinstance(exc, kafka_errors.IllegalOperation)
