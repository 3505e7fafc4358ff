"""Each dispatcher records itself, its dead-letter policy and a heartbeat in <table>_dispatchers,
so that `status`, run anywhere, can say whether any dispatcher is alive and count blocked keys
under the policy the dispatchers run with (not the operator's own environment)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import structlog

from outbox_dispatcher import errors
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.kafka.exactly_once.lanes import Registered, WorkKeys
from outbox_dispatcher.store import DispatchStore, Row, db, migrations

log = structlog.get_logger(__name__)

# The database is away, or the dispatcher role lacks the grants of a newer roles.sql.
_TOLERATED: tuple[type[BaseException], ...] = (
    *db.RETRIABLE_ERRORS,
    db.InsufficientPrivilegeError,
)

HEARTBEAT_SECONDS = 10.0
# A dispatcher whose heartbeat is older than this is taken for dead (three missed beats).
LIVE_SECONDS = 3 * HEARTBEAT_SECONDS + 5
# Exactly-once: a takeover fences as it can the other dispatchers with a heartbeat this recent
# (so that their open transactions do not hold the progress partition: the broker aborts an
# older one's at its timeout). The owners whose claims it stands in for it fences whatever their
# heartbeat's age (`lost_owners`).
FENCE_WINDOW_SECONDS = 3600.0


# Rows published and dead-lettered since the process started (Metrics.totals).
Counters = Callable[[], tuple[int, int]]


class Heartbeat:
    """One beat: upsert this dispatcher's row, with the schema version it runs and, once the
    schema keeps them, its counters (version 12) and its delivery mode (version 14). The
    supervisor beats every HEARTBEAT_SECONDS; a failure is logged once, never fatal: the registry
    only informs operators."""

    TOLERATED = _TOLERATED
    HINT = (
        "the dispatcher role needs the grants of schema/roles.sql (run it again after "
        "migrating); `status` cannot see this dispatcher until then"
    )

    def __init__(
        self,
        store: DispatchStore,
        settings: Settings,
        owner: str,
        counters: Counters = lambda: (0, 0),
    ) -> None:
        self._store = store
        self._owner = owner
        self._policy = settings.dead_letter_policy.value
        self._delivery = settings.delivery.value
        self._counters = counters
        self._schema = 0  # the schema version last seen, until it is DELIVERY_VERSION

    async def beat(self) -> None:
        # A rolling upgrade runs this release on versions 10 to 13 too: no counters before
        # `migrate` applies version 12, no delivery mode before 14; looked for at each beat until
        # the schema has both.
        if self._schema < migrations.DELIVERY_VERSION:
            self._schema = await self._store.schema_version()
        counted = self._schema >= migrations.CONSOLE_VERSION
        await self._store.dispatcher_beat(
            owner=self._owner,
            dead_letter_policy=self._policy,
            version=migrations.latest_version(),
            totals=self._counters() if counted else None,
            delivery=self._delivery if self._schema >= migrations.DELIVERY_VERSION else None,
        )


class TableRegistry:
    """Exactly-once's view of the registry (kafka/exactly_once/lanes.Registry) for dispatcher
    `owner`, over its <table>_dispatchers rows."""

    def __init__(self, store: DispatchStore, owner: str) -> None:
        self._store = store
        self.owner = owner

    async def live(self) -> list[Registered]:
        rows = await self._store.transactional_ids_live(live_seconds=FENCE_WINDOW_SECONDS)
        return registered(rows)

    async def record(self, ids: Sequence[str]) -> None:
        if not await self._store.transactional_ids_record(owner=self.owner, ids=ids):
            msg = "this dispatcher's registry row is gone (its next heartbeat writes it)"
            raise errors.DatabaseUnavailableError(msg)

    async def lost(self, keys: WorkKeys, owners: Sequence[str]) -> list[Registered]:
        rows = await self._store.lost_owners(
            keys=[k for k, _ in keys], keyless=[kl for _, kl in keys], owners=owners
        )
        return registered(rows)


def transactional_registry(store: DispatchStore, owner: str) -> TableRegistry:
    """Exactly-once's view of the registry for dispatcher `owner`."""
    return TableRegistry(store, owner)


def registered(rows: Sequence[Row]) -> list[Registered]:
    """Registry rows as exactly-once names them: owner, delivery mode, recorded ids."""
    return [(str(r["owner"]), r["delivery"], r["transactional_ids"]) for r in rows]
