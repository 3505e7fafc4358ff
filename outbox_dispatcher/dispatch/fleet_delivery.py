"""Exactly-once for each outbox of many (OUTBOX_SOURCES with OUTBOX_DELIVERY=exactly-once;
docs/design/many-outboxes.md, "Exactly-once per outbox").

Each served outbox has a TransactionalPublisher of its own, made as the single-table dispatcher
makes it (dispatch/progress_store.transactional_publisher): its own registry row and
transactional ids, progress identity, lanes, takeovers and sweep of dead dispatchers' keys.
Nothing of the wing is shared across outboxes but the progress topic, whose keys already name
their outbox. What differs is when its lanes (transactional producers) run: they are opened at
the outbox's first batch, or the first duty that needs them (a crash loop's progress read), and
closed once it has been idle for OUTBOX_LANES_IDLE_SECONDS with nothing in flight and every
batch marked, so that hundreds of idle outboxes hold no producer. A lane closed that way ended
its key (retirement.farewell) and left nothing to reconcile; a process killed with lanes open
is the single-table case, per outbox: the next claim of its keys takes them over.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

import structlog

from outbox_dispatcher import errors, metrics, registry
from outbox_dispatcher.dispatch.leases import InFlight
from outbox_dispatcher.dispatch.progress_store import transactional_publisher
from outbox_dispatcher.kafka.exactly_once import topic as progress_topic
from outbox_dispatcher.kafka.exactly_once.delivery import (
    TransactionAbortedError,
    TransactionalDelivery,
)
from outbox_dispatcher.kafka.exactly_once.progress import Pair, ProgressConfig
from outbox_dispatcher.kafka.exactly_once.publisher import TransactionalPublisher
from outbox_dispatcher.kafka.exactly_once.takeover import KAFKA_TROUBLE
from outbox_dispatcher.kafka.publisher import PublisherConfig
from outbox_dispatcher.models import OutboxRecord
from outbox_dispatcher.store import DispatchStore, db

log = structlog.get_logger(__name__)

# Opening lanes that fails (the broker or the outbox's database away): its batch is given back.
OPEN_FAILURES: tuple[type[BaseException], ...] = (
    errors.BrokerUnavailableError,
    errors.DatabaseUnavailableError,
    db.PostgresError,
    *db.RETRIABLE_ERRORS,
)
# A claim whose lanes took longer than this share of the lease to open is given back unsent
# rather than published under producers that started after it (see OutboxLanes.claimed).
OPEN_SHARE_OF_LEASE = 1 / 3
# An outbox's lanes opened within this long of the process's last check of the progress topic
# skip theirs: the check (an admin client's round trips) was about half of an open's time.
TOPIC_CHECK_SECONDS = 60.0


class TopicChecks:
    """When the process last checked the progress topic: at its start, then at an outbox's
    lanes' open once TOPIC_CHECK_SECONDS have passed (a topic deleted while the fleet runs is
    still found, at the next open after that)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._at: float | None = None

    def due(self) -> bool:
        return self._at is None or self._clock() - self._at >= TOPIC_CHECK_SECONDS

    def done(self) -> None:
        self._at = self._clock()


@dataclass(frozen=True)
class ExactlyOnce:
    """What every outbox's exactly-once publisher is made with: the process's configs."""

    config: PublisherConfig
    progress: ProgressConfig  # its `outbox` is each outbox's "<schema>.<table>"
    counted: metrics.Metrics  # the process's counters of renewed lanes, waits, failed fences
    owner: str
    lane_count: int  # OUTBOX_CLAIM_TASKS, at most lanes.LANES: as the single-table dispatcher
    idle_seconds: float  # OUTBOX_LANES_IDLE_SECONDS
    lease_seconds: float
    topic_checks: TopicChecks = field(default_factory=TopicChecks)

    def lanes_of(
        self,
        label: str,
        schema: str,
        table: str,
        store: DispatchStore,
        heartbeat: registry.Heartbeat,
        in_flight: InFlight,
    ) -> OutboxLanes:
        """One outbox's lanes, closed (nothing is made until its first batch)."""
        progress = ProgressConfig(
            topic=self.progress.topic,
            outbox=f"{schema}.{table}",
            transactional_id_prefix=self.progress.transactional_id_prefix,
            timeout_seconds=self.progress.timeout_seconds,
        )

        async def make() -> TransactionalPublisher:
            return await transactional_publisher(
                store,
                heartbeat,
                self.config,
                progress,
                owner=self.owner,
                lane_count=self.lane_count,
                counted=self.counted,
            )

        return OutboxLanes(
            make,
            in_flight,
            label=label,
            idle_seconds=self.idle_seconds,
            lease_seconds=self.lease_seconds,
            topic_checks=self.topic_checks,
        )


