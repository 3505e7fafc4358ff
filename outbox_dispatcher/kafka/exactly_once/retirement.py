"""Exactly-once's progress kept bounded (docs/design/exactly-once.md, "Bounds"; issue 35, E8,
E9): what a lane's progress records list, and which keys the progress topic keeps.

A batch leaves a lane's list once its mark changed every row (TransactionalPublisher.marked).
One whose mark failed or changed only some rows (taken over meanwhile, dead-lettered), or a
split claim whose later part stayed unknown, stays listed until none of its (id, replays) pairs
is still needed: pending with that replay count, or dead-lettered by the crash-loop reclaimer
and not yet checked against the progress (dispatch.sql `progress_needed`). Nobody can decide
such a pair again (a replay bumps the count, a TRUNCATE draws a new identity), so nobody needs
the record to list it. The check is one statement at most every RETIRE_EVERY_SECONDS per
dispatcher; it also reads the outbox's identity, so that a dispatcher learns of a TRUNCATE.

Keys (transactional ids) are ended by a tombstone, in a transaction of a lane, once nothing
their last record listed is needed: a lane's own id at a graceful stop; a lane's given-up ids
once their batches left its list; the keys a takeover read of dispatchers that no longer beat.
The keys of dispatchers that died while they held no lease (no takeover reads them) are ended
by every dispatcher's sweep (orphans.py), each under its own id. A tombstone can only make a
takeover send a row again (it removes knowledge of a commit), never mark one unsent.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import structlog

from outbox_dispatcher.kafka import internals
from outbox_dispatcher.kafka.exactly_once import progress
from outbox_dispatcher.kafka.exactly_once.lanes import Lane
from outbox_dispatcher.kafka.exactly_once.progress import (
    Listed,
    Pair,
    ProgressConfig,
    ProgressRecordTooLargeError,
)

if TYPE_CHECKING:
    from outbox_dispatcher.kafka.exactly_once.delivery import TransactionalDelivery

log = structlog.get_logger(__name__)

RETIRE_EVERY_SECONDS = 5.0

# The identity now, and the ids among the pairs still needed (store.progress_needed).
Needed = Callable[[list[Pair]], Awaitable[tuple[str, set[int]]]]
# The transactional ids recorded by the dispatchers that beat lately (not the fence window's
# hour: a dispatcher killed a minute ago no longer beats, and cannot write under its ids).
Beating = Callable[[], Awaitable[set[str]]]


class Retirement:
    """What the lanes' records list and which keys get a tombstone, for one dispatcher."""

    def __init__(self, needed: Needed, beating: Beating, identity: str) -> None:
        self.identity = identity
        self._needed = needed
        self._beating = beating
        self._checked_at = -math.inf
        # Other dispatchers' keys a takeover read: tombstoned once nothing they list is needed
        # and their dispatcher no longer beats.
        self.due: dict[str, list[Pair]] = {}
        self.tombstones: set[str] = set()  # keys whose tombstone goes in a next transaction

    def too_large(
        self,
        config: ProgressConfig,
        d: TransactionalDelivery,
        indices: list[int],
        max_request_bytes: int,
    ) -> ProgressRecordTooLargeError | None:
        """The transaction's progress record, at its largest (every row of `indices` sent),
        would not fit a request (review E8): an outage of the lane, not the rows' fault (retried
        after the pause, the producer kept); what is still needed is checked first next time
        (soon). Here because what the record lists is the retirement's to keep bounded."""
        lane = d.lane
        listing = d.listing(indices)
        listed = sum(map(len, listing.values()))
        at_most = progress.RECORD_OVERHEAD_BYTES + listed * progress.PAIR_BYTES_AT_MOST
        if at_most <= max_request_bytes:  # one batch always fits (config/checks.py)
            return None
        value = progress.record_value(config, self.identity, lane.name, listing)
        size = len(value) + len(lane.transactional_id) + progress.RECORD_OVERHEAD_BYTES
        if size <= max_request_bytes:
            return None
        self.soon()
        return ProgressRecordTooLargeError(size, max_request_bytes)

    async def refresh(self, lanes: Sequence[Lane]) -> str:
        """The identity read now (a takeover reads it before the progress); raises when the
        database does not answer."""
        await self._check(lanes, [])
        return self.identity

    async def check(self, lanes: Sequence[Lane], *, force: bool = False) -> None:
        """At most every RETIRE_EVERY_SECONDS (or now: `force`): the identity read again, the
        lanes' batches and the due keys nothing needs any more retired. A database that does
        not answer changes nothing."""
        now = asyncio.get_running_loop().time()
        if not force and now - self._checked_at < RETIRE_EVERY_SECONDS:
            return
        self._checked_at = now
        # What is asked about: a list changed meanwhile (a split claim's next part committed
        # under its tag, a takeover read a key again) is left for the next check.
        asked = [(lane, dict(lane.unmarked)) for lane in lanes]
        due = dict(self.due)
        pairs = {p for _, listed in asked for ps in listed.values() for p in ps}
        pairs.update(p for ps in due.values() for p in ps)
        try:
            needed = await self._check(lanes, sorted(pairs))
            beating = await self._beating() if due else set()
        except Exception as exc:  # noqa: BLE001 - the database is away: the lists stay
            log.info("progress_retirement_skipped", error=repr(exc))
            return
        for lane, listed in asked:
            for tag, ps in listed.items():
                if lane.unmarked.get(tag) is ps and not _any(ps, needed):
                    del lane.unmarked[tag]
                    log.info("progress_batch_retired", lane=lane.name, tag=tag)
        for key, ps in due.items():
            if self.due.get(key) is ps and not _any(ps, needed) and key not in beating:
                self.tombstones.add(key)
                del self.due[key]
        self.given_up(lanes)

    async def _check(self, lanes: Sequence[Lane], pairs: list[Pair]) -> set[int]:
        identity, needed = await self._needed(pairs)
        if identity != self.identity:
            # A TRUNCATE: every row listed is gone, the records under the old identity are
            # never read again; nothing listed is needed.
            log.warning("outbox_identity_changed", was=self.identity, now=identity)
            self.identity = identity
            for lane in lanes:
                lane.unmarked.clear()
            self.tombstones.update(self.due)
            self.due.clear()
            return set()
        return needed

    async def farewell(self, lanes: Sequence[Lane], topic: str) -> None:
        """A graceful stop: each lane, in a transaction of its own, tombstones its id (if
        nothing it lists is needed any more, and no commit of its is unknown: its id's last
        record is what a takeover will read to decide that commit) and the keys due."""
        await self.check(lanes, force=True)
        for lane in lanes:
            keys = self.to_send(lanes)
            if not lane.unmarked and lane.unresolved is None:
                keys.append(lane.transactional_id)
            if not keys or not lane.producers.serving:
                continue
            try:
                async with lane.turn:
                    await _tombstone(lane, topic, keys)
            except Exception as exc:  # noqa: BLE001 - fenced, or the broker away: keys stay
                log.info("progress_keys_kept", lane=lane.name, error=repr(exc))
                continue
            self.sent(keys)
            log.info("progress_keys_tombstoned", lane=lane.name, keys=len(keys))

    def soon(self) -> None:
        """The next transaction checks first (a record grew too large to send)."""
        self._checked_at = -math.inf

    def read(self, lanes: Sequence[Lane], last: dict[str, Listed]) -> None:
        """A takeover read these keys' last records: those of other dispatchers are due (this
        dispatcher's own current ids never: its lanes write under them)."""
        mine = {lane.transactional_id for lane in lanes}
        for key, batches in last.items():
            if key not in mine:
                self.due[key] = [p for pairs in batches.values() for p in pairs]

    def given_up(self, lanes: Iterable[Lane]) -> None:
        """A lane's given-up ids whose last record's batches all left its list: tombstoned."""
        for lane in lanes:
            for key, tags in list(lane.given_up):
                if tags.isdisjoint(lane.unmarked):
                    lane.given_up.remove((key, tags))
                    self.tombstones.add(key)

    def to_send(self, lanes: Iterable[Lane]) -> list[str]:
        """The tombstones a transaction carries (never a lane's current id)."""
        self.given_up(lanes)
        return sorted(self.tombstones - {lane.transactional_id for lane in lanes})

    def sent(self, keys: Iterable[str]) -> None:
        """These tombstones were committed."""
        self.tombstones.difference_update(keys)


async def _tombstone(lane: Lane, topic: str, keys: list[str]) -> None:
    """One transaction of tombstones (their answers read whatever the commit says)."""
    await lane.producers.replace_if_broken()
    producer = lane.producers.current()
    held: list[Any] = []
    try:
        await producer.begin_transaction()
        for key in keys:
            answer = await producer.send(topic, None, key=key.encode())
            answer.add_done_callback(_read)
        held = internals.held_batches(producer)
        await producer.commit_transaction()
    except BaseException:
        internals.read_fatal_error(producer)  # a fence's errors, read (nothing else will)
        internals.read_drains(held)
        raise


def _read(answer: asyncio.Future[Any]) -> None:
    if not answer.cancelled():
        answer.exception()


def _any(pairs: Iterable[Pair], needed: set[int]) -> bool:
    return any(i in needed for i, _ in pairs)
