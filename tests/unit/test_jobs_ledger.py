"""The ledger of an operator action counts a batch only once its transaction committed: a stop
that cancels the commit (SIGTERM of a console mid-requeue) must not close the audit record one
batch ahead of the rows changed (a CI run read 1,750 rows recorded for 1,700 requeued)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from outbox_dispatcher.operate import jobs


class _Store:
    async def audit_progress(self, **_: Any) -> bool:
        return False  # not aborting

    async def audit_aborting(self, **_: Any) -> bool:
        return False


class _Session:
    """Transactions whose commit is cancelled from the `cancel_at`-th on."""

    def __init__(self, cancel_at: int) -> None:
        self.store = _Store()
        self.commits = 0
        self.cancel_at = cancel_at

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[None]:
        yield
        self.commits += 1
        if self.commits >= self.cancel_at:
            raise asyncio.CancelledError  # the stop lands on the commit: rolled back


async def walk_until_stopped(session: _Session, ledger: jobs.Ledger) -> None:
    """Batches of 50 rows until a commit is cancelled."""

    async def step(after: int, limit: int) -> jobs.Batch:
        return jobs.Batch(last_id=after + limit, rows=limit, first_id=after + 1)

    with pytest.raises(asyncio.CancelledError):
        await jobs.walk(session, step, ledger, 50, atomic=False, cap=None, advance=None)  # type: ignore[arg-type]


async def test_a_batch_whose_commit_was_cancelled_is_not_counted() -> None:
    session = _Session(cancel_at=3)
    ledger = jobs.Ledger(session, 1)  # type: ignore[arg-type]

    await walk_until_stopped(session, ledger)
    assert ledger.rows == 100, "two batches committed; the third was rolled back"
    assert (ledger.first_id, ledger.last_id) == (1, 100)


async def test_after_a_stop_the_ledger_takes_the_count_its_record_holds() -> None:
    """A stop can land on a commit that went through: the batch and its record's count are
    committed, the process never learns it. Its count is then one batch short, and the operator
    was told so ("requeued 300" for 350 requeued and recorded, a CI run): after a stop the
    ledger takes the record's count, which each batch writes in its own transaction."""
    session = _Session(cancel_at=3)
    recorded = {"rows": 150}  # the third batch's commit went through as the stop landed

    async def audit_rows(**_: Any) -> int:
        return recorded["rows"]

    session.store.audit_rows = audit_rows  # type: ignore[attr-defined]
    ledger = jobs.Ledger(session, 1)  # type: ignore[arg-type]

    await walk_until_stopped(session, ledger)
    assert ledger.rows == 100, "the process's own count: the commits it saw"
    await ledger.recount()
    assert ledger.rows == 150, "the record's: the third commit went through"
    recorded["rows"] = 100  # had it been rolled back, the record says so too
    await ledger.recount()
    assert ledger.rows == 100
