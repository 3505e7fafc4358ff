"""How an exactly-once transaction ends (kafka/exactly_once/publisher.py sends it): committed, its
unknown commit resolved from the progress, aborted (the refused row blamed, a fenced lane given
a new id), or given up after waiting in vain for its acks (its lane given a new id, the
partitions that did not answer held: kafka/exactly_once/stalls.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog
from aiokafka import errors as kafka_errors

from outbox_dispatcher import errors
from outbox_dispatcher.kafka import failures, internals
from outbox_dispatcher.kafka.batches import Answer, Batches
from outbox_dispatcher.kafka.exactly_once import replicas
from outbox_dispatcher.kafka.exactly_once.delivery import (
    UNKNOWN,
    TransactionAbortedError,
    TransactionalDelivery,
    TransactionFencedError,
    TransactionRefusedError,
)
from outbox_dispatcher.kafka.exactly_once.lanes import Lane, Lanes
from outbox_dispatcher.kafka.exactly_once.progress import ProgressConfig
from outbox_dispatcher.kafka.exactly_once.replicas import ShortOfReplicas
from outbox_dispatcher.kafka.exactly_once.stalls import Holds, PartitionStalledError, TopicPartition
from outbox_dispatcher.kafka.exactly_once.takeover import KAFKA_TROUBLE, Takeover
from outbox_dispatcher.kafka.producers import NotSubmitted

log = structlog.get_logger(__name__)

STALLED = "did not acknowledge within {:g} s"


@dataclass
class Stall:
    """A transaction's records not all acknowledged in time: the partitions that did not
    answer (the progress record's own among them: `progress`)."""

    partitions: set[TopicPartition]
    progress: bool
    unanswered: set[asyncio.Future[object]]  # read once the given-up producer failed them


@dataclass(frozen=True)
class Endings:
    lanes: Lanes
    holds: Holds
    progress: ProgressConfig
    takeover: Takeover  # reads the progress
    stall_seconds: float  # how long acks were waited for (the reason's text)
    renewed: Callable[[str], None]  # a lane took a new id: stalled, fenced or abort_unanswered
    # Of the partitions that did not answer, those short of in-sync replicas (review E14).
    short: ShortOfReplicas = replicas.every_one_short

    async def give_up(
        self,
        d: TransactionalDelivery,
        indices: list[int],
        answers: list[Answer],
        batches: Batches,
        stall: Stall,
    ) -> None:
        """The transaction's records were not all acknowledged in time: it is given up (never
        committed), its lane goes on under a new id, and the partitions that did not answer and
        are short of in-sync replicas are held. Their rows wait for the hold; the others go
        again at once (or after the outage pause, when the progress topic itself did not
        answer), those of a partition with enough replicas saying the coordinator is likely at
        fault (review E14)."""
        where = STALLED.format(self.stall_seconds)
        names = sorted(f"{t}-{p}" for t, p in stall.partitions)
        short = await self.short(stall.partitions) if not stall.progress else set()
        healthy = stall.partitions - short if not stall.progress else set()
        log.warning(
            "transaction_stalled",
            lane=d.lane.name,
            partitions=names,
            seconds=self.stall_seconds,
            replicas_enough=sorted(f"{t}-{p}" for t, p in healthy),
        )
        held = self.holds.stalled(short) if short else 0.0
        coordinator = replicas.CoordinatorTroubleError(healthy, where) if healthy else None
        for i in indices:
            answer = answers[i]
            partition = batches.where.get(answer) if isinstance(answer, asyncio.Future) else None
            if stall.progress:
                outcome: BaseException = TransactionAbortedError(f"the progress topic {where}")
            elif partition is not None and partition in short:
                outcome = PartitionStalledError(partition, held, where)
            elif partition is not None and coordinator is not None and partition in healthy:
                outcome = coordinator
            else:
                outcome = TransactionFencedError(f"given up: partitions {', '.join(names)} {where}")
            d.decide([i], outcome)
        d.aborted()
        await self.lanes.renew(d.lane, f"partitions {', '.join(names)} {where}")
        self.renewed("stalled" if short or stall.progress else "coordinator")
        # The closed producer failed them; their errors read, none left unretrieved.
        _, left = await asyncio.wait(stall.unanswered, timeout=1.0)
        for answer in stall.unanswered - left:
            failure_of(answer)
        for answer in left:
            answer.cancel()

    async def abort(
        self,
        d: TransactionalDelivery,
        indices: list[int],
        failed_at: int | None,
        cause: BaseException,
    ) -> None:
        """Nothing of the transaction is committed (it never asked to be): the failed row gets
        its error, the others are retried uncounted. A fenced producer is past aborting (the
        fence aborted it); an abort without an answer may never end (its markers unwritable: a
        partition short of replicas). Either way the lane takes a new id (Lanes.renew): the old
        one never commits, and its replacement under the same id could wait for those
        markers."""
        producers = d.lane.producers
        # A producer whose sender died is past its transaction whatever failed the rows first.
        fenced = is_fencing(cause) or internals.sender_failure(producers.current()) is not None
        why = errors.describe(cause)
        ended = False
        if not fenced:
            try:
                async with asyncio.timeout(self.progress.timeout_seconds):
                    await producers.current().abort_transaction()
                ended = True
            except KAFKA_TROUBLE as exc:  # the broker is away, or the abort cannot end
                why = f"the abort went unanswered: {errors.describe(exc)}"
        if not ended:
            if fenced:
                internals.read_fatal_error(producers.current())
            await self.lanes.renew(d.lane, why)
            self.renewed("fenced" if fenced else "abort_unanswered")
        elif failures.is_rejection(cause):
            # The refused batch used up sequence numbers the broker never saw: the next
            # transaction starts a fresh producer (a new epoch under the same id).
            producers.condemn(cause)
        d.aborted()
        aborted: type[TransactionAbortedError] = TransactionAbortedError  # an outage: the pause
        if isinstance(cause, TransactionAbortedError):  # its own kind (a TRUNCATE seen: at once)
            aborted = type(cause)
        elif fenced:
            aborted = TransactionFencedError
        elif failures.is_rejection(cause):
            aborted = TransactionRefusedError
        d.decide(indices, aborted(errors.describe(cause)))
        if failed_at is not None and not fenced:
            d.decide([failed_at], cause)  # its own error: classified as any publish failure

    async def commit(self, d: TransactionalDelivery, indices: list[int]) -> bool:
        """Commit; whether it committed (an unknown outcome is resolved, or left unknown). A
        producer whose sender died after the acks never asked to commit: aborted (its lane
        renewed), as aiokafka would refuse the commit with an assertion."""
        if (dead := internals.sender_failure(d.lane.producers.current())) is not None:
            await self.abort(d, indices, None, dead)
            return False
        d.committing()
        try:
            async with asyncio.timeout(self.progress.timeout_seconds):
                await d.lane.producers.current().commit_transaction()
        except (*KAFKA_TROUBLE, asyncio.CancelledError) as exc:
            d.commit_unanswered()
            d.lane.producers.condemn(exc if isinstance(exc, Exception) else UNKNOWN)
            log.warning("commit_unknown", rows=len(indices), error=errors.describe(exc))
            if isinstance(exc, asyncio.CancelledError):
                raise  # left unknown, leased: the next takeover reads the progress
            return await self.resolve(d, indices)
        d.commit_answered(indices)
        return True

    async def resolve(self, d: TransactionalDelivery, indices: list[int]) -> bool:
        """A commit without an answer: a fresh producer under the id ends the transaction (its
        start waits for the commit in progress), then the progress says which way it went. If
        it cannot be read, the rows stay leased for a takeover to decide, and the lane keeps
        the commit to read again before it commits anything else (resolve_earlier)."""
        try:
            await d.lane.producers.replace_if_broken()
            async with asyncio.timeout(self.progress.timeout_seconds):
                producer = d.lane.producers.current()
                await producer.begin_transaction()
                await producer.abort_transaction()
            values = await self.takeover.read(self.lanes)
        except (*KAFKA_TROUBLE, errors.BrokerUnavailableError) as exc:
            log.warning("commit_outcome_unread", rows=len(indices), error=errors.describe(exc))
            d.lane.unresolved = (d, list(indices))
            return False
        d.lane.unresolved = None
        return d.resolve(indices, values, self.progress)

    async def resolve_earlier(self, lane: Lane) -> bool:
        """The lane's earlier commit whose outcome could not be read is read now, before the
        lane commits again; False while it still cannot be. A takeover reads only the last
        record of an id, and a lane's record lists only what it knows committed: a record
        committed meanwhile would hide a commit that stood, and a takeover would send its rows
        again (a broker restart under load: 20 rows twice to read_committed consumers)."""
        if lane.unresolved is None:
            return True
        d, indices = lane.unresolved
        committed = await self.resolve(d, indices)
        if lane.unresolved is None:
            log.info(
                "commit_outcome_read_late", lane=lane.name, rows=len(indices), committed=committed
            )
        return lane.unresolved is None


def failure_of(answer: asyncio.Future[object]) -> BaseException | None:
    """A done answer's failure (a cancelled one is not acknowledged either), or None."""
    if answer.cancelled():
        return asyncio.CancelledError("the request was cancelled")
    return answer.exception()


def cause_of(failure: BaseException) -> BaseException:
    """What failed a submission: send_batch's own error for one that never reached it."""
    return failure.cause if isinstance(failure, NotSubmitted) else failure


def is_fencing(exc: BaseException) -> bool:
    """The producer is past its transaction: its state lost (failures.PRODUCER_STATE, a fence
    among them) or its sender dead (failures.is_sender_death), or aiokafka refusing a producer
    a fatal error ended."""
    return failures.is_producer_state(exc) or isinstance(exc, kafka_errors.IllegalOperation)


async def answered_within(
    futures: Sequence[asyncio.Future[object]], seconds: float
) -> set[asyncio.Future[object]]:
    """Wait for every future's answer, `seconds` at most; those still unanswered then (an abort
    reads them first: none of the epoch left in flight)."""
    if not futures:
        return set()
    _, missing = await asyncio.wait(futures, timeout=seconds)
    return missing
