"""Operator actions as jobs: each is recorded before it changes anything, and its record is kept
true batch by batch, in each batch's own transaction, so that the record says how many rows the
action changed even when it was cut off (Ctrl-C, a stopped console, a killed pod). An operator may
ask a running action to stop after its current batch (abort), from any console; a second request
with the same key finds the first run instead of starting another.

`Ledger` is one action's record while it runs, `walk` runs a batched action's batches. Both faces
reach them only through `actions.perform`: the CLI in the foreground, the console in the
background (console/jobs.py holds its tasks).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import orjson
import structlog

from outbox_dispatcher import errors
from outbox_dispatcher.operate.session import Session

log = structlog.get_logger(__name__)

# How a record ends; `running` while its action runs (read as `interrupted` once nobody runs it).
RUNNING, DONE, ABORTED, INTERRUPTED, FAILED = "running", "done", "aborted", "interrupted", "failed"
STATUSES = (RUNNING, DONE, ABORTED, INTERRUPTED, FAILED)

# Closing a record after a cancellation must not hang a Ctrl-C or a shutdown.
CLOSE_SECONDS = 5.0

# Rows done by one more batch.
Advance = Callable[[int], object]


class JobLostError(errors.OutboxDispatcherError):
    """The action's record no longer runs (someone closed it): the batch under way is undone."""


class DuplicateRunError(errors.OutboxDispatcherError):
    """A request key that already started an action: `record` is that action's record."""

    def __init__(self, record: int | None) -> None:
        super().__init__(f"this request already started the action of audit record {record}")
        self.record = record


class AbortedError(Exception):
    """An operator asked the action to stop: raised inside a one-transaction action (a replay) so
    that the transaction is rolled back; a batched action keeps its batches and just stops."""


@dataclass(frozen=True)
class Origin:
    """Where an action comes from, for its record. `via` is merged into the audited filter: the
    CLI gives none, the console {"via": "console", "http_client": ...}; `identity` is the person
    the console knows (a trusted proxy's user, or a holder of the token) and `source` how."""

    via: dict[str, object] = field(default_factory=dict)
    identity: str | None = None
    source: str | None = None


