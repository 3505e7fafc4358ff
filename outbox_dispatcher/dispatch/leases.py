"""Leases: keep ours alive while rows are in flight; deal with those of crashed dispatchers.

Rows whose lease expired are taken over by the next claim on their key; this loop only
dead-letters rows whose owners keep dying with them, reports what it saw, and walks the
anti-entropy sweep a step: the one path that finds rows written around the claim engine's
bookkeeping.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import NoReturn

import structlog

from outbox_dispatcher import errors
from outbox_dispatcher.config.settings import DeadLetterPolicy, Settings
from outbox_dispatcher.dispatch.every import every
from outbox_dispatcher.health import Heartbeats
from outbox_dispatcher.metrics import OutboxMetrics
from outbox_dispatcher.store import DispatchStore, Row, db

log = structlog.get_logger(__name__)


class InFlight:
    """The batches this process has claimed and not yet settled."""

    def __init__(self) -> None:
        self._batches: dict[uuid.UUID, list[int]] = {}

    def add(self, token: uuid.UUID, ids: list[int]) -> None:
        self._batches[token] = ids

    def discard(self, token: uuid.UUID) -> None:
        self._batches.pop(token, None)

    def pairs(self) -> tuple[list[int], list[uuid.UUID]]:
        ids: list[int] = []
        tokens: list[uuid.UUID] = []
        for token, batch_ids in self._batches.items():
            ids.extend(batch_ids)
            tokens.extend([token] * len(batch_ids))
        return ids, tokens

    def __len__(self) -> int:
        return sum(len(ids) for ids in self._batches.values())


async def keep_leases(
    store: DispatchStore,
    settings: Settings,
    in_flight: InFlight,
    heartbeats: Heartbeats,
    phase: float | None = None,
) -> NoReturn:
    """Extend the leases of in-flight rows every lease/3, for as long as the process lives.
    With `phase` (its place beside the process's other loops, every.spread), the extensions
    keep to a grid from `phase` after the start: a claim's rows are extended within lease/3 of
    their claim, the first ones too."""
    asked = 0

    async def extend() -> None:
        nonlocal asked
        try:
            ids, tokens = in_flight.pairs()
            asked = len(ids)
            if not ids:
                return
            extended = await store.extend_leases(
                ids=ids, tokens=tokens, seconds=settings.lease_seconds
            )
            if extended < len(ids):
                # Settled meanwhile, or expired and maybe taken over; the settle will tell which.
                log.debug("lease_extension_partial", extended=extended, asked=len(ids))
        finally:
            heartbeats.beat("lease-keeper")

    heartbeats.beat("lease-keeper")
    await every(
        settings.lease_seconds / 3,
        extend,
        log=log,
        failed="lease_extension_failed",
        tolerated=db.RETRIABLE_ERRORS,
        wait_first=phase is None,
        context=lambda: {"rows": asked},
        phase=phase,
    )


async def reclaim(
    store: DispatchStore,
    settings: Settings,
    metrics: OutboxMetrics,
    committed_of: CommittedOf | None = None,
    due: Callable[[], bool] | None = None,
    sweep_due: Callable[[], bool] | None = None,
    phase: float | None = None,
) -> NoReturn:
    """Dead-letter rows whose leases keep expiring; report expired leases awaiting takeover.
    Exactly-once (`committed_of`): those its lost claim had committed are published instead.
    `due` and `sweep_due`: whether this tick runs, and its sweep step (an idle outbox of many
    runs them seldom, dispatch/idle.py). `phase`: its place beside the process's other loops
    (every.spread)."""
    await every(
        settings.reclaim_interval_seconds,
        functools.partial(reclaim_step, store, settings, metrics, committed_of, sweep_due),
        log=log,
        failed="reclaim_failed",
        tolerated=db.RETRIABLE_ERRORS,
        due=due,
        phase=phase,
    )


async def reclaim_step(
    store: DispatchStore,
    settings: Settings,
    metrics: OutboxMetrics,
    committed_of: CommittedOf | None = None,
    sweep_due: Callable[[], bool] | None = None,
) -> None:
    """One step of the reclaimer. Exactly-once reads the progress of the rows it is about to
    dead-letter first, and dead-letters nothing while it cannot (review E13)."""
    if committed_of is None:
        dead = await store.dead_letter_crash_loops(
            max_attempts=settings.max_attempts,
            block_on_dead=settings.dead_letter_policy is DeadLetterPolicy.BLOCK,
        )
        report_crash_loops(dead, metrics)
    else:
        await dead_letter_read_crash_loops(store, settings, metrics, committed_of)
    expired = await store.count_expired_leases()
    if committed_of is not None:
        await settle_crash_loops(store, settings, committed_of)
    if expired:
        log.info("expired_leases_awaiting_takeover", leases=expired)
    if settings.sweep_rows and (sweep_due is None or sweep_due()):
        await sweep_step(store, settings, metrics)


# The ids among these (id, replays) pairs a lost claim committed; the lost claims' owners (fenced
# first).
CommittedOf = Callable[[Sequence[tuple[int, int]], Sequence[str]], Awaitable[set[int]]]
# Crash-loop rows looked at per reclaimer step (each look fences and reads the progress once).
CRASH_LOOPS_AT_ONCE = 500
# Reads of a step whose dead-letter met rows whose leases expired after the read (each read
# again with them); past these, the next step.
CRASH_LOOP_READS = 3


# Rows whose progress was read (after their lost claims' owners were fenced), and which of them
# those claims committed.
Checked = tuple[set[int], set[int]]


async def dead_letter_read_crash_loops(
    store: DispatchStore, settings: Settings, metrics: OutboxMetrics, committed_of: CommittedOf
) -> None:
    """Exactly-once (review E13): the progress of the rows the reclaimer is about to dead-letter
    is read first (their lost claims' owners fenced); then, in one database transaction, they
    are dead-lettered, those their claim committed published and the others dead for good
    (dead_letter_as_read). So a committed row is never shown dead: before, a
    database failure between the dead-letter and the publish left it dead until a later step.
    Nothing is dead-lettered while the progress cannot be read, nor when a row's lease expired
    after the read (read again, at most CRASH_LOOP_READS times a step)."""
    for _ in range(CRASH_LOOP_READS):
        read = await read_crash_loops_first(store, settings, committed_of)
        if read is None or not read[0]:
            return
        try:
            dead, published = await dead_letter_as_read(store, settings, read)
        except _ReadBeforeError:
            log.info("crash_loops_read_again", rows=len(read[0]))
            continue
        report_crash_loops(dead, metrics)
        if published:
            log.warning("crash_loop_rows_found_committed", rows=len(published))
        return


async def dead_letter_as_read(
    store: DispatchStore, settings: Settings, checked: Checked
) -> tuple[list[Row], list[int]]:
    """In one transaction: the crash loops dead-lettered, those of their rows the lost claim
    committed (`checked`: the rows whose progress was read, and those it lists) published at
    once, the others dead for good. The rows dead, the ids published; _ReadBeforeError (nothing
    changed) when the dead-letter met a row whose progress was not read."""
    read, committed = checked
    async with store.transaction() as tx:
        dead = await tx.dead_letter_crash_loops(
            max_attempts=settings.max_attempts,
            block_on_dead=settings.dead_letter_policy is DeadLetterPolicy.BLOCK,
        )
        ids = {int(r["id"]) for r in dead}
        if not ids <= read:
            raise _ReadBeforeError
        found = ids & committed
        published = await tx.crash_loops_published(
            ids=sorted(found), delete_published=settings.delete_on_publish
        )
        await tx.crash_loops_checked(ids=sorted(ids - found))
    return [r for r in dead if int(r["id"]) not in found], published


class _ReadBeforeError(Exception):
    """A crash loop's row whose progress was not read: its dead-letter is rolled back."""


async def read_crash_loops_first(
    store: DispatchStore, settings: Settings, committed_of: CommittedOf
) -> Checked | None:
    """Exactly-once (review E13): the rows the reclaimer would dead-letter now and which of
    them their lost claims committed, read after those claims' owners were fenced; None when
    it cannot be read: nothing is dead-lettered meanwhile (the keys stay as they are, left to
    the reclaimer, until the progress can be read)."""
    rows = await store.crash_loop_candidates(max_attempts=settings.max_attempts)
    if not rows:
        return set(), set()
    ids = {int(r["id"]) for r in rows}
    pairs = sorted({(int(r["id"]), int(r["replays"])) for r in rows})
    owners = sorted({str(r["lease_owner"]) for r in rows if r["lease_owner"] is not None})
    try:
        return ids, await committed_of(pairs, owners)
    except errors.BrokerUnavailableError as exc:
        log.warning("crash_loops_wait_for_progress", rows=len(rows), error=str(exc))
        return None


async def settle_crash_loops(
    store: DispatchStore, settings: Settings, committed_of: CommittedOf
) -> None:
    """Exactly-once (review E13): crash-loop rows dead-lettered with their lease token and not
    decided in the same transaction (by a reclaimer of an earlier release, or of an
    at-least-once dispatcher beside this one): their progress is read (durable: a crash
    meanwhile leaves them to the next step); those in it are published, settled as the lost
    claim's late mark would be (settle_late: a key they blocked goes on); the others are dead
    for good. Rows whose progress cannot be read stay as they are."""
    rows = await store.crash_loops_unsettled(limit=CRASH_LOOPS_AT_ONCE)
    if not rows:
        return
    owners = sorted({str(r["lease_owner"]) for r in rows if r["lease_owner"] is not None})
    try:
        pairs = [(int(r["id"]), int(r["replays"])) for r in rows]
        committed = await committed_of(pairs, owners)
    except errors.BrokerUnavailableError as exc:
        log.warning("crash_loops_wait_for_progress", rows=len(rows), error=str(exc))
        return
    by_token: dict[uuid.UUID, list[Row]] = {}
    for r in rows:
        if int(r["id"]) in committed:
            by_token.setdefault(r["lease_token"], []).append(r)
    for token, found in by_token.items():
        await store.settle(
            token=token,
            owner=str(found[0]["lease_owner"]),
            ids=[int(r["id"]) for r in found],
            keys=[r["ordering_key"] for r in found],
            outcomes=["published"] * len(found),
            errors=[None] * len(found),
            delays=[0.0] * len(found),
            counted=[0] * len(found),
            delete_published=settings.delete_on_publish,
            block_on_dead=settings.dead_letter_policy is DeadLetterPolicy.BLOCK,
        )
    await store.crash_loops_checked(
        ids=[int(r["id"]) for r in rows if int(r["id"]) not in committed]
    )
    if committed:
        log.warning("crash_loop_rows_found_committed", rows=len(committed))


def report_crash_loops(dead: list[Row], metrics: OutboxMetrics) -> None:
    for row in dead:
        metrics.dead_lettered.labels(row["topic"] or "(routed)", "crash_loop").inc()
        log.error(
            "dead_lettered_crash_loop",
            id=row["id"],
            event_id=str(row["event_id"]),
            topic=row["topic"],
            last_owner=row["lease_owner"],
        )


async def sweep_step(store: DispatchStore, settings: Settings, metrics: OutboxMetrics) -> bool:
    """One step of the sweep; another dispatcher's step or a claim's discovery in progress
    makes it a no-op this time. Whether it finished a pass over the table."""
    try:
        repaired, wrapped = await store.sweep(
            rows=settings.sweep_rows, hold_seconds=settings.lease_seconds
        )
    except db.RETRIABLE_ERRORS as exc:
        log.warning("sweep_failed", error=repr(exc))
        return False
    if repaired:
        metrics.sweep_repaired.inc(repaired)
        log.warning(
            "sweep_found_stray_rows",
            keys=repaired,
            consequence=(
                "pending rows reached the table around the claim engine's bookkeeping (ids "
                "written below its cursor, a restore or key update with triggers off); they are "
                "claimed now, later than their commit. docs/writers.md says which writes do this"
            ),
        )
    if wrapped:
        metrics.sweep_passes.inc()
    return wrapped
