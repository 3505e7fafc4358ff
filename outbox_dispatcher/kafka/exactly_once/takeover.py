"""Exactly-once's takeover (docs/design/exactly-once.md): a claim that took rows over from a lost
claim first fences the owners it stands in for (strictly, whatever their heartbeat's age) and
the other dispatchers that beat lately (as it can), then, holding every lane of its own
dispatcher, reads the committed progress to its end; its rows a lost claim committed are
published already (marked, not sent again), and so are that claim's committed rows of the same
keys beyond this batch (adopted). If a lost owner cannot be fenced or the progress cannot be
read, nothing is sent: its rows go back, uncounted, their keys keeping the duty.

The duty to reconcile is durable (the key's work row keeps `reconcile_owner` from the claim that
found its lease expired): a claim returns a key's rows as reclaimed until a takeover read the
progress and cleared it (`ProgressStore.reconciled`), so a pause, a cancel or a lost claim reply in
between leaves the next claim of the key a takeover too.

Rows are matched by (id, replays) under the outbox's identity read from the database at each
takeover (issue 35, E5): a replayed row, or a row of a table truncated since, is sent again,
never marked from a stale record.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import structlog
from aiokafka import errors as kafka_errors

from outbox_dispatcher import errors
from outbox_dispatcher.kafka.exactly_once import lanes, progress
from outbox_dispatcher.kafka.exactly_once import topic as progress_topic
from outbox_dispatcher.kafka.exactly_once.lanes import Lane
from outbox_dispatcher.kafka.exactly_once.progress import (
    Pair,
    ProgressConfig,
    ProgressUnavailableError,
    Record,
)
from outbox_dispatcher.kafka.exactly_once.retirement import Retirement
from outbox_dispatcher.kafka.exactly_once.store import ProgressStore
from outbox_dispatcher.kafka.producers import ProducerConfig
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
    """What a takeover decides of a claim (kafka/exactly_once/publisher.TransactionalDelivery)."""

    records: list[OutboxRecord]

    def decide(self, indices: Sequence[int], outcome: BaseException | None) -> None: ...
    def adopt(self, rows: Sequence[OutboxRecord]) -> None: ...


@dataclass(frozen=True)
class Takeover:
    progress: ProgressConfig
    producer: ProducerConfig  # the lanes' (a fence starts one under another id)
    owner: str
    store: ProgressStore  # the registry, the rows still pending, the reconcile duty
    fence_seconds: float  # a fence that takes longer: the id's markers cannot be written yet
    retire: Retirement  # the outbox's identity; the keys read, tombstoned when done
    # Another dispatcher's id could not be fenced (a metric; the takeover goes on).
    fence_failed: Callable[[], None] = lambda: None

    async def fence_others(
        self, records: Sequence[OutboxRecord] = (), owners: Sequence[str] = ()
    ) -> None:
        """Fence the owners whose claims this takeover stands in for (the reconcile duty of the
        reclaimed `records`' keys names them; `owners`: named by the caller): every id each
        recorded, whatever its heartbeat's age, since a zombie paused past any window resumes
        under its old producer with a claim the taker sends too (review E6). One that cannot be
        fenced makes the takeover wait (FenceFailedError). Every other id the registry lists
        lately is fenced as it can, so that its open transaction does not hold the progress
        partition's end: a failure is logged and counted and holds nobody up (review E7: an id
        whose markers cannot be written stalled every takeover of the table). Needs no lane of
        this dispatcher."""
        keys = work_keys([r for r in records if r.reclaimed])
        try:
            lost = await self.store.lost(keys, owners)
        except Exception as exc:  # the database is away: the rows wait
            raise ProgressUnavailableError(errors.describe(exc)) from exc
        strict = lanes.fence_ids(self.progress, lost, self.owner)
        try:
            registered = await self.store.live()
        except Exception as exc:  # noqa: BLE001 - best effort: the read waits for them
            log.warning("takeover_registry_unread", error=errors.describe(exc))
            registered = []
        listed = lanes.fence_ids(self.progress, registered, self.owner)
        others = [t for t in dict.fromkeys(listed) if t not in strict]
        limit = asyncio.Semaphore(FENCES_AT_ONCE)

        async def fence(tid: str) -> None:
            async with limit:
                await progress.fence(self.producer, tid, self.fence_seconds)

        ids = list(dict.fromkeys(strict)) + others
        results = await asyncio.gather(*(fence(t) for t in ids), return_exceptions=True)
        unfenced: list[tuple[str, BaseException]] = []
        for tid, result in zip(ids, results, strict=True):
            if result is None:
                continue
            if not isinstance(result, (*KAFKA_TROUBLE, errors.BrokerUnavailableError)):
                raise result  # not the broker's: a bug
            if tid in strict:
                unfenced.append((tid, result))
                continue
            self.fence_failed()
            log.warning("fence_failed", transactional_id=tid, error=errors.describe(result))
        if unfenced:
            raise FenceFailedError(unfenced)

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
                found = await self.store.pending(beyond, self.retire.identity)
            except Exception as exc:  # the database is away: the rows wait
                raise ProgressUnavailableError(errors.describe(exc)) from exc
            rows = [r for r in found if r.ordering_key in keys]
            d.adopt(rows)
            done |= {r.pair for r in rows}
        if done:
            log.info("takeover_found_committed", rows=len(done), reclaimed=len(reclaimed))
        await self._reconciled([r for r in d.records if r.reclaimed])

    async def _reconciled(self, records: Sequence[OutboxRecord]) -> None:
        """The keys' duty is done: every row of theirs a lost claim committed is decided. Only
        once it is cleared for every key (under this dispatcher's live leases) may the takeover
        send: the duty names one lost owner, and the next taker fences strictly only the owner
        it names or, once it is cleared, the owner of the lease that expires next, so a taker
        that sent under a duty it left standing could be a zombie nobody fences (review E6).
        Otherwise ProgressUnavailableError: nothing sent, the rows given back, the duty kept."""
        keys = work_keys(records)
        try:
            cleared = await self.store.reconciled(keys)
        except errors.OutboxDispatcherError as exc:  # the database is away: the duty stays
            raise ProgressUnavailableError(f"the duty was not cleared: {exc}") from exc
        if cleared < len(keys):
            msg = f"the duty was cleared for {cleared} of {len(keys)} keys (a lease expired)"
            raise ProgressUnavailableError(msg)

    async def committed(self, own: Sequence[Lane]) -> set[Pair]:
        """The (id, replays) pairs of every committed transaction not seen marked, under the
        outbox's identity read now: this dispatcher's lanes whose commit went unanswered
        replaced first (a fresh producer ends it), then the progress read to its end (this
        dispatcher's own from memory as well). The other keys read are due a tombstone once
        nothing they list is needed (kafka/exactly_once/retirement.py)."""
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


class FenceFailedError(ProgressUnavailableError):
    """A transactional id of an owner whose claims a takeover stands in for could not be fenced
    within the bound (its last transaction's markers cannot be written: a partition short of
    in-sync replicas, a coordinator away): that owner may still commit, so the takeover reads
    nothing and sends nothing; its rows wait, uncounted, and their keys keep the duty."""

    def __init__(self, unfenced: Sequence[tuple[str, BaseException]]) -> None:
        which = "; ".join(f"{tid}: {errors.describe(exc)}" for tid, exc in unfenced)
        super().__init__(
            f"the lost owner's transactional ids could not be fenced ({which}). Check the "
            "partitions its transactions wrote to (kafka-topics.sh --describe "
            "--under-min-isr-partitions) and the transaction coordinator "
            "(kafka-transactions.sh describe --transactional-id ...); the takeover is tried again"
        )
        self.unfenced = [tid for tid, _ in unfenced]


class TakeoverWaitingError(errors.NotAttempted):
    """A takeover could not fence the owner it stands in for, or read the progress: nothing was
    sent, and the row waits, uncounted; its key keeps the reconcile duty, so its next claim,
    by any dispatcher, fences and reads again."""

    def __init__(self, cause: BaseException, delay: float) -> None:
        super().__init__(f"the takeover waits ({cause}); its rows wait {delay:.1f} s")
        self.delay = delay
