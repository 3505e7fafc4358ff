"""Exactly-once's lanes (docs/design/exactly-once.md): a dispatcher's transactional producers.

A producer has one transaction open at a time; with one per process, its claim loops took
turns and a row waited for the other loop's whole transaction. A dispatcher has up to LANES
lanes (one per claim loop), each its own producer under its own transactional id, so that two
claim loops' transactions are open at once.

A lane's id changes when its transaction stalls on a partition that does not acknowledge: that
id cannot begin another transaction until the partition takes the stalled one's markers
(kafka/exactly_once/stalls.py), so the lane goes on under the id of its next generation. Every id a
dispatcher may have a transaction open under is recorded in its registry row before its first
transaction (schema version 15), and a takeover fences what is recorded there.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, overload

import structlog

from outbox_dispatcher import errors
from outbox_dispatcher.kafka import internals
from outbox_dispatcher.kafka.exactly_once import progress
from outbox_dispatcher.kafka.exactly_once.progress import ProgressConfig
from outbox_dispatcher.kafka.producers import ProducerConfig, Producers
from outbox_dispatcher.kafka.topics import TopicConfig, TopicLookup

log = structlog.get_logger(__name__)

LANES = 2

# A dispatcher in the registry: its owner id, its delivery mode, the transactional ids it
# recorded (None: none recorded; a release older than schema version 15, or no row).
Registered = tuple[str, str | None, Sequence[str] | None]
# Work keys (the key, or a keyless row's id, and whether it is keyless: models.work_keys).
WorkKeys = Sequence[tuple[str, bool]]


class Registry(Protocol):
    """The dispatchers' registry as exactly-once uses it: the part of the store seam
    (store.ProgressStore) that the lanes and a takeover's fences need."""

    async def live(self) -> Sequence[Registered]:
        """Every dispatcher of the table that beat lately, with the ids it recorded: a takeover
        fences them as it can (their open transactions would hold the progress partition)."""
        ...

    async def record(self, ids: Sequence[str]) -> None:
        """Record this dispatcher's transactional ids (before the first transaction of each)."""
        ...

    async def lost(self, keys: WorkKeys, owners: Sequence[str]) -> Sequence[Registered]:
        """The owners whose claims a takeover stands in for, whatever their heartbeat's age:
        those the reconcile duty of the work keys names, and the owners given (store
        `lost_owners`). A takeover fences every id of theirs, or waits (review E6, E7)."""
        ...


def lane_name(owner: str, number: int, generation: int = 0) -> str:
    """What a lane writes progress under (and its transactional id ends with): the owner for
    the first lane, "<owner>.<n>" for the others (as before generations), and
    "<owner>.<n>.<generation>" once a lane gave an id up."""
    if generation:
        return f"{owner}.{number}.{generation}"
    return owner if number == 0 else f"{owner}.{number}"


def fence_ids(progress: ProgressConfig, registered: Sequence[Registered], me: str) -> list[str]:
    """Every transactional id another dispatcher may have a transaction open under: those it
    recorded; for an exactly-once dispatcher of a release that records none, the ids that
    release used (its LANES lanes' first generation)."""
    ids: list[str] = []
    for owner, delivery, recorded in registered:
        if owner == me:
            continue
        if recorded is not None:
            ids.extend(recorded)
        elif delivery in (None, "exactly-once"):
            ids.extend(progress.transactional_id(lane_name(owner, n)) for n in range(LANES))
    return ids


@dataclass
class Lane:
    """One transactional producer: its transactions one at a time, the batches it committed
    that are not seen marked yet (its progress records list them), the deliveries it was given.
    Its generation, name, id and producers change when it gives its id up (renew)."""

    owner: str
    number: int
    producer: ProducerConfig
    progress: ProgressConfig
    topic_config: TopicConfig
    generation: int = 0
    turn: asyncio.Lock = field(default_factory=asyncio.Lock)
    unmarked: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # tag: pairs
    # The tags its id's last committed record listed; the ids it gave up, each with those of
    # its last record (tombstoned once they all left `unmarked`: kafka/exactly_once/retirement.py).
    last_listed: frozenset[str] = frozenset()
    given_up: list[tuple[str, frozenset[str]]] = field(default_factory=list)
    given: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)  # not yet transacted
    # A commit of its whose outcome could not be read yet, (delivery, rows): read before the
    # lane commits again or tombstones its id (Endings.resolve_earlier, Retirement.farewell).
    unresolved: tuple[Any, list[int]] | None = None

    def __post_init__(self) -> None:
        self.producers, self.topics = self._producers(self.generation)

    @property
    def name(self) -> str:
        return lane_name(self.owner, self.number, self.generation)

    @property
    def transactional_id(self) -> str:
        return self.progress.transactional_id(self.name)

    def renew(self) -> Producers:
        """Go on under the next generation's id with new producers (not started); returns the
        given-up generation's producers."""
        old = self.producers
        self.given_up.append((self.transactional_id, self.last_listed))
        self.last_listed = frozenset()
        self.generation += 1
        self.producers, self.topics = self._producers(self.generation)
        return old

    def _producers(self, generation: int) -> tuple[Producers, TopicLookup]:
        tid = self.progress.transactional_id(lane_name(self.owner, self.number, generation))
        producers = Producers(dataclasses.replace(self.producer, transactional_id=tid))
        return producers, TopicLookup(producers, self.topic_config)


