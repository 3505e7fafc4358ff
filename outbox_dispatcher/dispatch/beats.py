"""The registry heartbeat of a database's idle outboxes (OUTBOX_SOURCES, issue 36): one
statement per chunk of its served outboxes (store/heartbeats.py) every BATCH_SECONDS, on the idle
probe's connection, instead of a statement per outbox, each prepared again at each beat. An
outbox active a moment ago beats on its own as well, every HEARTBEAT_SECONDS (its counters fresh
for the console, dispatch/outboxes.py).

`status` counts a dispatcher live for registry.LIVE_SECONDS after its beat: BATCH_SECONDS leaves
a tick of margin. A batch that fails (a tenant's table broken, a grant missing) beats each of its
outboxes alone, so one outbox's fault costs no other its liveness."""

from __future__ import annotations

import asyncio
from typing import Final, NoReturn

import structlog

from outbox_dispatcher import errors, registry
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.outboxes import OutboxRuntime
from outbox_dispatcher.dispatch.slots import ClaimSlots
from outbox_dispatcher.store import db, heartbeats, migrations
from outbox_dispatcher.store.probe import Session

log = structlog.get_logger(__name__)

BATCH_SECONDS: Final = registry.LIVE_SECONDS - registry.HEARTBEAT_SECONDS
FAILURES: tuple[type[BaseException], ...] = (db.PostgresError, *db.RETRIABLE_ERRORS)


class BatchedHeartbeat:
    """The heartbeat of one database's served outboxes at the steady version."""

    def __init__(
        self, database: str, session: Session, slots: ClaimSlots, settings: Settings, owner: str
    ) -> None:
        self.database = database
        self._session = session
        self._slots = slots
        self._owner = owner
        self._policy = settings.dead_letter_policy.value
        self._delivery = settings.delivery.value
        self._failing = False
        self.beats = 0  # batches run (for tests)

    async def run(self) -> NoReturn:
        while True:
            await asyncio.sleep(BATCH_SECONDS)
            await self.once()

    def covered(self) -> list[OutboxRuntime]:
        """Its outboxes, in a stable order (the statement stays the same while they do)."""
        served = self._slots.outboxes.values()
        mine = (o for o in served if o.outbox.database == self.database and o.steady)
        return sorted(mine, key=lambda o: o.key)

    async def once(self) -> None:
        covered = self.covered()
        tables = [(o.outbox.schema, o.outbox.table) for o in covered]
        self._session.keep_only(heartbeats.KEPT, heartbeats.statements_of(tables))
        if not covered:
            return
        try:
            await heartbeats.beat(
                self._session,
                tables,
                [o.metrics.totals() for o in covered],
                owner=self._owner,
                dead_letter_policy=self._policy,
                version=migrations.latest_version(),
                delivery=self._delivery,
            )
        except FAILURES as exc:
            if not self._failing:
                log.info("heartbeats_failed", database=self.database, error=errors.describe(exc))
            self._failing = True
            await self._each_alone(covered)
            return
        self._failing = False
        self.beats += 1

    async def _each_alone(self, covered: list[OutboxRuntime]) -> None:
        """Each outbox's own beat (through its pool), its failure its own (logged at debug: its
        claims and upkeep say more)."""
        for runtime in covered:
            try:
                await runtime.heartbeat.beat()
            except FAILURES as exc:
                log.debug("heartbeat_failed", source=runtime.label, error=errors.describe(exc))
