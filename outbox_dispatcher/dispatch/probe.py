"""The batched idle probe's loop (issue 36): one per database of the sources, every idle
interval, on a connection of its own (store/probe.py `Session`). Only the idle outboxes it names
are woken for a claim. Why no row is left behind: dispatch/idle.py.

Which outboxes it asks: each of them at least every FULL_SECONDS and one interval (the
guarantee: a slice falls due every FULL_SECONDS, and waits for the probe's next run), a slice of
them at each interval in turn (the rotation: one prepared statement a slice); besides, only the
idle outboxes that may have changed: those whose tables were written since their last look, by
PostgreSQL's cumulative statistics (one statement for the whole database, no table opened),
those whose live lease expires or retry falls due by now (the probe said when), those with a
hole whose transactions still ran, and those never looked at. Asking every outbox every interval
cost the database more than the rest of an idle fleet together (0.05-0.1 ms an outbox: each
branch opens its tables).

Beside it, the announcements of the outboxes that were active a moment ago are kept fresh
(writers notify them at once); a long-idle outbox's announcement lapses, so its writers stop
paying for notifications, and the probe finds its next row within an interval (a second or so
more for the statistics). An outbox at a version before the steady claim, and every idle outbox
of a database whose probe failed, is claimed once instead (the poll of old: an empty claim
each)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import NoReturn

import structlog

from outbox_dispatcher import errors
from outbox_dispatcher.config.settings import DeadLetterPolicy, Settings
from outbox_dispatcher.dispatch.outboxes import Key, OutboxRuntime
from outbox_dispatcher.dispatch.slots import ClaimSlots
from outbox_dispatcher.store import db
from outbox_dispatcher.store import probe as statements

log = structlog.get_logger(__name__)

# A probe that fails: a table dropped or broken meanwhile (the registry lets it go at its next
# read), the database away.
FAILURES: tuple[type[BaseException], ...] = (db.PostgresError, *db.RETRIABLE_ERRORS)
# Every served outbox is asked this often (and one interval), whatever the statistics say (a
# writer's counts reach them after its transaction, within a second or so, at most a minute later):
# a slice of them at each interval, in turn. Asking all of them at once every FULL_SECONDS (five
# statements of 100 outboxes back to back, 25-30 ms of a core each on a quiet machine, 100-250 ms
# under load) took a core in bursts, at the spacing of spikes of 80-200 ms in the quiet tenants'
# latency of `make bench` fleet_quiet_* (whose p99 the slices did not measurably change).
FULL_SECONDS = 15.0
KEPT = "probe"  # the slices' statements on the session
MIN_SLICE = 20  # outboxes asked by a statement of the rotation, at least


class IdleProbe:
    """The probe of one database's outboxes served by this process."""

    def __init__(
        self,
        database: str,
        session: statements.Session,
        slots: ClaimSlots,
        settings: Settings,
        interval: float,
        owner: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`owner`: the process's, under which the waits of outboxes at their first look are
        announced (None: they announce their own); `clock`: the rotation's (tests)."""
        self.database = database
        self.session = session
        self._slots = slots
        self._interval = interval
        self._takes_blocked = settings.dead_letter_policy is not DeadLetterPolicy.BLOCK
        self._owner = owner
        self._clock = clock
        self._failing = False
        self._full_due = True  # the next probe asks every outbox (its first, after a failure)
        self._served: tuple[Key, ...] = ()  # the steady outboxes of the last full probe
        self._slices: list[list[int]] = []  # the rotation: places in the served list
        self._turn = 0  # the rotation's next slice
        self._slice_at = 0.0  # when it is due (monotonic)
        self._oids: list[int] = []  # their watched relations
        self._seen: dict[Key, int] = {}  # writes counted at each outbox's last look
        self._due: dict[Key, float] = {}  # when to look again without a write (monotonic)
        self._holes: set[Key] = set()  # a hole of its cursor waited for running transactions
        self._soon = asyncio.Event()  # new outboxes wait for their first look
        self._full_wanted = False  # the next probe asks every outbox
        self.probes = 0  # probes run (for tests)
        self.full_probes = 0  # of them, asking every outbox
        self.looked = 0  # outboxes asked, over all probes

    async def run(self) -> NoReturn:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._soon.wait(), self._interval)
            self._soon.clear()
            await self.once()

    def look_soon(self, *, everything: bool = False) -> None:
        """Probe at once, not at the next interval: outboxes were served that nothing has
        looked at yet (ClaimSlots.add with `probed`), at start or as the registry finds them;
        `everything`: every outbox, not only those the statistics say were written (the LISTEN
        connection was down: notifications may have been missed, store/listen.py)."""
        self._full_wanted = self._full_wanted or everything
        self._soon.set()

    def _served_now(self) -> list[OutboxRuntime]:
        """This database's served outboxes, in a stable order: the full probe's statements stay
        the same while the set served does (prepared once)."""
        served = self._slots.outboxes.values()
        return sorted((o for o in served if o.outbox.database == self.database), key=_key)

    async def once(self) -> None:
        served = self._served_now()
        if not served:
            return
        idle = self._slots.idle()
        steady = [o for o in served if o.steady]
        self._slots.poll(o.key for o in served if not o.steady and o.key in idle)
        if steady:
            await self._announce_first([o for o in steady if o.key in idle])
        woken = await self._probe(steady, idle) if steady else set()
        for runtime in served:
            if runtime.key in idle and runtime.key not in woken and runtime.pace.active:
                await self._keep_announced(runtime)

    async def _announce_first(self, idle: Sequence[OutboxRuntime]) -> None:
        """With LISTEN, the idle outboxes nothing has looked at yet (served since the last
        probe, all of them at start) announce their waits in one statement per 100, before the
        probe looks: a row committed after it is notified, one before it is the probe's to find.
        Without it, a tenant idle at start sent no notification until its first rows were found
        by a later probe (seconds), and with a claim each at start, its wait was announced by
        one statement per outbox."""
        new = [o for o in idle if o.key in self._slots.unlooked and o.waiting is not None]
        if not new or self._owner is None:
            return
        ttl = min(o.waiting.ttl for o in new if o.waiting is not None)
        try:
            await statements.announce(
                self.session,
                [(o.outbox.schema, o.outbox.table) for o in new],
                owner=self._owner,
                seconds=ttl,
            )
        except FAILURES as exc:  # the probe that follows says why; found by probes meanwhile
            log.debug("idle_announce_failed", database=self.database, error=errors.describe(exc))
            return
        for runtime in new:
            if runtime.waiting is not None:
                runtime.waiting.announced()

    async def _probe(self, steady: Sequence[OutboxRuntime], idle: set[Key]) -> set[Key]:
        try:
            looked, found = await self._look(steady, idle)
        except FAILURES as exc:
            if not self._failing:
                log.info("idle_probe_failed", database=self.database, error=errors.describe(exc))
            self._failing = True
            self._full_due = True  # the next probe asks them all
            self._slots.poll(o.key for o in steady if o.key in idle)
            return set()
        self._failing = False
        woken = self._learn(looked, found, idle)
        self._slots.looked(o.key for o in looked)  # after the woken joined the ring
        return woken

    async def _look(
        self, steady: Sequence[OutboxRuntime], idle: set[Key]
    ) -> tuple[Sequence[OutboxRuntime], list[statements.Found]]:
        """Read the statistics, then ask the outboxes to look at: all of them (full: the first
        probe, a change of the set served, a failure or a LISTEN reconnect before), or the
        rotation's next slice and those that may have changed. The statistics are read first: a
        write they do not show yet is shown at the next interval, and its look follows that
        reading."""
        keys = tuple(o.key for o in steady)
        now = self._clock()
        full = self._full_due or keys != self._served or self._full_wanted
        self._full_wanted = False
        tables = [(o.outbox.schema, o.outbox.table) for o in steady]
        if full:  # read again each time: a table dropped and made again has new oids
            self._oids = await statements.relations(self.session, tables)
        counted = await statements.changes(self.session, self._oids)
        counts = None if counted is None else [every for every, _ in counted]
        rows: list[int | None] = [r for _, r in counted] if counted else [None] * len(steady)
        for runtime, written in zip(steady, rows, strict=True):
            runtime.writes = written  # what its idle sweep looks at (OutboxRuntime.sweep)
            runtime.counted = True
        if counts is None:  # the server counts no writes: every outbox, every interval
            full = True
        if full:
            self._forget_gone(keys)
            self._slices = rotation(len(steady), self._interval)
            self._turn, self._slice_at = 0, now + self._step
            self.session.keep_only(
                KEPT,
                {
                    sql
                    for places in self._slices
                    for sql in statements.probe_sqls(
                        [tables[i] for i in places], takes_blocked=self._takes_blocked
                    )
                },
            )
            turns = self._slices
        else:
            turns = self._due_slices(now)
        looked: list[OutboxRuntime] = []
        found: list[statements.Found] = []
        for places in turns:  # each slice a statement kept prepared
            await self._ask([steady[i] for i in places], looked, found, keep=KEPT)
        if not full:  # besides, those that may have changed (planned each time)
            asked = {o.key for o in looked}
            changed = self._changed(steady, idle, counts or [], now)
            await self._ask([o for o in changed if o.key not in asked], looked, found, keep=None)
        if counts is not None:  # an outbox busy meanwhile is asked again once idle
            at = {o.key: n for o, n in zip(steady, counts, strict=True)}
            self._seen.update((o.key, at[o.key]) for o in looked if o.key in idle)
        if full:
            self.full_probes += 1
            self._full_due, self._served = False, keys
        return looked, found

    @property
    def _step(self) -> float:
        """The time between two slices: each asked once every FULL_SECONDS."""
        return FULL_SECONDS / max(1, len(self._slices))

    def _due_slices(self, now: float) -> list[list[int]]:
        """The rotation's slices due by now (one, at the regular pace)."""
        due: list[list[int]] = []
        while now >= self._slice_at and len(due) < len(self._slices):
            due.append(self._slices[self._turn % len(self._slices)])
            self._turn += 1
            self._slice_at += self._step
        if self._slice_at <= now:  # behind (a slow loop): the next one step from now
            self._slice_at = now + self._step
        return due

    async def _ask(
        self,
        outboxes: Sequence[OutboxRuntime],
        looked: list[OutboxRuntime],
        found: list[statements.Found],
        *,
        keep: str | None,
    ) -> None:
        """Probe `outboxes`; append them to `looked` and what was found to `found` (its
        places counted in `looked`)."""
        if not outboxes:
            return
        answers = await statements.probe(
            self.session,
            [(o.outbox.schema, o.outbox.table) for o in outboxes],
            takes_blocked=self._takes_blocked,
            keep=keep,
        )
        offset = len(looked)
        looked.extend(outboxes)
        found.extend(dataclasses.replace(f, index=f.index + offset) for f in answers)
        self.probes += 1
        self.looked += len(outboxes)

    def _changed(
        self, steady: Sequence[OutboxRuntime], idle: set[Key], counts: list[int], now: float
    ) -> list[OutboxRuntime]:
        """The idle outboxes that may have work since their last look."""
        return [
            o
            for o, n in zip(steady, counts, strict=True)
            if o.key in idle
            and (
                self._seen.get(o.key) != n
                or self._due.get(o.key, float("inf")) <= now
                or o.key in self._holes
            )
        ]

    def _learn(
        self, looked: Sequence[OutboxRuntime], found: list[statements.Found], idle: set[Key]
    ) -> set[Key]:
        """Wake the idle outboxes with work; note when to look at each one again."""
        now = self._clock()
        for runtime in looked:
            self._due.pop(runtime.key, None)
            self._holes.discard(runtime.key)
        woken: set[Key] = set()
        for f in found:
            runtime = looked[f.index]
            if f.hole:
                self._holes.add(runtime.key)
            if f.due_in is not None and f.due_in > 0:
                self._due[runtime.key] = now + f.due_in
            if f.expired:
                runtime.pace.want()  # the reclaimer's duty, at its next tick
            if f.found and runtime.key in idle:
                self._slots.wake(runtime.key)
                woken.add(runtime.key)
        return woken

    def _forget_gone(self, keys: tuple[Key, ...]) -> None:
        served = set(keys)
        for book in (self._seen, self._due):
            for key in [k for k in book if k not in served]:
                del book[key]
        self._holes &= served

    async def _keep_announced(self, runtime: OutboxRuntime) -> None:
        """Refresh the wait of an outbox active a moment ago (a statement every ttl/2); one
        whose announcement had lapsed is claimed once more (rows committed before it sent no
        notification)."""
        if await runtime.idle():
            self._slots.wake(runtime.key)


def rotation(outboxes: int, interval: float) -> list[list[int]]:
    """The places 0..outboxes-1 in consecutive slices, one a probe at the regular pace over
    FULL_SECONDS; none larger than a chunk, none but the last smaller than MIN_SLICE (a
    statement each)."""
    turns = max(1, int(FULL_SECONDS // interval)) if interval > 0 else 1
    size = min(statements.CHUNK, max(MIN_SLICE, math.ceil(outboxes / turns)))
    return [list(range(i, min(i + size, outboxes))) for i in range(0, outboxes, size)]


def _key(runtime: OutboxRuntime) -> Key:
    return runtime.key
