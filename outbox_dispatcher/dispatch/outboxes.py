"""One outbox of many (OUTBOX_SOURCES, issue 36): what a single-table dispatcher has per table,
its store, claimer, settling, waiting announcement and in-flight rows, and its upkeep loops
(lease keeper, reclaimer, registry heartbeat, retention). Its `claim` leases one batch and its
`run` publishes and settles it; the shared claim slots (dispatch/slots.py) decide whose claim is
next and run each batch on its own, so an outbox may have several batches on their way.

A failure of this outbox (its database away, its schema dropped or broken) is its own: it backs
off alone, logs one line per streak, and never stops the process; anything else is a bug and
does."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, NoReturn

import structlog

from outbox_dispatcher import errors, metrics, registry, source_metrics
from outbox_dispatcher.config.outboxes import Outbox
from outbox_dispatcher.config.settings import DeadLetterPolicy, Settings
from outbox_dispatcher.dispatch import leases, upkeep
from outbox_dispatcher.dispatch.batch import BatchRun, Publishing, Settling
from outbox_dispatcher.dispatch.claimer import Claimer
from outbox_dispatcher.dispatch.every import every
from outbox_dispatcher.dispatch.fleet_delivery import ExactlyOnce, OutboxLanes
from outbox_dispatcher.dispatch.idle import HEARTBEAT_SLOW, RECLAIM_SLOW, SWEEP_SLOW, UpkeepPace
from outbox_dispatcher.dispatch.settler import Settler
from outbox_dispatcher.dispatch.wakeup import Waiting
from outbox_dispatcher.health import Heartbeats
from outbox_dispatcher.metrics import Metrics
from outbox_dispatcher.models import Batch
from outbox_dispatcher.retries import RetryPolicy
from outbox_dispatcher.sources.backoff import Backoff
from outbox_dispatcher.store import DispatchStore, Statements, db, migrations

log = structlog.get_logger(__name__)

Key = tuple[str, str, str]  # (database, schema, table)
Loop = Coroutine[Any, Any, None]


def key_of(outbox: Outbox) -> Key:
    return (outbox.database, outbox.schema, outbox.table)


def channel_of(outbox: Outbox) -> str:
    """The channel its table's trigger notifies (schema.sql: "<schema>.<table>")."""
    return f"{outbox.schema}.{outbox.table}"


@dataclass(frozen=True)
class Claim:
    """What one claim of an outbox gave: its batch (None: nothing, or the claim failed), when
    it began (the loop's clock), whether it was full, whether the claim saw nothing left after
    it (the steady claim says so: the outbox may wait for a notification; otherwise, as a claim
    loop does, it claims again at once: a claim function's partial batch under a backlog, a
    key's share), and how long to back off after a failure of this outbox."""

    batch: Batch | None = None
    started: float = 0.0
    full: bool = False
    drained: bool = True
    retry_in: float | None = None


@dataclass(frozen=True)
class Ran:
    """How a claimed batch's run ended: how long to pause every outbox for a broker outage, or
    how long to back this outbox off after a failure of its own."""

    outage: float = 0.0
    retry_in: float | None = None


@dataclass(frozen=True)
class Shared:
    """What every outbox of the process shares."""

    settings: Settings
    owner: str
    publisher: Publishing
    metrics: Metrics
    retry_policy: RetryPolicy
    idle_poll_seconds: float  # an idle outbox is claimed at least this often
    # exactly-once: each outbox's own publisher is made with it (dispatch/fleet_delivery.py);
    # `publisher` then serves readiness only.
    exactly_once: ExactlyOnce | None = None