async def ensure_progress_topic(eo: ExactlyOnce, stores: Sequence[DispatchStore]) -> None:
    """At the process's start, before any outbox is served: the progress topic created if it is
    missing and no outbox of `stores` needs what it held (a key leased or holding the reconcile
    duty), else checked. An outbox's lanes check it again at an open (at most once a
    TOPIC_CHECK_SECONDS for the process), but that open follows the claim that needs them,
    whose own leases would read as a topic deleted under them."""

    async def unsettled() -> int:
        return sum([await store.unsettled_work() for store in stores])

    try:
        await progress_topic.ensure(eo.config.producer.connection, eo.progress.topic, unsettled)
        eo.topic_checks.done()
    except KAFKA_TROUBLE as exc:
        raise errors.BrokerUnavailableError(errors.describe(exc)) from exc


class OutboxLanes:
    """One outbox's exactly-once publisher (the Publishing face of dispatch/batch.py), its lanes
    opened when a batch or a duty needs them and closed after `idle_seconds` without use."""

    def __init__(
        self,
        make: Callable[[], Awaitable[TransactionalPublisher]],
        in_flight: InFlight,
        *,
        label: str = "",
        idle_seconds: float,
        lease_seconds: float,
        topic_checks: TopicChecks | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._make = make
        self._topic_checks = topic_checks or TopicChecks(clock)
        self._in_flight = in_flight
        self.label = label  # its outbox's `source` label, in its lines
        self.idle_seconds = idle_seconds
        self._lease_seconds = lease_seconds
        self._clock = clock
        # Made at the first open and kept: its lanes' generations, given-up ids and what its
        # records list outlive a close (a lane reopened never takes a given-up id again).
        self.publisher: TransactionalPublisher | None = None
        self.open = False
        self.opened = 0  # times opened, and closed (tests, logs)
        self.closed = 0
        self._lock = asyncio.Lock()  # an open, a close or a sweep at a time
        self._used = clock()
        self._busy = 0  # duties (a crash loop's read) using the lanes now

    async def claimed(self, claimed_at: float) -> float | None:
        """Before a claimed batch is published: its lanes, opened if they are closed. The
        claim's time as the publisher is to see it (None: they could not be opened, the
        batch is to be given back): a lane refuses a claim made before its producer started
        (its lease may have expired meanwhile), so a claim that opened the lanes counts from
        the open, unless the open took more than OPEN_SHARE_OF_LEASE of the lease, whose rows
        the publisher then gives back unsent (they may be another's by now)."""
        self._used = self._clock()
        if self.open:
            return claimed_at
        loop = asyncio.get_running_loop()
        try:
            await self._ensure_open()
        except OPEN_FAILURES as exc:
            log.warning("lanes_not_opened", source=self.label, error=errors.describe(exc))
            return None
        now = loop.time()
        return now if now - claimed_at < self._lease_seconds * OPEN_SHARE_OF_LEASE else claimed_at

    @staticmethod
    def not_opened(rows: int) -> list[BaseException | None]:
        """The outcomes of a batch whose lanes could not be opened: retried, never counted."""
        return [TransactionAbortedError("the outbox's lanes could not be opened")] * rows

    async def _ensure_open(self) -> TransactionalPublisher:
        async with self._lock:
            if self.publisher is None:
                self.publisher = await self._make()
            if not self.open:
                check = self._topic_checks.due()
                await self.publisher.start(check_topic=check)
                if check:
                    self._topic_checks.done()
                self.open = True
                self.opened += 1
                log.info("lanes_opened", source=self.label, lanes=len(self.publisher.lanes))
            self._used = self._clock()
            return self.publisher

    def idle(self) -> bool:
        """Nothing uses its lanes: idle_seconds since their last use, no row in flight, no
        transaction open or waiting, every committed batch marked, no partition held."""
        publisher = self.publisher
        if not self.open or publisher is None or self._busy or len(self._in_flight):
            return False
        if self._clock() - self._used < self.idle_seconds or publisher.holds.held:
            return False
        return not any(
            lane.unmarked or lane.given or lane.turn.locked() for lane in publisher.lanes
        )

    async def close_if_idle(self) -> bool:
        """Close its lanes if they are idle (their keys ended first: a graceful stop's)."""
        if not self.idle():
            return False
        async with self._lock:
            if not self.idle():
                return False
            await self._close("idle")
        return True

    async def stop(self, settle_within: float = 0.0) -> None:
        """The outbox let go, or the process stopping: its lanes closed if they are open, once
        its rows in flight are settled (`settle_within` seconds at most: a claim of it in a slot
        ends as it would; one cut short is a crash's case, its keys taken over later)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + settle_within
        while (len(self._in_flight) or self._busy) and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.1)  # (InFlight has no event to wait on)
        async with self._lock:
            if self.open:
                await self._close("stopped")
            elif self.publisher is not None:  # a close cut short (cancelled): its producers
                await self.publisher.lanes.stop()

    async def _close(self, reason: str) -> None:
        assert self.publisher is not None  # noqa: S101 (open: made)
        self.open = False  # first: a claim now waits for the lock and opens them again
        await self.publisher.stop()
        self.closed += 1
        log.info("lanes_closed", source=self.label, reason=reason)

    async def sweep(self) -> None:
        """Its sweep of dead dispatchers' progress keys, while its lanes are open (the sweep
        reads through them; an idle outbox's keys wait for its next activity, or for another
        dispatcher of it)."""
        async with self._lock:
            if self.open and self.publisher is not None:
                await self.publisher.orphans.sweep()

    async def committed_of(self, pairs: Sequence[Pair], owners: Sequence[str] = ()) -> set[int]:
        """leases.CommittedOf: a crash loop's progress read, its lanes opened for it (a broker
        or database away: BrokerUnavailableError, and the reclaimer waits)."""
        self._busy += 1
        try:
            try:
                publisher = await self._ensure_open()
            except OPEN_FAILURES as exc:
                raise errors.BrokerUnavailableError(errors.describe(exc)) from exc
            return await publisher.committed_of(pairs, owners)
        finally:
            self._busy -= 1
            self._used = self._clock()

    async def run_closer(self, every_seconds: float | None = None) -> NoReturn:
        """Close its lanes once idle: looked at every quarter of idle_seconds (jittered)."""
        seconds = every_seconds or self.idle_seconds / 4
        while True:
            await asyncio.sleep(seconds * random.uniform(0.75, 1.25))  # noqa: S311 - spreading
            await self.close_if_idle()

    # Publishing (dispatch/batch.py): a batch run's calls, made while its lanes are open.

    def publish(
        self,
        records: Sequence[OutboxRecord],
        heartbeat: Callable[[], None] = lambda: None,
        claimed_at: float | None = None,
    ) -> TransactionalDelivery:
        self._used = self._clock()
        return self._opened().publish(records, heartbeat, claimed_at)

    async def abandon(self, delivery: TransactionalDelivery, reason: str) -> None:
        await self._opened().abandon(delivery, reason)

    async def reachable(self, seconds: float = 5.0) -> bool:
        return self.open and await self._opened().reachable(seconds)

    def marked(
        self, delivery: TransactionalDelivery, *, every_row: bool, final: bool = True
    ) -> None:
        self._used = self._clock()
        self._opened().marked(delivery, every_row=every_row, final=final)

    @property
    def held(self) -> int:
        """Partitions its publisher holds (outbox_partitions_held sums them)."""
        return 0 if self.publisher is None else len(self.publisher.holds.held)

    def _opened(self) -> TransactionalPublisher:
        if self.publisher is None:
            msg = "the outbox's lanes were never opened"
            raise errors.OutboxDispatcherError(msg)
        return self.publisher
