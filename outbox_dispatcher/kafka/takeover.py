"""Exactly-once's takeover (docs/design/exactly-once.md): a claim that took rows over from a lost
claim first fences every transactional id the other dispatchers recorded, then, holding every
lane of its own dispatcher, reads the committed progress to its end; its rows a lost claim
committed are published already (marked, not sent again), and so are that claim's committed
rows of the same keys beyond this batch (adopted). If the progress cannot be read, nothing of
the batch is decided: its rows stay leased for the next takeover.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import structlog
from aiokafka import errors as kafka_errors

from outbox_dispatcher import errors
from outbox_dispatcher.kafka import lanes, progress
from outbox_dispatcher.kafka.lanes import Lane, Registry
from outbox_dispatcher.kafka.producers import ProducerConfig
from outbox_dispatcher.kafka.progress import ProgressConfig, ProgressUnavailableError
from outbox_dispatcher.models import OutboxRecord

log = structlog.get_logger(__name__)

# IllegalOperation: aiokafka refuses a send or a commit of a producer whose transaction a fatal
# error (a fence) ended.
KAFKA_TROUBLE = (kafka_errors.KafkaError, kafka_errors.IllegalOperation, OSError, TimeoutError)
FENCES_AT_ONCE = 8


class Reconciled(Protocol):
    """What a takeover decides of a claim (kafka/transactions.TransactionalDelivery)."""

    records: list[OutboxRecord]

    def decide(self, indices: Sequence[int], outcome: BaseException | None) -> None: ...
    def adopt(self, rows: Sequence[OutboxRecord]) -> None: ...


PendingRows = Callable[[list[int]], Awaitable[Sequence[OutboxRecord]]]


@dataclass(frozen=True)
class Takeover:
    progress: ProgressConfig
    producer: ProducerConfig  # the lanes' (a fence starts one under another id)
    owner: str
    registry: Registry
    pending: PendingRows
    fence_seconds: float  # a fence that takes longer: the id's markers cannot be written yet

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
        reclaimed = {r.id for r in d.records if r.reclaimed}
        if not reclaimed:
            return
        committed = await self.committed(own)
        done = reclaimed & committed
        d.decide([i for i, r in enumerate(d.records) if r.id in done], None)
        keys = {r.ordering_key for r in d.records if r.reclaimed and r.ordering_key is not None}
        beyond = sorted(committed - {r.id for r in d.records})
        if keys and beyond:
            try:
                rows = [r for r in await self.pending(beyond) if r.ordering_key in keys]
            except Exception as exc:  # the database is away: the rows wait
                raise ProgressUnavailableError(errors.describe(exc)) from exc
            d.adopt(rows)
            done |= {r.id for r in rows}
        if done:
            log.info("takeover_found_committed", rows=len(done), reclaimed=len(reclaimed))

    async def committed(self, own: Sequence[Lane]) -> set[int]:
        """The ids of every committed transaction not seen marked: this dispatcher's lanes whose
        commit went unanswered replaced first (a fresh producer ends it), then the progress read
        to its end (this dispatcher's own from memory as well)."""
        try:
            for lane in own:
                await lane.producers.replace_if_broken()
            values = await self.read(own)
        except (*KAFKA_TROUBLE, errors.BrokerUnavailableError) as exc:
            raise ProgressUnavailableError(errors.describe(exc)) from exc
        mine = {i for lane in own for ids in lane.unmarked.values() for i in ids}
        return mine | progress.committed_ids(self.progress, values)

    async def read(self, own: Sequence[Lane]) -> list[bytes | None]:
        """The progress topic's committed records (its partitions as a serving lane's producer
        knows them)."""
        serving = [lane for lane in own if lane.producers.serving]
        if not serving:
            msg = "no lane's producer is started (a new id could not be started yet)"
            raise ProgressUnavailableError(msg)
        topic = self.progress.topic
        partitions = await serving[0].producers.current().partitions_for(topic)
        connection = self.producer.connection
        return await progress.read_committed(
            connection, topic, partitions, max(connection.request_timeout_seconds, 10.0)
        )
