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
from outbox_dispatcher.kafka import failures, internals, lanes, progress
from outbox_dispatcher.kafka.batches import Answer, Batches
from outbox_dispatcher.kafka.lanes import Lane
from outbox_dispatcher.kafka.producers import NotSubmitted
from outbox_dispatcher.kafka.progress import ProgressConfig, ProgressUnavailableError
from outbox_dispatcher.kafka.publisher import PublisherConfig
from outbox_dispatcher.kafka.records import RecordEncoder
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

    def __init__(
        self, publisher: TransactionalPublisher, lane: Lane, records: Sequence[OutboxRecord]
    ) -> None:
        self.lane = lane  # its producer, chosen at the claim (kafka/lanes.py)
        lane.given.add(self)
        self.records = list(records)  # grows by the rows a takeover adopts (see adopt)
        self.parked = False
        self.settled: set[int] = set()
        self.tag = uuid.uuid4().hex  # this batch in progress records
        self.sent: list[int] = []  # ids in the transaction, for the progress record
        self.begun = False  # a transaction of it was begun: unknown rows may be in Kafka
        self.committed = False
        # The producer when the claim was made: one that replaced it (this dispatcher was
        # fenced, as by a takeover of a hung owner) never sends the claim (see _send_and_commit).
        self.producer = lane.producers.current()
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
    """KafkaPublisher's face for exactly-once: a transactional producer per lane (up to one per
    claim loop), one transaction at a time on each; `others` names the dispatchers a takeover
    fences (the live ones of the table)."""

    def __init__(
        self,
        config: PublisherConfig,
        progress_config: ProgressConfig,
        owner: str,
        others: _AnyOwners,
        pending: _PendingRows,
        lane_count: int = lanes.LANES,
    ) -> None:
        self.owner = owner
        self._progress = progress_config
        # No linger: a transaction's records are all handed at once and its commit waits for
        # them; only the progress record (send(), not a closed batch) would linger.
        producer = dataclasses.replace(
            config.producer,
            transaction_timeout_seconds=progress_config.timeout_seconds,
            linger_ms=0,
        )
        self._producer_config = producer
        self._connection = producer.connection
        self.lanes = lanes.lanes_for(owner, lane_count, producer, progress_config, config.topics)
        self.topics = self.lanes[0].topics  # for reachable() and the operator's check
        self._encoder = RecordEncoder(config.records)
        self._tracer = Tracer(config.tracing)
        self._ack_seconds = producer.connection.request_timeout_seconds
        self._others = others
        self._pending = pending

    @property
    def unmarked(self) -> dict[str, list[int]]:
        """Every lane's batches committed and not seen marked (tag: ids)."""
        return {tag: ids for lane in self.lanes for tag, ids in lane.unmarked.items()}

    async def start(self) -> None:
        """Start the lanes' producers (the first transaction of each fences an earlier one of
        its id) and create the progress topic if it is missing."""
        internals.quicken_transaction_retries()
        started: list[Lane] = []
        try:
            for lane in self.lanes:
                await lane.producers.start()
                started.append(lane)
            await progress.ensure_topic(self._connection, self._progress.topic)
        except BaseException as exc:
            for lane in started:
                await lane.producers.stop()
            if isinstance(exc, KAFKA_TROUBLE):
                raise errors.BrokerUnavailableError(errors.describe(exc)) from exc
            raise

    async def stop(self) -> None:
        for lane in self.lanes:
            await lane.producers.stop()

    def publish(
        self, records: Sequence[OutboxRecord], heartbeat: Callable[[], None] = lambda: None
    ) -> TransactionalDelivery:
        return TransactionalDelivery(self, lanes.least_busy(self.lanes), records)

    async def abandon(self, delivery: TransactionalDelivery, reason: str) -> None:
        """A shutdown past its grace: close the lane's producer within the bound; an open
        transaction is then aborted by the broker (never committed), its rows stay leased."""
        producers = delivery.lane.producers
        await producers.close_bounded([producers.current()], reason)

    async def reachable(self, seconds: float = 5.0) -> bool:
        return await self.topics.reachable(seconds)

    def marked(self, delivery: TransactionalDelivery, *, every_row: bool) -> None:
        """The batch's mark is in the database: later progress records leave it out (only when
        it changed every row: a row another claim took over may be that claim's to reconcile)."""
        if every_row:
            delivery.lane.unmarked.pop(delivery.tag, None)

    async def transact(self, d: TransactionalDelivery) -> None:
        """Decide every row of the delivery: published (in its transaction, or by a lost claim),
        failed, or unknown. A takeover holds every lane's turn (in lane order: no deadlock), so
        that no transaction of this dispatcher is open while it reads what was committed."""
        takeover = any(r.reclaimed for r in d.records)
        try:
            async with contextlib.AsyncExitStack() as turns:
                for lane in self.lanes if takeover else [d.lane]:
                    await turns.enter_async_context(lane.turn)
                d.lane.given.discard(d)
                try:
                    await self._reconcile(d)
                except ProgressUnavailableError as exc:
                    log.warning("takeover_waits_for_progress", rows=len(d.records), error=str(exc))
                    return  # every row unknown: leased until a takeover can read the progress
                await self._send_and_commit(d)
        finally:
            d.lane.given.discard(d)

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
        """The ids of every committed transaction not seen marked: every lane id of every other
        dispatcher fenced first, and this one's lanes whose commit went unanswered replaced (a
        fresh producer ends it), then the progress read to its end (the rest of this one's from
        memory). Called holding every lane's turn."""
        try:
            listed = await self._others()
        except Exception as exc:  # the database is away: the rows wait
            raise ProgressUnavailableError(errors.describe(exc)) from exc
        try:
            tids = lanes.fence_ids(self._progress, [o for o in listed if o != self.owner])
            limit = asyncio.Semaphore(FENCES_AT_ONCE)

            async def fence(tid: str) -> None:
                async with limit:
                    await progress.fence(self._producer_config, tid)

            await asyncio.gather(*(fence(t) for t in tids))
            for lane in self.lanes:
                await lane.producers.replace_if_broken()
            values = await self.read_progress()
        except (*KAFKA_TROUBLE, errors.BrokerUnavailableError) as exc:
            raise ProgressUnavailableError(errors.describe(exc)) from exc
        mine = {i for ids in self.unmarked.values() for i in ids}
        return mine | progress.committed_ids(self._progress, values)

    async def read_progress(self) -> list[bytes | None]:
        """The progress topic's committed records (its partitions as the producer knows them)."""
        topic = self._progress.topic
        partitions = await self.lanes[0].producers.current().partitions_for(topic)
        return await progress.read_committed(
            self._connection, topic, partitions, max(self._ack_seconds, 10.0)
        )

    async def _send_and_commit(self, d: TransactionalDelivery) -> None:
        try:
            await d.lane.producers.replace_if_broken()  # first: a fresh producer knows no topic
        except errors.BrokerUnavailableError as exc:
            d.decide(d.undecided(), TransactionAbortedError(errors.describe(exc)))
            return
        indices = d.undecided()
        if not indices:
            return
        if d.lane.producers.current() is not d.producer:
            # Replaced since the claim (fenced, or its state lost): the lease may have expired
            # meanwhile and another claim sent the rows; given back, never sent by this one.
            d.decide(indices, TransactionFencedError(REPLACED))
            return
        topics = [self._encoder.topic(r) for r in d.records]
        named = {t for i in indices if isinstance(t := topics[i], str)}
        problems = await d.lane.topics.errors_for(named) if named else {}
        batches = Batches(
            d.records,
            topics,
            encoder=self._encoder,
            producers=d.lane.producers,
            lookup=d.lane.topics,
            tracer=self._tracer,
        )
        producer = d.lane.producers.current()
        try:
            d.begun = True
            await producer.begin_transaction()
        except KAFKA_TROUBLE as exc:
            d.lane.producers.condemn(exc)
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
        listed = {**d.lane.unmarked, d.tag: d.sent}  # the lane's own: its record is keyed by its id
        value = progress.record_value(self._progress, d.lane.name, listed)
        try:
            acked = await d.lane.producers.current().send(
                self._progress.topic, value, key=d.lane.transactional_id.encode()
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
        producers = d.lane.producers
        fenced = _is_fencing(cause)
        if fenced:
            internals.read_fatal_error(producers.current())
            producers.condemn(cause)
            # Now, not at the next batch: claims made from here on are the fresh producer's.
            with contextlib.suppress(errors.BrokerUnavailableError):
                await producers.replace_if_broken()
        else:
            try:
                async with asyncio.timeout(self._progress.timeout_seconds):
                    await producers.current().abort_transaction()
            except KAFKA_TROUBLE as exc:
                # The broker is away: the successor's start aborts it (or the broker's timeout).
                producers.condemn(exc)
        d.sent.clear()
        aborted = TransactionFencedError if fenced else TransactionAbortedError
        d.decide(indices, aborted(errors.describe(cause)))
        if failed_at is not None and not fenced:
            d.decide([failed_at], cause)  # its own error: classified as any publish failure

    async def _commit(self, d: TransactionalDelivery, indices: list[int]) -> None:
        try:
            async with asyncio.timeout(self._progress.timeout_seconds):
                await d.lane.producers.current().commit_transaction()
        except (*KAFKA_TROUBLE, asyncio.CancelledError) as exc:
            d.lane.producers.condemn(exc if isinstance(exc, Exception) else UNKNOWN)
            log.warning("commit_unknown", rows=len(d.sent), error=errors.describe(exc))
            if isinstance(exc, asyncio.CancelledError):
                raise  # left unknown, leased: the next takeover reads the progress
            await self._resolve(d, indices)
            return
        d.lane.unmarked[d.tag] = list(d.sent)
        d.committed = True
        d.decide(indices, None)

    async def _resolve(self, d: TransactionalDelivery, indices: list[int]) -> None:
        """A commit without an answer: a fresh producer under the id ends the transaction (its
        start waits for the commit in progress), then the progress says which way it went."""
        try:
            await d.lane.producers.replace_if_broken()
            async with asyncio.timeout(self._progress.timeout_seconds):
                producer = d.lane.producers.current()
                await producer.begin_transaction()
                await producer.abort_transaction()
            values = await self.read_progress()
        except (*KAFKA_TROUBLE, errors.BrokerUnavailableError) as exc:
            log.warning("commit_outcome_unread", rows=len(d.sent), error=errors.describe(exc))
            return  # unknown: the rows stay leased for a takeover to decide
        mine = progress.last_batches(self._progress, values).get(d.lane.name, {})
        if d.tag in mine:
            d.lane.unmarked[d.tag] = list(d.sent)
            d.committed = True
            d.decide(indices, None)
        else:
            d.decide(indices, TransactionAbortedError("the commit did not take"))


def _is_fencing(exc: BaseException) -> bool:
    """The producer is past its transaction: its state lost (failures.PRODUCER_STATE, a fence
    among them), or aiokafka refusing a producer a fatal error ended."""
    return failures.is_producer_state(exc) or isinstance(exc, kafka_errors.IllegalOperation)
