"""The batched idle probe's loop (issue 36): one per database of the sources, every idle
interval, asking the database's served outboxes in one statement (store/probe.py, per chunk)
which of them have work or an expired lease; only the idle ones it names are woken for a claim.
Why no row is left behind: dispatch/idle.py.

Beside it, the announcements of the outboxes that were active a moment ago are kept fresh
(writers notify them at once); a long-idle outbox's announcement lapses, so its writers stop
paying for notifications, and the probe finds its next row within an interval. An outbox at a
version before the steady claim, and every idle outbox of a database whose probe failed, is
claimed once instead (the poll of old: an empty claim each)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
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


class IdleProbe:
    """The probe of one database's outboxes served by this process."""

    def __init__(
        self, database: str, slots: ClaimSlots, settings: Settings, interval: float
    ) -> None:
        self.database = database
        self._slots = slots
        self._interval = interval
        self._takes_blocked = settings.dead_letter_policy is not DeadLetterPolicy.BLOCK
        self._failing = False
        self.probes = 0  # statements run (for tests)

    async def run(self) -> NoReturn:
        while True:
            await asyncio.sleep(self._interval)
            await self.once()

    def _served(self) -> list[OutboxRuntime]:
        """This database's served outboxes, in a stable order: the statement stays the same
        while the set served does (its plan is cached per connection)."""
        served = self._slots.outboxes.values()
        return sorted((o for o in served if o.outbox.database == self.database), key=_key)

    async def once(self) -> None:
        served = self._served()
        if not served:
            return
        idle = self._slots.idle()
        steady = [o for o in served if o.steady]
        self._slots.poll(o.key for o in served if not o.steady and o.key in idle)
        woken = await self._probe(steady, idle) if steady else set()
        for runtime in served:
            if runtime.key in idle and runtime.key not in woken and runtime.pace.active:
                await self._keep_announced(runtime)

    async def _probe(self, steady: Sequence[OutboxRuntime], idle: set[Key]) -> set[Key]:
        tables = [(o.outbox.schema, o.outbox.table) for o in steady]
        try:
            found = await statements.probe(
                steady[0].pool, tables, takes_blocked=self._takes_blocked
            )
        except FAILURES as exc:
            if not self._failing:
                log.info("idle_probe_failed", database=self.database, error=errors.describe(exc))
            self._failing = True
            self._slots.poll(o.key for o in steady if o.key in idle)
            return set()
        self._failing = False
        self.probes += 1
        woken: set[Key] = set()
        for f in found:
            runtime = steady[f.index]
            if f.expired:
                runtime.pace.want()  # the reclaimer's duty, at its next tick
            if runtime.key in idle:
                self._slots.wake(runtime.key)
                woken.add(runtime.key)
        return woken

    async def _keep_announced(self, runtime: OutboxRuntime) -> None:
        """Refresh the wait of an outbox active a moment ago (a statement every ttl/2); one
        whose announcement had lapsed is claimed once more (rows committed before it sent no
        notification)."""
        if await runtime.idle():
            self._slots.wake(runtime.key)


def _key(runtime: OutboxRuntime) -> Key:
    return runtime.key
