"""Exactly-once publication (OUTBOX_DELIVERY=exactly-once; docs/design/exactly-once.md).

A claim's records go out in one Kafka transaction, ended by the lane's progress record
(progress.py), under the lane's transactional id (lanes.py); its rows are marked only once the
transaction committed. A claim that took rows over from a lost claim is reconciled first
(takeover.py). A commit whose outcome is unknown is settled by the progress once the producer
is replaced (its successor's start ends the transaction), and if that cannot be read the rows
stay leased, unsettled, for the next takeover to decide. A transaction whose records are not
all acknowledged in time is given up: its lane goes on under a new id, and the partitions that
did not acknowledge are held (stalls.py). How a transaction ends: endings.py. What the records
list, and the tombstones that end keys: retirement.py. (Module names: kafka/exactly_once/.)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence

import structlog
from aiokafka import errors as kafka_errors

from outbox_dispatcher import errors
from outbox_dispatcher.kafka import failures, internals
from outbox_dispatcher.kafka.batches import Answer, Batches
from outbox_dispatcher.kafka.exactly_once import lanes, progress, replicas
from outbox_dispatcher.kafka.exactly_once import topic as progress_topic
from outbox_dispatcher.kafka.exactly_once.delivery import (
    OutboxTruncatedError,
    TransactionAbortedError,
    TransactionalDelivery,
    TransactionFencedError,
)
from outbox_dispatcher.kafka.exactly_once.endings import (
    Endings,
    Stall,
    answered_within,
    cause_of,
    failure_of,
)
from outbox_dispatcher.kafka.exactly_once.orphans import Orphans
from outbox_dispatcher.kafka.exactly_once.phases import Phases
from outbox_dispatcher.kafka.exactly_once.progress import (
    Pair,
    ProgressConfig,
    ProgressEndUnreachedError,
    ProgressUnavailableError,
)
from outbox_dispatcher.kafka.exactly_once.retirement import Retirement
from outbox_dispatcher.kafka.exactly_once.stalls import Holds
from outbox_dispatcher.kafka.exactly_once.store import ProgressStore
from outbox_dispatcher.kafka.exactly_once.takeover import (
    KAFKA_TROUBLE,
    FenceFailedError,
    Takeover,
    TakeoverWaitingError,
)
from outbox_dispatcher.kafka.publisher import PublisherConfig
from outbox_dispatcher.kafka.records import RecordEncoder
from outbox_dispatcher.kafka.topics import ClaimLookups
from outbox_dispatcher.models import OutboxRecord, Part
from outbox_dispatcher.tracing import Tracer

log = structlog.get_logger(__name__)

NOTHING_SENT = errors.NotAttempted("nothing of the batch could be sent")
REPLACED = "the producer was replaced after the claim began: its rows are given back, not sent"
EARLIER_UNKNOWN = "an earlier commit of its lane is unknown until the progress topic can be read"
# Rows remembered to go alone at most (a safety bound: each is forgotten once it is decided).
ALONE_AT_MOST = 10_000
# A transaction's acks are waited for this share of its timeout at most (publish_timeout less).
STALL_SHARE_OF_TIMEOUT = 0.8


class TransactionalPublisher:
    """KafkaPublisher's face for exactly-once: a transactional producer per lane (up to one per
    claim loop), one transaction at a time on each; `store`: what it asks of the outbox table
    (its registry records this dispatcher's ids and names the others', which a takeover
    fences)."""

    def __init__(
        self,
        config: PublisherConfig,
        progress_config: ProgressConfig,
        owner: str,
        store: ProgressStore,
        identity: str,
        lane_count: int = lanes.LANES,
        renewed: Callable[[str], None] = lambda reason: None,
        waiting: Callable[[str], None] = lambda reason: None,
        fence_failed: Callable[[], None] = lambda: None,
    ) -> None:
        self.owner = owner
        self._progress = progress_config
        # A takeover that could not fence a lost owner or read the progress (a metric).
        self._waiting = waiting
        self._store = store
        # No linger: a transaction's records are all handed at once and its commit waits for
        # them; only the progress record (send(), not a closed batch) would linger.
        producer = dataclasses.replace(
            config.producer,
            transaction_timeout_seconds=progress_config.timeout_seconds,
            linger_ms=0,
        )
        self.lanes = lanes.Lanes(owner, lane_count, producer, progress_config, config.topics, store)
        self._connection = producer.connection
        self._max_request_bytes = producer.max_request_bytes
        fence_seconds = max(progress_config.timeout_seconds, 10.0)
        self.retire = Retirement(store.needed, store.beating, identity)
        self._takeover = Takeover(
            progress_config,
            producer,
            owner,
            store,
            fence_seconds,
            self.retire,
            fence_failed,
        )
        # The keys dead dispatchers left in the progress topic (swept by the supervisor).
        self.orphans = Orphans(progress_config, producer, store, self._takeover, self.lanes)
        self._encoder = RecordEncoder(config.records)
        self._tracer = Tracer(config.tracing)
        # How long a transaction's acks are waited for before it is given up (stalls.py):
        # before the broker's own timeout aborts it, whose fence would leave the id waiting
        # for the markers of a partition that does not take them.
        self.stall_seconds = min(
            config.delivery.publish_timeout_seconds,
            STALL_SHARE_OF_TIMEOUT * progress_config.timeout_seconds,
        )
        self.holds = Holds()
        # Rows of a producer batch the broker refused whole: each goes alone next (Batches).
        self._alone: set[int] = set()
        self._ends = Endings(
            self.lanes,
            self.holds,
            progress_config,
            self._takeover,
            self.stall_seconds,
            renewed,
            replicas.checker(self._connection),
        )

    def current_identity(self) -> str:
        """The outbox's identity as this dispatcher knows it now (retirement reads it again)."""
        return self.retire.identity

    @property
    def unmarked(self) -> dict[str, list[Pair]]:
        """Every lane's batches committed and not seen marked (tag: (id, replays) pairs)."""
        return {tag: ids for lane in self.lanes for tag, ids in lane.unmarked.items()}

    async def start(self, *, check_topic: bool = True) -> None:
        """Record the lanes' ids, start their producers (the first transaction of each fences an
        earlier one of its id) and create the progress topic if it is missing (`check_topic`:
        false when the process checked it a moment ago: fleet_delivery.TopicChecks)."""
        internals.quicken_transaction_retries()
        await self.lanes.start()
        if not check_topic:
            return
        try:
            topic = self._progress.topic
            await progress_topic.ensure(self._connection, topic, self._store.unsettled)
        except BaseException as exc:
            await self.lanes.stop()
            if isinstance(exc, KAFKA_TROUBLE):
                raise errors.BrokerUnavailableError(errors.describe(exc)) from exc
            raise

    async def stop(self) -> None:
        """A graceful stop: each lane tombstones its id once nothing its records list is
        needed (retirement.py), within the transaction timeout; then the
        producers stop."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self._progress.timeout_seconds):
                await self.retire.farewell(self.lanes, self._progress.topic)
        await self.lanes.stop()

    def publish(
        self,
        records: Sequence[OutboxRecord],
        heartbeat: Callable[[], None] = lambda: None,
        claimed_at: float | None = None,
    ) -> TransactionalDelivery:
        """The claim's delivery; `claimed_at`: when the claim began (the loop's clock), by
        default now."""
        now = asyncio.get_running_loop().time()
        began = now if claimed_at is None else claimed_at
        phases = Phases(time.monotonic() - (now - began))  # (the loop's clock may be coarse)
        phases.lap("claim")
        return TransactionalDelivery(self, self.lanes.least_busy(), records, began, phases)

    async def abandon(self, delivery: TransactionalDelivery, reason: str) -> None:
        """A shutdown past its grace: close the lane's producer within the bound; an open
        transaction is then aborted by the broker (never committed), its rows stay leased."""
        producers = delivery.lane.producers
        with contextlib.suppress(errors.OutboxDispatcherError):  # a lane not started again
            await producers.close_bounded([producers.current()], reason)

    async def reachable(self, seconds: float = 5.0) -> bool:
        """A broker answers a lane's producer (one that serves: a lane that took a new id may
        not have started its producer yet)."""
        serving = [lane for lane in self.lanes if lane.producers.serving]
        return bool(serving) and await serving[0].topics.reachable(seconds)

    def marked(
        self, delivery: TransactionalDelivery, *, every_row: bool, final: bool = True
    ) -> None:
        """A part's mark is in the database: once the final one is, and every part's mark
        changed every row, later progress records leave the batch out (a row another claim
        took over may be that claim's to reconcile; a part whose mark failed keeps it listed:
        its rows' lease expires and the takeover reads the progress)."""
        delivery.marked(every_row=every_row, final=final)

    async def committed_of(self, pairs: Sequence[Pair], owners: Sequence[str] = ()) -> set[int]:
        """Which ids of these (id, replays) pairs a lost claim committed (review E13: rows the
        crash-loop reclaimer dead-letters; `owners`: the lost claims' owners, fenced strictly):
        read as a takeover reads, after fencing and holding every lane.
        ProgressUnavailableError when it cannot be read (nothing decided)."""
        await self._takeover.fence_others(owners=owners)
        async with contextlib.AsyncExitStack() as turns:
            for lane in self.lanes:
                await turns.enter_async_context(lane.turn)
            committed = set(pairs) & await self._takeover.committed(self.lanes)
            return {i for i, _ in committed}

    async def read_progress(self) -> list[progress.Record]:
        """The progress topic's committed records (tests and the operator read them too)."""
        return await self._takeover.read(self.lanes)

    async def parts(self, d: TransactionalDelivery) -> AsyncGenerator[Part, None]:
        """The claim's transactions: one for the rows whose topics are known, then one for the
        rows of the topics looked up, as their lookups answer (topics.ClaimLookups keeps a
        key's rows together), the rows of each transaction that ended settled before the next
        (an early part), so that a topic being looked up (one missing: a publish_timeout's
        wait) holds up only its own keys. A takeover goes in one transaction after its lookups:
        the rows it adopts settle with their keys."""
        everything = list(range(len(d.records)))
        if any(r.reclaimed for r in d.records) or not d.lane.producers.serving:
            await self.transact(d, everything, {})  # (a lane with a new id looks topics up anew)
            return
        lookups = ClaimLookups(d.lane.topics, d.records, self._encoder.topics(d.records))
        try:
            ready, later = lookups.split()
            while True:
                if ready:
                    await self.transact(d, ready, lookups.errors)
                    if d.undecided_of(ready):
                        return  # an outcome unknown: nothing more now (the rows stay leased)
                if not later:
                    return
                yield d.early_part(ready)
                ready = await lookups.ready(later)
                later = [i for i in later if i not in set(ready)]
        finally:
            lookups.cancel()

    async def transact(
        self, d: TransactionalDelivery, indices: list[int], known: Mapping[str, BaseException]
    ) -> None:
        """Decide the rows `indices` of the delivery: published (in one transaction, or by a
        lost claim), failed, or unknown; `known`: the topics already looked up and why each
        cannot be sent to. A takeover fences the other dispatchers first, then holds every
        lane's turn (in lane order: no deadlock), so that no transaction of this dispatcher is
        open while it reads what was committed."""
        takeover = any(d.records[i].reclaimed for i in indices)
        lap = d.phases.lap
        try:
            if takeover:
                await self._takeover.fence_others([d.records[i] for i in indices])
                lap("fence")
            async with contextlib.AsyncExitStack() as turns:
                for lane in self.lanes if takeover else [d.lane]:
                    await turns.enter_async_context(lane.turn)
                d.turn_taken()
                lap("turn")
                await self.retire.check(self.lanes)
                lap("retire")
                if takeover:
                    await self._takeover.reconcile(d, self.lanes)
                    lap("reconcile")
                await self._send_and_commit(d, indices, known)
            lap("after")
        except ProgressUnavailableError as exc:
            reason = "unread"
            if isinstance(exc, ProgressEndUnreachedError):
                reason = "end_unreached"
            elif isinstance(exc, FenceFailedError):
                reason = "unfenced"
            self._waiting(reason)
            log.warning(
                "takeover_waits_for_progress", rows=len(d.records), reason=reason, error=str(exc)
            )
            # Sent nothing: its rows go back, uncounted, after a wait (review E7). Their keys
            # keep the reconcile duty (a settle never clears it), so whoever claims them next
            # reads the progress first; and no attempt is counted for the wait: kept leased until
            # their lease expired, each try counted one, and a few rounds dead-lettered them as a
            # crash loop.
            d.give_back_unsent(TakeoverWaitingError(exc, self._takeover.fence_seconds))
        finally:
            d.turn_taken()

    async def _send_and_commit(
        self, d: TransactionalDelivery, rows: list[int], known: Mapping[str, BaseException]
    ) -> None:
        lane = d.lane
        indices = d.undecided_of(rows)
        if not indices:
            return
        try:
            await self.lanes.ready(lane)
            await lane.producers.replace_if_broken()  # first: a fresh producer knows no topic
        except (errors.BrokerUnavailableError, errors.DatabaseUnavailableError) as exc:
            d.decide(indices, TransactionAbortedError(errors.describe(exc)))
            return
        if not await self._ends.resolve_earlier(lane):
            d.decide(indices, TransactionAbortedError(EARLIER_UNKNOWN))
            return
        d.phases.lap("ready")
        if d.began_before(lane.producers.since):
            # Replaced since the claim began (fenced, or a new id): the lease may have expired
            # meanwhile and another claim sent the rows; given back, never sent by this one.
            d.decide(indices, TransactionFencedError(REPLACED))
            return
        topics = self._encoder.topics(d.records)
        named = {t for i in indices if isinstance(t := topics[i], str)} - known.keys()
        problems = dict(known) | (await lane.topics.errors_for(named) if named else {})
        d.phases.lap("lookup")
        batches = Batches(
            d.records,
            topics,
            encoder=self._encoder,
            producers=lane.producers,
            lookup=lane.topics,
            tracer=self._tracer,
            held=self.holds.why(lane),
            alone=self._alone,
        )
        try:
            await self._transaction(d, indices, batches, problems)
        finally:
            self.holds.ended(lane)  # what it probed and did not settle, another may probe
            self._alone.difference_update(d.finished())
            if len(self._alone) > ALONE_AT_MOST:  # never in practice: forget rather than grow
                self._alone.clear()

    async def _transaction(
        self,
        d: TransactionalDelivery,
        indices: list[int],
        batches: Batches,
        problems: dict[str, BaseException],
    ) -> None:
        lane = d.lane
        producer = lane.producers.current()
        try:
            d.begin(indices)
            if (dead := internals.sender_failure(producer)) is not None:  # since it was checked
                raise kafka_errors.KafkaError(errors.describe(dead)) from dead  # (a sender death)
            await producer.begin_transaction()
        except KAFKA_TROUBLE as exc:
            lane.producers.condemn(exc)
            d.aborted()
            d.decide(indices, TransactionAbortedError(errors.describe(exc)))
            return
        d.phases.lap("begin")
        answers: list[Answer] = [None] * len(d.records)
        failure = await self._send_all(d, batches, indices, answers, problems)
        # Refused before sending (no topic, a topic missing, too large, a partition held; the
        # later rows of their keys not attempted): decided with their error, never in the
        # transaction.
        refused = {i: a for i in indices if isinstance(a := answers[i], BaseException)}
        for i, refusal in refused.items():
            d.decide([i], refusal)
        sent = [i for i in indices if i not in refused]
        if isinstance(failure, Stall):
            await self._ends.give_up(d, sent, answers, batches, failure)
        elif failure is not None or not sent:
            failed_at, cause = failure or (None, NOTHING_SENT)
            if failed_at is not None and failures.is_rejection(cause):
                batch = [i for i in sent if answers[i] is answers[failed_at]]
                if len(batch) > 1:  # refused whole for one record: which, each alone will tell
                    self._alone.update(d.records[i].id for i in batch)
                    failed_at = None
            await self._ends.abort(d, sent, failed_at, cause)
        else:
            d.phases.lap("acks")
            if await self._ends.commit(d, sent):
                d.phases.lap("commit")
                self.holds.acknowledged(batches.where.values())
                self.retire.sent(d.tombstoned())

    async def _send_all(
        self,
        d: TransactionalDelivery,
        batches: Batches,
        indices: list[int],
        answers: list[Answer],
        problems: dict[str, BaseException],
    ) -> tuple[int | None, BaseException] | Stall | None:
        """Hand every record to the producer as batches (kafka/batches.py) and the progress
        record after them, then wait for all the acks at once (stall_seconds at most): the first
        failure (the row's index, None for the progress record; the error), the partitions that
        did not answer, or None. No waves: nothing of the transaction is visible before its
        commit, so a key's change of topic needs no ack first, and a failed batch aborts the
        whole transaction (no gap can follow it)."""
        if d.identity != self.retire.identity:  # a TRUNCATE seen since the claim (E5)
            return None, OutboxTruncatedError()  # nothing handed: no await from here to the hand
        too_large = self.retire.too_large(self._progress, d, indices, self._max_request_bytes)
        if too_large:
            return None, too_large  # before any record is handed: nothing to abort but the begin
        batches.encode(indices)
        failed_keys: set[str] = set()
        pending = indices
        while pending:
            deferred = set(batches.send(pending, answers, failed_keys, problems))
            if len(deferred) == len(pending):  # not one fits an empty batch: never happens
                return pending[0], errors.UnpublishableRowError("no producer batch takes it")
            pending = [i for i in pending if i in deferred]
        handed = [i for i in indices if isinstance(answers[i], asyncio.Future)]
        submissions: list[asyncio.Future[object]] = [
            a for a in dict.fromkeys(answers[i] for i in handed) if isinstance(a, asyncio.Future)
        ]
        lane = d.lane
        # The lane's own batches: keyed by its id.
        identity, ended = self.retire.identity, self.retire.to_send(self.lanes)
        listed = d.handed(handed, identity, ended)
        value = progress.record_value(self._progress, identity, lane.name, listed)
        key = lane.transactional_id.encode()
        try:
            producer = lane.producers.current()
            acked = await producer.send(self._progress.topic, value, key=key)
            tombstones = [
                await producer.send(self._progress.topic, None, key=k.encode()) for k in ended
            ]
        except KAFKA_TROUBLE as exc:
            # Their answers read before an abort (none of the epoch left in flight), within the
            # stall bound (review E15): a partition that keeps answering NotEnoughReplicas is
            # retried by aiokafka without end, and the lane's turn (every takeover's) with it.
            if unanswered := await answered_within(submissions, self.stall_seconds):
                stalled = {batches.where[s] for s in unanswered}
                return Stall(stalled, progress=False, unanswered=unanswered)
            return None, exc
        d.phases.lap("hand")
        waiting: set[asyncio.Future[object]] = {acked, *tombstones, *submissions}
        _, missing = await asyncio.wait(waiting, timeout=self.stall_seconds)
        if missing:
            stalled = {batches.where[s] for s in submissions if s in missing}
            return Stall(stalled, acked in missing, missing)
        # Every answer read (none left unretrieved); a batch the broker refused is the cause
        # rather than the batches of its partition refused after it for their sequence numbers.
        failed = [(s, cause_of(f)) for s in submissions if (f := failure_of(s)) is not None]
        for answer in (acked, *tombstones):
            if (problem := failure_of(answer)) is not None:
                return None, problem
        if not failed:
            return None
        submission, cause = min(failed, key=lambda found: not failures.is_rejection(found[1]))
        return next(i for i in handed if answers[i] is submission), cause