class Lanes(Sequence[Lane]):
    """A dispatcher's lanes: their ids recorded before their first transaction, their
    producers started and stopped together, and a lane's id given up for its next generation's
    (renew)."""

    def __init__(
        self,
        owner: str,
        count: int,
        producer: ProducerConfig,
        progress_config: ProgressConfig,
        topics: TopicConfig,
        registry: Registry,
    ) -> None:
        numbers = range(max(1, min(count, LANES)))
        self._lanes = [Lane(owner, n, producer, progress_config, topics) for n in numbers]
        self._registry = registry
        self._progress = progress_config
        self._producer = producer
        self._unready: set[int] = set()  # lanes whose new id is not recorded and started yet
        # One record at a time, its ids read inside (review E12): two lanes renewing at once
        # otherwise wrote lists each read before the other's renewal, the later write lacking
        # the other lane's new id while that lane served under it.
        self._recording = asyncio.Lock()
        self._fences: set[asyncio.Future[None]] = set()  # given-up ids being fenced
        for lane in self._lanes:
            lane.producers.before_start = self._recorded

    @overload
    def __getitem__(self, index: int) -> Lane: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Lane]: ...
    def __getitem__(self, index: int | slice) -> Lane | Sequence[Lane]:
        return self._lanes[index]

    def __len__(self) -> int:
        return len(self._lanes)

    def __iter__(self) -> Iterator[Lane]:
        return iter(self._lanes)

    def ids(self) -> list[str]:
        return [lane.transactional_id for lane in self._lanes]

    async def start(self) -> None:
        """Record the ids, then start the lanes' producers at once (an outbox's first event
        waits for one start, not one a lane); all stopped again if one fails."""
        await self._record()
        try:
            outcomes = await asyncio.gather(
                *(lane.producers.start() for lane in self._lanes), return_exceptions=True
            )
        except BaseException:  # cancelled (a producer cancelled mid-start closed itself)
            await self.stop()
            raise
        failed = next((o for o in outcomes if isinstance(o, BaseException)), None)
        if failed is not None:
            await self.stop()
            raise failed
        # Every lane's id recorded and its producer started (a lane renewed before a stop, and
        # started again: its `ready` would start a second producer and leak the first).
        self._unready.clear()

    async def stop(self) -> None:
        for fencing in self._fences:
            fencing.cancel()
        for lane in self._lanes:
            await lane.producers.stop()

    def least_busy(self) -> Lane:
        return least_busy(self._lanes)

    async def renew(self, lane: Lane, reason: str) -> None:
        """Give the lane's id up, never to commit under it again: its producer is closed (what
        it buffers failed: nothing of its transaction is visible), the id fenced in the
        background (its open transaction aborted now rather than at its timeout, so that the
        partitions that did answer are readable again), and the lane goes on under its next
        generation's id, recorded before the first transaction under it (ready)."""
        given_up = lane.transactional_id
        self._unready.add(lane.number)  # first: its new producers do not serve yet
        old = lane.renew()
        lane.producers.before_start = self._recorded
        with contextlib.suppress(errors.OutboxDispatcherError):  # never started
            producer = old.current()
            internals.fail_buffered(producer, errors.BrokerUnavailableError("given up"))
            await old.close_bounded([producer], "the transaction was given up")
        fencing = asyncio.ensure_future(self._fence(given_up))
        self._fences.add(fencing)
        fencing.add_done_callback(self._fences.discard)
        log.warning(
            "lane_renewed",
            lane=lane.name,
            given_up=given_up,
            now=lane.transactional_id,
            reason=reason,
        )
        with contextlib.suppress(errors.BrokerUnavailableError, errors.DatabaseUnavailableError):
            await self.ready(lane)  # else before its next transaction

    async def ready(self, lane: Lane) -> None:
        """A lane that took a new id: the ids recorded (every lane's, in one row), then its
        producer started; until both are done it sends nothing."""
        if lane.number not in self._unready:
            return
        try:
            await self._record()
        except Exception as exc:
            raise errors.DatabaseUnavailableError(errors.describe(exc)) from exc
        await lane.producers.start(max(self._progress.timeout_seconds, 10.0))
        self._unready.discard(lane.number)

    async def _record(self) -> None:
        """Every lane's current id in the registry row: read under the lock, so that the last
        write lists every id a lane serves under (or will, once its ready returns)."""
        async with self._recording:
            await self._registry.record(self.ids())

    async def _recorded(self) -> None:
        """Before a fresh producer starts under a lane's id (a commit without an answer, a
        producer state the broker lost): every lane's id recorded again. A sweep of dead
        dispatchers' ids (orphans.py) may have forgotten them while this dispatcher was paused
        past its heartbeat; the fresh producer could commit under the id again, and a takeover
        fences only what the registry lists."""
        try:
            await self._record()
        except Exception as exc:
            raise IdUnrecordedError(errors.describe(exc)) from exc

    async def _fence(self, transactional_id: str) -> None:
        """At most for the transaction timeout: past it the broker aborted the transaction."""
        try:
            await progress.fence(self._producer, transactional_id, self._progress.timeout_seconds)
        except Exception as exc:  # noqa: BLE001 - a speed-up only: the timeout aborts it anyway
            log.info("given_up_id_not_fenced", transactional_id=transactional_id, error=repr(exc))


def least_busy(lanes: Sequence[Lane]) -> Lane:
    """The lane with the fewest deliveries given and not transacted yet (the first on a tie)."""
    return min(lanes, key=lambda lane: len(lane.given) + lane.turn.locked())


class IdUnrecordedError(errors.BrokerUnavailableError):
    """A lane's producer was not started afresh: its transactional id could not be recorded in
    the registry first (the database did not answer). Nothing is sent under it until it is."""

    def __init__(self, cause: str) -> None:
        super().__init__(
            f"the lane's transactional id could not be recorded before its producer started "
            f"({cause}); it is tried again"
        )