class OutboxRuntime:
    """One served outbox: its claims, its batches' runs (publish, settle) and its upkeep
    loops."""

    def __init__(self, outbox: Outbox, pool: db.Pool, version: int, shared: Shared) -> None:
        s = shared.settings
        self.outbox = outbox
        self.key = key_of(outbox)
        self.label = outbox.label
        self.shared = shared
        self.metrics = source_metrics.of(shared.metrics, outbox.label)  # its `source`'s
        statements = Statements.for_table(outbox.schema, outbox.table)
        self.pool = pool
        # At a version the batched idle probe reads (store/probe.sql); older ones are polled.
        self.steady = version >= migrations.STEADY_VERSION
        self.store = DispatchStore(
            pool,
            statements,
            steady=self.steady,
            replays=version >= migrations.STEADY_VERSION,  # the claim returns it from 16
        )
        self.claimer = Claimer(self.store, s, shared.owner)
        settler = Settler(
            self.store,
            retry_for=s.lease_seconds,
            delete_on_publish=s.delete_on_publish,
            owner=shared.owner,
            block_on_dead=s.dead_letter_policy is DeadLetterPolicy.BLOCK,
        )
        self.settling = Settling(settler, shared.retry_policy, self.metrics)
        ttl = 2 * shared.idle_poll_seconds + 5
        self.waiting = Waiting(self.store, shared.owner, ttl=ttl) if s.listen else None
        self.heartbeat = registry.Heartbeat(self.store, s, shared.owner, self.metrics.totals)
        self.in_flight = leases.InFlight()
        eo = shared.exactly_once
        self.lanes: OutboxLanes | None = (
            None
            if eo is None
            else eo.lanes_of(
                self.label, outbox.schema, outbox.table, self.store, self.heartbeat, self.in_flight
            )
        )
        # The writes to its table the statistics count (set by the idle probe at each interval,
        # dispatch/probe.py; None: not known), and their count when its last complete sweep
        # pass began: an idle outbox whose table was not written since sweeps nothing new (the
        # sweep's own writes go to its cursor and work, not counted here).
        self.writes: int | None = None
        self.counted = False  # the probe has read its counts (or found none: track_counts off)
        self._swept: int | None = None
        self._pass_from: int | None = None
        self.pace = UpkeepPace()  # its upkeep's pace: slow while idle (dispatch/idle.py)
        self.backoff = Backoff(s.backoff_initial_seconds, s.backoff_max_seconds)
        # Since when its claims have seen more rows than they took (None: the last saw its end):
        # a backlog that long makes it hot, served by a second member (dispatch/fleet.py).
        self.backlog_since: float | None = None

    @property
    def published(self) -> int:
        return self.settling.published

    async def claim(self) -> Claim:
        """Lease one batch. A failure of this outbox sets `retry_in` instead of raising."""
        with structlog.contextvars.bound_contextvars(source=self.label):  # every line of it
            loop = asyncio.get_running_loop()
            started = loop.time()
            try:
                batch = await self.claimer.claim()
                if batch is None:
                    self.backoff.succeeded()
                    self._saw_backlog(False)
                    return Claim(started=started)
                self.metrics.claim_duration.observe(loop.time() - started)
                self.metrics.claimed.inc(len(batch.records))
                self.pace.busy()
                full = len(batch.records) >= self.shared.settings.batch_size
                if full and self.waiting is not None:
                    await self.waiting.withdraw()  # a backlog: writers can stop notifying
            except db.PostgresError as exc:  # its schema dropped or broken, a grant missing
                return Claim(retry_in=self._failed(exc))
            except db.RETRIABLE_ERRORS as exc:  # its database away
                return Claim(retry_in=self._failed(exc))
            drained = batch.drained and not full
            self._saw_backlog(not drained)
            return Claim(batch, started, full, drained)

    async def run(self, claim: Claim, heartbeat: Callable[[], None]) -> Ran:
        """Publish the claimed batch and settle it (`heartbeat` while the broker is waited
        for). A failure of this outbox sets `retry_in` instead of raising."""
        assert claim.batch is not None  # noqa: S101 (only a claim's batch is run)
        with structlog.contextvars.bound_contextvars(source=self.label):
            try:
                publishing = await self._publishing(claim.batch, claim.started)
                if publishing is None:  # given back: the broker is away for every outbox
                    return Ran(self.shared.retry_policy.outage_delay())
                publisher, claimed_at = publishing
                run = BatchRun(
                    claim.batch,
                    publisher,
                    self.settling,
                    self.in_flight,
                    heartbeat,
                    None,
                    claimed_at,
                )
                outage = await run.run()
            except db.PostgresError as exc:  # its schema dropped or broken under the settle
                return Ran(retry_in=self._failed(exc))
            except db.RETRIABLE_ERRORS as exc:  # its database away
                return Ran(retry_in=self._failed(exc))
            self.backoff.succeeded()
            return Ran(outage)

    def _saw_backlog(self, more: bool) -> None:
        """A claim that saw no more rows ends the backlog, unless batches of this outbox are
        still on their way: their keys are leased, so a claim then sees less than there is
        (several batches in flight lease every key of a backlog over few keys)."""
        if not more:
            if not self.in_flight:
                self.backlog_since = None
        elif self.backlog_since is None:
            self.backlog_since = time.monotonic()

    async def _publishing(self, batch: Batch, started: float) -> tuple[Publishing, float] | None:
        """Its batch's publisher and the claim's time it is to see: the process's, or
        exactly-once's lanes of this outbox, opened first if closed (OutboxLanes.claimed);
        None: they could not be opened, the batch was given back (retried, not counted) and
        the grants pause as for a broker outage."""
        if self.lanes is None:
            return self.shared.publisher, started
        claimed_at = await self.lanes.claimed(started)
        if claimed_at is None:
            await self.settling.settle_stopped(batch, self.lanes.not_opened(len(batch.records)))
            return None
        return self.lanes, claimed_at

    def _failed(self, exc: BaseException) -> float:
        """Back off alone (the delay returned); one warning per streak of failures (no error
        storm while a dropped schema waits to be let go at the registry's next read)."""
        first = self.backoff.failures == 0
        retry_in = self.backoff.failed(time.monotonic())
        emit = log.warning if first else log.debug
        emit(
            "outbox_failed",
            source=self.label,
            error=errors.describe(exc),
            retry_in=round(retry_in, 2),
        )
        return retry_in

    async def idle(self) -> bool:
        """Its last claim found less than a batch and nothing of it is on its way: no backlog
        any more, whatever its earlier claims saw; ask writers to notify (True: the
        announcement is fresh, claim once more, see Waiting.announce)."""
        self.backlog_since = None
        if self.waiting is None:
            return False
        try:
            return await self.waiting.announce()
        except db.PostgresError as exc:  # dropped meanwhile: its next claim backs it off
            log.debug("waiting_announce_failed", source=self.label, error=errors.describe(exc))
            return True

    def loops(self) -> dict[str, Loop]:
        """Its upkeep, by name: what a single-table dispatcher runs beside its claim loops, at
        the pace of `self.pace` (slow while the outbox is idle; the lease keeper costs nothing
        without rows in flight)."""
        s, m, gate = self.shared.settings, self.metrics, self.pace.gate
        # Its own liveness book: the process's liveness is its claim slots'.
        beats = Heartbeats(s.liveness_timeout_seconds)
        # At the steady version an idle outbox's beat is its database's batch (dispatch/beats.py),
        # and its reclaimer runs only when the probe finds an expired lease (UpkeepPace.want):
        # its every duty is a lease that expired, which the probe looks for at each full probe
        # and when a live lease's time comes (dispatch/probe.py).
        idle_beat = math.inf if self.steady else HEARTBEAT_SLOW
        idle_reclaim = math.inf if self.steady else RECLAIM_SLOW
        found: dict[str, Callable[[], Loop]] = {
            "lease-keeper": lambda: leases.keep_leases(self.store, s, self.in_flight, beats),
            "reclaimer": lambda: self._reclaim(
                # at the steady version not even at start: the probe's first full look names
                # the expired leases (their takeover is the claim's anyway)
                gate("reclaimer", s.reclaim_interval_seconds, idle_reclaim, first=not self.steady),
                gate("sweep", s.reclaim_interval_seconds, SWEEP_SLOW),
            ),
            "heartbeat": lambda: upkeep.heartbeat(
                self.heartbeat,
                due=gate("heartbeat", registry.HEARTBEAT_SECONDS, idle_beat),
                source=self.label,
            ),
        }
        if upkeep.wants_retention(s):
            found["retention"] = lambda: upkeep.retention(
                self.store, s, due=gate("retention", s.cleanup_interval_seconds)
            )
        if source_metrics.sampled(m):  # an outbox under source="other" has no table gauges
            found["metrics"] = self._sample_gauges
        if self.lanes is not None:  # exactly-once (dispatch/fleet_delivery.py)
            found["progress-sweep"] = self._sweep_progress
            found["lanes-closer"] = self.lanes.run_closer
        # Each loop starts at a random point of its interval: outboxes served together (all of
        # them at start) would otherwise run their upkeep in one burst every interval, and the
        # quiet outboxes' claims wait behind it for the pool's connections.
        phase = {
            "reclaimer": s.reclaim_interval_seconds,
            "heartbeat": registry.HEARTBEAT_SECONDS,
            "retention": s.cleanup_interval_seconds,
            "metrics": s.metrics_interval_seconds,
        }
        return {
            name: self._isolated(name, make, phase.get(name, 0.0)) for name, make in found.items()
        }

    async def _reclaim(self, due: Callable[[], bool], sweep_due: Callable[[], bool]) -> NoReturn:
        """The reclaimer at the ticks `due` allows, then its sweep step at those `sweep_due`
        allows (its pace is its own: it is the one path for rows written around the claim
        engine's bookkeeping, which no probe sees), each step through `sweep`."""
        s, m = self.shared.settings, self.metrics

        async def tick() -> None:
            if due():
                committed_of = None if self.lanes is None else self.lanes.committed_of
                await leases.reclaim_step(self.store, s, m, committed_of, lambda: False)
            if s.sweep_rows and (self.counted or not self.steady) and sweep_due():
                await self.sweep()  # once its counts are known: a pass it can skip later

        await every(
            s.reclaim_interval_seconds,
            tick,
            log=leases.log,
            failed="reclaim_failed",
            tolerated=db.RETRIABLE_ERRORS,
        )

    async def sweep(self) -> bool:
        """One step of its sweep, unless no write to its table was counted since
        its last complete pass began (whether it ran): the sweep looks for rows written around
        the claim engine's bookkeeping, which are writes the statistics count, and an idle
        outbox's step re-walks its whole table (its function was most of an idle fleet's
        upkeep once the probe and the heartbeat were batched)."""
        writes = self.writes
        if writes is not None and writes == self._swept:
            return False
        if self._pass_from is None:
            self._pass_from = writes
        s = self.shared.settings
        if await leases.sweep_step(self.store, s, self.metrics):
            self._swept, self._pass_from = self._pass_from, None
        return True

    async def _sweep_progress(self) -> NoReturn:
        """Exactly-once: its sweep of dead dispatchers' progress keys, every
        OUTBOX_PROGRESS_SWEEP_SECONDS (jittered by half either way) while it is active, at the
        idle pace otherwise, and only while its lanes are open (OutboxLanes.sweep)."""
        lanes, s = self.lanes, self.shared.settings
        assert lanes is not None  # noqa: S101 (a loop of exactly-once only)
        due = self.pace.gate("progress-sweep", s.progress_sweep_seconds)
        while True:
            await asyncio.sleep(s.progress_sweep_seconds * random.uniform(0.5, 1.5))  # noqa: S311
            if lanes.open and due():
                await lanes.sweep()

    async def _sample_gauges(self) -> NoReturn:
        """Its table gauges under its `source` label, every metrics interval while the outbox is
        active, at the idle pace otherwise (an idle outbox's gauges change only when the probe
        finds work, which makes it active: its three statements per interval were most of an
        idle fleet's cost)."""
        s = self.shared.settings
        block = s.dead_letter_policy is DeadLetterPolicy.BLOCK
        await every(
            s.metrics_interval_seconds,
            lambda: metrics.sample(self.store, self.metrics, block_on_dead=block),
            log=metrics.log,
            failed="metrics_sample_failed",
            tolerated=metrics.SAMPLE_ERRORS,
            wait_first=False,
            due=self.pace.gate("metrics", s.metrics_interval_seconds),
        )

    async def _isolated(self, name: str, make: Callable[[], Loop], phase: float) -> NoReturn:
        """An upkeep loop, started after a random part of `phase`, that a failure of this
        outbox's table (dropped, broken) pauses and restarts on its backoff, instead of stopping
        the process; it ends when the outbox is let go (cancelled)."""
        backoff = Backoff(self.shared.settings.backoff_initial_seconds, 60.0)
        structlog.contextvars.bind_contextvars(source=self.label)  # this task's lines only
        await asyncio.sleep(random.uniform(0, phase))  # noqa: S311 - spreading, not secrecy
        while True:
            try:
                await make()
            except db.PostgresError as exc:
                delay = backoff.failed(time.monotonic())
                emit = log.warning if backoff.failures == 1 else log.debug
                emit("outbox_loop_failed", source=self.label, loop=name, error=errors.describe(exc))
                await asyncio.sleep(delay)
