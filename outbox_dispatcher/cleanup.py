"""Retention: delete published rows older than retention_seconds, in short batches.

A hot queue table stays small only if published rows leave it. Each batch is one statement (its own
transaction) over the next cleanup_batch_size rows by id, so no lock or snapshot is held for long
and the WAL comes in small bursts; the walk stops at the first window with no row created before
the cutoff, so a run costs the old rows it finds plus one window, not a scan of the table. Pending
and dead rows are never deleted. Vacuum (autovacuum with the table's own settings) reclaims the
space; docs/operations.md says which.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.store import Row, StoreBase

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Swept:
    deleted: int
    batches: int
    rows_examined: int


async def delete_published(
    store: StoreBase,
    older_than_seconds: float,
    batch_size: int,
    progress: Callable[[int], object] | None = None,
) -> Swept:
    """Delete rows published more than `older_than_seconds` ago, one window of `batch_size`
    rows per transaction, until the windows hold nothing older than the cutoff."""
    after = 0
    deleted = batches = examined = 0
    while True:
        row = await store.cleanup_window(
            after=after, older_than_seconds=older_than_seconds, limit=batch_size
        )
        if row["last_id"] is None:
            break
        batches += 1
        after = row["last_id"]
        deleted += row["deleted"]
        examined += row["seen"]
        if progress is not None:
            progress(row["deleted"])
        if walk_ends(row, batch_size):
            break
    return Swept(deleted=deleted, batches=batches, rows_examined=examined)


def walk_ends(window: Row, batch_size: int) -> bool:
    """Whether a walk stops after this window: the table ended, or the window held no row
    created before the cutoff (the rest of the table is younger)."""
    return bool(window["seen"] < batch_size or not window["older_rows"])


async def retention_step(store: StoreBase, settings: Settings) -> None:
    """One run of retention (the supervisor runs it every cleanup_interval_seconds): delete
    published rows past retention_seconds, and say how many."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    swept = await delete_published(store, settings.retention_seconds, settings.cleanup_batch_size)
    if swept.deleted:
        log.info(
            "retention_deleted",
            rows=swept.deleted,
            batches=swept.batches,
            rows_examined=swept.rows_examined,
            older_than_seconds=settings.retention_seconds,
            seconds=round(loop.time() - started, 3),
        )