@dataclass
class Ledger:
    """The record of one running action: rows changed so far, the ids they lie between, and
    whether an operator asked it to stop."""

    session: Session
    id: int
    rows: int = 0
    first_id: int | None = None
    last_id: int | None = None
    aborting: bool = False
    # The count and ids with the batch given to `batch`, until it committed.
    _pending: tuple[int, int | None, int | None] | None = None

    @classmethod
    async def open(
        cls,
        session: Session,
        command: str,
        audited: dict[str, object],
        origin: Origin,
        *,
        expected: int | None,
        bound: dict[str, object] | None,
        key: str | None,
    ) -> Ledger:
        """Record the action as running (its own transaction: visible at once) and take its
        lock; DuplicateRunError when `key` started one before."""
        store = session.store
        row = await store.audit_open(
            lock=session.audit_lock,
            command=command,
            filter_json=orjson.dumps({**audited, **origin.via}).decode(),
            expected=expected,
            bound_json=None if bound is None else orjson.dumps(bound).decode(),
            identity=origin.identity,
            identity_source=origin.source,
            request_key=key,
        )
        if row is None:
            raise DuplicateRunError(await store.audit_by_request(request_key=key or ""))
        return cls(session, int(row["id"]))

    async def batch(
        self, rows: int, first_id: int | None, last_id: int | None, *, atomic: bool
    ) -> None:
        """One batch done, not yet committed. Outside one transaction for the whole action, the
        record is updated in the batch's transaction (its count is true whatever happens next);
        inside one, it is closed with the transaction (its count is 0 unless that commits). The
        ledger's own count moves only once the batch committed (`committed`): a stop that cancels
        the commit must not leave the count it closes the record with one batch ahead."""
        first = self.first_id if self.first_id is not None else first_id
        last = last_id if last_id is not None and rows else self.last_id
        self._pending = (self.rows + rows, first, last)
        store = self.session.store
        if atomic:
            self.aborting = await store.audit_aborting(id=self.id)
            return
        aborting = await store.audit_progress(
            id=self.id, rows=self.rows + rows, first_id=first, last_id=last
        )
        if aborting is None:
            msg = f"audit record {self.id} was closed while its action ran: the batch is undone"
            raise JobLostError(msg)
        self.aborting = aborting

    def committed(self) -> None:
        """The batch given to `batch` committed: the ledger counts it."""
        if self._pending is not None:
            self.rows, self.first_id, self.last_id = self._pending
            self._pending = None

    async def recount(self) -> None:
        """After a stop or a failure that may have cut off a batch's commit: the count the record
        holds (written in each batch's transaction) is the true one, whichever way that commit
        went; the ledger takes it if it can still read it. Without, a commit that went through
        as its stop landed was left out of what the operator was told (a CI run: "interrupted
        after it requeued 300 dead rows" for 350 requeued and recorded)."""
        try:
            async with asyncio.timeout(CLOSE_SECONDS):
                recorded = await self.session.store.audit_rows(id=self.id)
        except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - its own count stays
            log.warning("audit_recount_failed", record=self.id, error=repr(exc))
            return
        if recorded is not None:
            self.rows, self._pending = recorded, None

    async def close(self, status: str, detail: str, rows: int) -> None:
        await self.session.store.audit_close(
            id=self.id,
            status=status,
            rows=rows,
            detail=detail,
            first_id=self.first_id,
            last_id=self.last_id,
        )

    async def close_quietly(self, status: str, detail: str, rows: int) -> None:
        """Close after an interruption or a failure, if the connection still can: a record left
        running is read as interrupted anyway once its lock is gone."""
        try:
            async with asyncio.timeout(CLOSE_SECONDS):
                await self.close(status, detail, rows)
        except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - the record says it
            log.warning("audit_close_failed", record=self.id, status=status, error=repr(exc))

    async def release(self) -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(CLOSE_SECONDS):
                await self.session.store.audit_release(lock=self.session.audit_lock, id=self.id)


@dataclass(frozen=True)
class Batch:
    """What one batch did: the last id it looked at (None: nothing left), the rows it changed,
    the first of them, and whether it was the last batch."""

    last_id: int | None
    rows: int
    first_id: int | None = None
    final: bool = False


# One batch of ids after `after`, at most `limit` of them.
Step = Callable[[int, int], Awaitable[Batch]]


async def walk(
    session: Session,
    step: Step,
    ledger: Ledger,
    batch_size: int,
    *,
    atomic: bool,
    cap: int | None,
    advance: Advance | None,
) -> int:
    """Run `step` over ids upwards, one transaction per batch (unless the action holds one),
    each batch recorded in `ledger`; never more than `cap` rows (what the operator confirmed).
    Stops when nothing is left or an operator asked it to stop."""
    after = 0
    while cap is None or ledger.rows < cap:
        limit = batch_size if cap is None else min(batch_size, cap - ledger.rows)
        async with contextlib.nullcontext() if atomic else session.transaction():
            batch = await step(after, limit)
            if batch.last_id is None:
                break
            await ledger.batch(batch.rows, batch.first_id, batch.last_id, atomic=atomic)
        ledger.committed()
        if advance is not None:
            advance(batch.rows)
        after = batch.last_id
        if batch.final or ledger.aborting:
            break
    return ledger.rows


def roll_back_if_aborting(ledger: Ledger) -> None:
    """Inside a one-transaction action: an abort undoes it all (AbortedError)."""
    if ledger.aborting:
        raise AbortedError


async def request_abort(session: Session, record: int, by: str | None) -> bool:
    """Ask the action of `record` to stop after its current batch: False when it is not running."""
    return await session.store.audit_abort(id=record, by=by)


async def sweep(session: Session) -> list[int]:
    """Close the records of actions whose process died (nobody holds their lock) as
    interrupted; the records that were."""
    closed = await session.store.audit_sweep(lock=session.audit_lock)
    if closed:
        log.info("audit_interrupted_closed", records=closed)
    return closed
