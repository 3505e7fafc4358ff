"""Exactly-once's takeover (docs/design/exactly-once.md): a claim that took rows over from a lost
claim first fences every transactional id the other dispatchers recorded, then, holding every
lane of its own dispatcher, reads the committed progress to its end; its rows a lost claim
committed are published already (marked, not sent again), and so are that claim's committed
rows of the same keys beyond this batch (adopted). If the progress cannot be read, nothing of
the batch is decided: its rows stay leased for the next takeover.

The duty to reconcile is durable (the key's work row keeps `reconcile_owner` from the claim that
found its lease expired): a claim returns a key's rows as reclaimed until a takeover read the
progress and cleared it (`Reconciling`), so a pause, a cancel or a lost claim reply in between
leaves the next claim of the key a takeover too.

Rows are matched by (id, replays) under the outbox's identity read from the database at each
takeover (issue 35, E5): a replayed row, or a row of a table truncated since, is sent again,
never marked from a stale record.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import structlog
from aiokafka import errors as kafka_errors

from outbox_dispatcher import errors
from outbox_dispatcher.kafka import lanes, progress, progress_topic
from outbox_dispatcher.kafka.lanes import Lane, Registry
from outbox_dispatcher.kafka.producers import ProducerConfig
from outbox_dispatcher.kafka.progress import (
    Pair,
    ProgressConfig,
    ProgressUnavailableError,
    Record,
)
from outbox_dispatcher.kafka.retirement import Retirement
from outbox_dispatcher.models import OutboxRecord, work_keys

log = structlog.get_logger(__name__)

# IllegalOperation: aiokafka refuses a send or a commit of a producer whose transaction a fatal
# error (a fence) ended.
KAFKA_TROUBLE = (kafka_errors.KafkaError, kafka_errors.IllegalOperation, OSError, TimeoutError)
FENCES_AT_ONCE = 8
# A transaction nobody fenced is aborted by the broker within its timeout plus the broker's sweep
# (transaction.abort.timed.out.transaction.cleanup.interval.ms, 10 s by default): a read of the
# progress waits that long for one open before the end it reads to.
END_MARGIN_SECONDS = 15.0


class Reconciled(Protocol):
    """What a takeover decides of a claim (kafka/transactions.TransactionalDelivery)."""

    records: list[OutboxRecord]

    def decide(self, indices: Sequence[int], outcome: BaseException | None) -> None: ...
    def adopt(self, rows: Sequence[OutboxRecord]) -> None: ...


# The rows of these (id, replays) pairs still pending, while the identity is still this one.
PendingRows = Callable[[list[Pair], str], Awaitable[Sequence[OutboxRecord]]]
# The keys (the work rows' keys: a row without one is keyed by its id) whose reconcile duty a
# takeover did, under this dispatcher's live leases (store.DispatchStore.reconciled).
Reconciling = Callable[[list[tuple[str, bool]]], Awaitable[object]]


@dataclass(frozen=True)
class Takeover:
    progress: ProgressConfig
    producer: ProducerConfig  # the lanes' (a fence starts one under another id)
    owner: str
    registry: Registry
    pending: PendingRows
    reconciled: Reconciling
    fence_seconds: float  # a fence that takes longer: the id's markers cannot be written yet
    retire: Retirement  # the outbox's identity; the keys read, tombstoned when done

    async def fence_others(self) -> None:
        """Fence every id another dispatcher may have a transaction open under: its open
        transaction is aborted (or its commit in progress finished) and its producer refused.
        Needs no lane of this dispatcher."""
        try:
            registered = await self.registry.live()
        except Exception as exc:  # the database is away: the rows wait
            raise ProgressUnavailableError(errors.describe(exc)) from exc
        limit = asyncio.Semaphore(FENCES_AT_ONCE)

        async def fence(tid: str) -> None:
            async with limit:
                await progress.fence(self.producer, tid, self.fence_seconds)

        try:
            await asyncio.gather(
                *(fence(t) for t in lanes.fence_ids(self.progress, registered, self.owner))
            )
        except (*KAFKA_TROUBLE, errors.BrokerUnavailableError) as exc:
            raise ProgressUnavailableError(errors.describe(exc)) from exc

    async def reconcile(self, d: Reconciled, own: Sequence[Lane]) -> None:
        """Rows taken over from a lost claim: those it committed are published already, and so
        are its committed rows of the same keys that did not fit in this batch (the takeover's
        room is its batch size): adopted, so that the key is not released with them pending.
        Called holding every lane's turn, after fence_others."""
        reclaimed = {r.pair for r in d.records if r.reclaimed}
        if not reclaimed:
            return
        committed = await self.committed(own)
        done = reclaimed & committed
        d.decide([i for i, r in enumerate(d.records) if r.pair in done], None)
        keys = {r.ordering_key for r in d.records if r.reclaimed and r.ordering_key is not None}
        beyond = sorted(committed - {r.pair for r in d.records})
        if keys and beyond:
            try:
                found = await self.pending(beyond, self.retire.identity)
            except Exception as exc:  # the database is away: the rows wait
                raise ProgressUnavailableError(errors.describe(exc)) from exc
            rows = [r for r in found if r.ordering_key in keys]
            d.adopt(rows)
            done |= {r.pair for r in rows}
        if done:
            log.info("takeover_found_committed", rows=len(done), reclaimed=len(reclaimed))
        await self._reconciled([r for r in d.records if r.reclaimed])

    async def _reconciled(self, records: Sequence[OutboxRecord]) -> None:
        """The keys' duty is done: every row of theirs a lost claim committed is decided. If the
        database does not answer, the duty stays (the next claim of a key reads the progress
        again, which finds this one's commit): only a cost."""
        try:
            await self.reconciled(work_keys(records))
        except errors.OutboxDispatcherError as exc:  # the database is away: the duty stays
            log.warning("takeover_duty_kept", keys=len(records), error=errors.describe(exc))

    async def committed(self, own: Sequence[Lane]) -> set[Pair]:
        """The (id, replays) pairs of every committed transaction not seen marked, under the
        outbox's identity read now: this dispatcher's lanes whose commit went unanswered
        replaced first (a fresh producer ends it), then the progress read to its end (this
        dispatcher's own from memory as well). The other keys read are due a tombstone once
        nothing they list is needed (kafka/retirement.py)."""
        try:
            identity = await self.retire.refresh(own)
        except Exception as exc:  # the database is away: the rows wait
            raise ProgressUnavailableError(errors.describe(exc)) from exc
        try:
            for lane in own:
                await lane.producers.replace_if_broken()
            records = await self.read(own)
        except ProgressUnavailableError:
            raise
        except (*KAFKA_TROUBLE, errors.BrokerUnavailableError) as exc:
            raise ProgressUnavailableError(errors.describe(exc)) from exc
        last = progress.last_batches(self.progress, identity, records)
        self.retire.read(own, last)
        mine = {p for lane in own for pairs in lane.unmarked.values() for p in pairs}
        return mine | {p for batches in last.values() for ps in batches.values() for p in ps}

    async def read(self, own: Sequence[Lane]) -> list[Record]:
        """The progress topic's committed records (its partitions as a serving lane's producer
        knows them), to its high watermark: a transaction open there is waited for as long as
        an unfenced one can live (its timeout and the broker's abort sweep, END_MARGIN_SECONDS),
        then ProgressEndUnreachedError."""
        serving = [lane for lane in own if lane.producers.serving]
        if not serving:
            msg = "no lane's producer is started (a new id could not be started yet)"
            raise ProgressUnavailableError(msg)
        topic = self.progress.topic
        await progress_topic.check(self.producer.connection, topic)  # not made again since
        partitions = await serving[0].producers.current().partitions_for(topic)
        connection = self.producer.connection
        return await progress.read_committed(
            connection,
            topic,
            partitions,
            max(connection.request_timeout_seconds, 10.0),
            end_seconds=self.progress.timeout_seconds + END_MARGIN_SECONDS,
        )
