"""The exactly-once wing's store seam (kafka/exactly_once/store.ProgressStore) over the
dispatcher's store: what a takeover, the lanes and the retirement of progress records ask of the
outbox table, each one named statement of store.DispatchStore. Here rather than in store/ or the
wing because neither may import the other (tests/unit/test_layers.py): the loop knows both."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from outbox_dispatcher import errors, metrics, registry
from outbox_dispatcher.kafka.exactly_once.lanes import Registered
from outbox_dispatcher.kafka.exactly_once.progress import Pair, ProgressConfig
from outbox_dispatcher.kafka.exactly_once.publisher import TransactionalPublisher
from outbox_dispatcher.kafka.exactly_once.store import Silent
from outbox_dispatcher.kafka.publisher import PublisherConfig
from outbox_dispatcher.models import OutboxRecord
from outbox_dispatcher.store import DispatchStore, db

# Silent dispatchers read per sweep of dead dispatchers' progress keys (those not forgotten yet).
SILENT_AT_ONCE = 1000


class TableProgressStore(registry.TableRegistry):
    """One dispatcher's (`owner`) ProgressStore over its table: the registry's rows, and the
    rows, duties and identity the progress records speak of."""

    def __init__(self, store: DispatchStore, owner: str) -> None:
        super().__init__(store, owner)

    async def pending(self, pairs: list[Pair], identity: str) -> list[OutboxRecord]:
        ids, replays = _split(pairs)
        rows = await self._store.pending_rows(ids=ids, replays=replays, identity=identity)
        return [OutboxRecord.from_row(row) for row in rows]

    async def reconciled(self, keys: list[tuple[str, bool]]) -> int:
        try:
            return await self._store.reconciled(
                owner=self.owner, keys=[k for k, _ in keys], keyless=[kl for _, kl in keys]
            )
        except db.RETRIABLE_ERRORS as exc:
            raise errors.DatabaseUnavailableError(errors.describe(exc)) from exc

    async def needed(self, pairs: list[Pair]) -> tuple[str, set[int]]:
        ids, replays = _split(pairs)
        row = await self._store.progress_needed(ids=ids, replays=replays)
        return str(row["identity"]), {int(i) for i in row["needed"]}

    async def beating(self) -> set[str]:
        rows = await self._store.transactional_ids_live(live_seconds=registry.LIVE_SECONDS)
        return {t for r in rows for t in r["transactional_ids"] or ()}

    async def running(self) -> list[Registered]:
        rows = await self._store.transactional_ids_live(live_seconds=registry.LIVE_SECONDS)
        return registry.registered(rows)

    async def silent(self) -> list[Silent]:
        rows = await self._store.transactional_ids_silent(
            live_seconds=registry.LIVE_SECONDS, limit=SILENT_AT_ONCE
        )
        return [
            Silent(str(r["owner"]), r["heartbeat_at"], tuple(r["transactional_ids"]), r["named"])
            for r in rows
        ]

    async def forget(self, silent: Silent, ids: Sequence[str]) -> bool:
        return await self._store.transactional_ids_forget(
            owner=silent.owner, heartbeat_at=silent.heartbeat, ids=ids
        )

    async def unsettled(self) -> int:
        return await self._store.unsettled_work()


async def transactional_publisher(
    store: DispatchStore,
    heartbeat: registry.Heartbeat,
    config: PublisherConfig,
    progress: ProgressConfig,
    *,
    owner: str,
    lane_count: int,
    counted: metrics.Metrics,
) -> TransactionalPublisher:
    """Exactly-once's publisher of one outbox table (not started), as the single-table
    dispatcher and each outbox of many (dispatch/fleet_delivery.py) make it: registered first
    (its heartbeat), since its lanes record their ids in its registry row before the first
    transaction of each, and a takeover fences what it finds there (takeover.py); the table in
    its transactional ids (`progress.outbox`, "<schema>.<table>", and the table's oid, as
    before schema version 16); its identity in its progress records (a uuid the schema keeps,
    read again at every takeover: store.outbox_identity)."""
    await heartbeat.beat()
    outbox = f"{progress.outbox}@{await store.outbox_oid()}"
    return TransactionalPublisher(
        config,
        dataclasses.replace(progress, outbox=outbox),
        owner,
        TableProgressStore(store, owner),
        await store.outbox_identity(),
        lane_count=lane_count,
        renewed=lambda reason: counted.lanes_renewed.labels(reason).inc(),
        waiting=lambda reason: counted.takeovers_waiting.labels(reason).inc(),
        fence_failed=counted.fences_failed.inc,
    )


def _split(pairs: Sequence[Pair]) -> tuple[list[int], list[int]]:
    """(id, replays) pairs as the statements take them: the ids, and their replay counts."""
    return [i for i, _ in pairs], [r for _, r in pairs]
