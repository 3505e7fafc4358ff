"""The operator's actions and the one flow both faces run them through.

`perform` is that flow: refuse what must not run, count what would change (and fix the bound of
what was counted), ask (a hook: the CLI asks on a terminal; the console's confirmation page is its
own question, and its bound comes back with the answer), record the action as running, act batch
by batch with the record kept true (jobs.py), close the record (done, aborted, interrupted,
failed), wake idle dispatchers, describe. Each action says only what is its own: its refusal, its
count, its statement, its audit filter and its words (text.py).

Every action is safe while dispatchers run. Dead and published rows are never leased, so the
actions that change them cannot race a dispatcher's publish; each works in batches of
`batch_size` rows within the bound its count fixed. Pauses live in a table the claim reads; rows
already claimed when a pause commits are still published. docs/operations.md says more.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from outbox_dispatcher import cleanup, errors
from outbox_dispatcher.operate import jobs, text
from outbox_dispatcher.operate.filters import FIELDS, Bound, Filters, Names, refusal
from outbox_dispatcher.operate.jobs import Advance, Batch, Ledger, Origin
from outbox_dispatcher.operate.session import Session
from outbox_dispatcher.store import OperatorStore, Row

__all__ = ["Advance", "Origin"]

# What shows an action's advance, given the rows it is expected to change (None: not counted).
Progress = Callable[[int | None], AbstractContextManager[Advance]]
# Go on? Given what the count found and the action's question (None: it asks nothing).
Confirm = Callable[[int | None, str | None], bool]
# Told the action's record once it is open (the console answers the request with it).
Opened = Callable[[Ledger], object]


class ActionRefusedError(errors.OutboxDispatcherError):
    """The action was refused: it would change more than was asked for, or cannot be done."""

    def __init__(self, message: str, *, usage: bool = True) -> None:
        super().__init__(message)
        self.message = message
        self.usage = usage  # the request itself is wrong (the CLI exits 2), not the situation


class Action(Protocol):
    """One operator action, built from one command's or request's inputs. An action may keep
    what its count and run saw (a pause's time, the rows that wait) for its description."""

    @property
    def command(self) -> str:
        """Its name in the audit: "dead requeue"."""

    @property
    def wakes(self) -> bool:
        """Whether the rows it changed are pending again (idle dispatchers are woken)."""

    @property
    def atomic(self) -> bool:
        """Whether it acts in one transaction (else each batch commits)."""

    def refusal(self) -> ActionRefusedError | None: ...

    def question(self, matching: int | None) -> str | None: ...

    async def count(self, session: Session) -> int | None: ...

    async def run(self, session: Session, ledger: Ledger, advance: Advance | None) -> int: ...

    def audited(self) -> dict[str, object]: ...

    def confirmed(self) -> Bound | None: ...

    def describe(self, rows: int, *, dry_run: bool) -> str: ...

    async def after_commit(self, session: Session) -> bool:
        """Look again once the change is visible to everyone (a pause counts again); whether
        its description changed (the audit record keeps the one its transaction wrote)."""


@dataclass(frozen=True)
class ActionResult:
    """What an action did (or, as a dry run, would do): `rows` changed, or that would change."""

    command: str
    rows: int
    dry_run: bool
    detail: str
    matching: int | None = None  # what the count found before acting (None: not counted)
    done: bool = True  # False: a dry run, or not confirmed
    bound: Bound | None = None  # what the count fixed, for the confirmation to carry back
    record: int | None = None  # its audit record
    status: str = jobs.DONE

    def as_json(self) -> dict[str, object]:
        found: dict[str, object] = {
            "command": self.command,
            "rows": self.rows,
            "dry_run": self.dry_run,
            "detail": self.detail,
        }
        if self.bound is not None:
            found["bound"] = self.bound.as_json()
        if self.record is not None:
            found.update(record=self.record, status=self.status)
        return found

    def logged(self) -> dict[str, object]:
        """The fields of its log line."""
        return {
            "command": self.command,
            "rows": self.rows,
            "status": self.status,
            "record": self.record,
        }


def refuse(action: Action) -> None:
    """Raise the action's refusal, if any: callers check before they connect, perform again."""
    refused = action.refusal()
    if refused is not None:
        raise refused


async def perform(
    action: Action,
    session: Session,
    *,
    dry_run: bool = False,
    progress: Progress | None = None,
    origin: Origin | None = None,
    confirm: Confirm | None = None,
    key: str | None = None,
    opened: Opened | None = None,
) -> ActionResult:
    """Count -> confirm -> record -> act batch by batch -> close -> wake -> describe; a dry
    run stops after counting. `key`: a second call with it finds the first run
    (jobs.DuplicateRunError)."""
    refuse(action)
    matching = await action.count(session)
    bound = action.confirmed()
    if dry_run or (confirm is not None and not confirm(matching, action.question(matching))):
        rows = matching or 0
        detail = action.describe(rows, dry_run=True)
        return ActionResult(action.command, rows, dry_run, detail, matching, False, bound)
    ledger = await Ledger.open(
        session,
        action.command,
        action.audited(),
        origin or Origin(),
        expected=matching,
        bound=None if bound is None else bound.as_json(),
        key=key,
    )
    if opened is not None:
        opened(ledger)
    try:
        with progress(matching) if progress else contextlib.nullcontext() as advance:
            status, rows, detail = await _act(action, session, ledger, advance)
    except (asyncio.CancelledError, KeyboardInterrupt):
        rows = await _rows_kept(action, ledger)
        await ledger.close_quietly(jobs.INTERRUPTED, text.interrupted(action.command, rows), rows)
        raise
    except BaseException as exc:
        rows = await _rows_kept(action, ledger)
        await ledger.close_quietly(jobs.FAILED, errors.describe(exc), rows)
        raise
    finally:
        await ledger.release()
    if status == jobs.DONE and await action.after_commit(session):
        detail = action.describe(rows, dry_run=False)
    if rows and action.wakes:
        await session.store.wake(channel=session.channel)
    return ActionResult(
        action.command, rows, False, detail, matching, True, bound, ledger.id, status
    )


async def _rows_kept(action: Action, ledger: Ledger) -> int:
    """What an action cut off or failed had changed and kept: none of one transaction; its
    committed batches otherwise, as its record counts them (Ledger.recount)."""
    if action.atomic:
        return 0
    await ledger.recount()
    return ledger.rows


async def _act(
    action: Action, session: Session, ledger: Ledger, advance: Advance | None
) -> tuple[str, int, str]:
    """Run the action and close its record: in the action's one transaction if it has one (an
    abort then rolls it all back), else after its last batch. How it ended, its rows, its words."""
    if not action.atomic:
        rows = await action.run(session, ledger, advance)
        detail = action.describe(rows, dry_run=False)
        status = jobs.ABORTED if ledger.aborting else jobs.DONE
        detail = text.aborted(detail) if ledger.aborting else detail
        await ledger.close(status, detail, rows)
        return status, rows, detail
    try:
        async with session.transaction():
            rows = await action.run(session, ledger, advance)
            jobs.roll_back_if_aborting(ledger)
            detail = action.describe(rows, dry_run=False)
            await ledger.close(jobs.DONE, detail, rows)
    except jobs.AbortedError:
        detail = text.aborted(action.describe(0, dry_run=False), atomic=True)
        await ledger.close(jobs.ABORTED, detail, 0)
        return jobs.ABORTED, 0, detail
    return jobs.DONE, rows, detail


def _batch(row: Row) -> Batch:
    return Batch(row["last_id"], row["rows"], row["first_id"])


# --- rows a filter selects ----------------------------------------------------------------------


@dataclass
class _Filtered:
    """An action over the rows its filters select, walked in batches of `batch_size` ids within
    its bound: the one the operator confirmed, or the one its count fixes."""

    filters: Filters
    batch_size: int
    everything: bool = False  # every such row, on purpose (--all, "all": true)
    names: Names = FIELDS
    bound: Bound | None = None
    command = ""  # as typed: "dead requeue"
    verb = ""  # requeue, discard, replay
    noun = ""  # the rows it changes: "dead row"
    asks = False  # whether it asks before changing every such row
    replays = False  # published rows (the replay filters), not dead ones
    wakes = False
    atomic = False

    def refusal(self) -> ActionRefusedError | None:
        problem = refusal(
            self.filters,
            everything=self.everything,
            what=f"{self.verb} {self.noun}s",
            names=self.names,
            replay=self.replays,
        )
        return None if problem is None else ActionRefusedError(problem)

    def question(self, matching: int | None) -> str | None:
        if not (self.asks and self.everything):
            return None
        return f"{self.verb} all {text.rows(matching or 0, self.noun)}?"

    def _values(self, bound: Bound | None) -> dict[str, object]:
        filters = self.filters
        return filters.replay_values(bound) if self.replays else filters.dead_values(bound)

    async def count(self, session: Session) -> int | None:
        """Without a bound: count, and fix the bound (the rows counted). With one: count within
        it, refused if more rows match there than were confirmed."""
        store = session.store
        if self.bound is None:
            bounding = store.replay_bound if self.replays else store.dead_bound
            row = await bounding(filters=self._values(None))
            self.bound = Bound(max_id=row["max_id"] or 0, before=row["before"], rows=row["rows"])
            return self.bound.rows
        counting = store.replay_count if self.replays else store.dead_count
        matching = await counting(filters=self._values(self.bound))
        if matching > self.bound.rows:
            problem = text.more_than_confirmed(matching, self.bound.rows, self.noun)
            raise ActionRefusedError(problem, usage=False)
        return matching

    def confirmed(self) -> Bound | None:
        return self.bound

    async def after_commit(self, session: Session) -> bool:
        return False

    async def run(self, session: Session, ledger: Ledger, advance: Advance | None) -> int:
        batch_of = self._step(session.store)
        values = self._values(self.bound)

        async def step(after: int, limit: int) -> Batch:
            return _batch(await batch_of(filters=values, after=after, limit=limit))

        cap = None if self.bound is None else self.bound.rows
        return await jobs.walk(
            session, step, ledger, self.batch_size, atomic=self.atomic, cap=cap, advance=advance
        )

    def _step(self, store: OperatorStore) -> Callable[..., Any]:
        """The store's statement of one batch, named like the command ("dead requeue")."""
        return getattr(store, self.command.replace(" ", "_"))  # type: ignore[no-any-return]

    def audited(self) -> dict[str, object]:
        return {**self.filters.as_json(), **({"all": True} if self.everything else {})}

    def describe(self, rows: int, *, dry_run: bool) -> str:
        return text.changed(self.verb, rows, self.noun, dry_run=dry_run)


class _DeadChange(_Filtered):
    noun = "dead row"


class DeadRequeue(_DeadChange):
    """Make matching dead rows pending again (attempts 0, due now)."""

    command = "dead requeue"
    verb = "requeue"
    wakes = True


class DeadDiscard(_DeadChange):
    """Delete matching dead rows; every dead row only after asking."""

    command = "dead discard"
    verb = "discard"
    asks = True


@dataclass
class Replay(_Filtered):
    """Make matching published rows pending again, with their event ids.

    One transaction (in batches, for progress): dispatchers see every replayed row at once when
    it commits, so a key's replayed rows go out in their order and before the key's newer rows;
    an interrupted or aborted replay changes nothing. Published rows are never leased, so the
    row locks it holds until then delay no dispatcher.
    """

    deletes_on_publish: bool = False  # OUTBOX_DELETE_ON_PUBLISH: no published row is kept
    command = "replay"
    verb = "replay"
    noun = "published row"
    asks = True
    replays = True
    wakes = True
    atomic = True

    def refusal(self) -> ActionRefusedError | None:
        refused = super().refusal()
        if refused is None and self.deletes_on_publish:
            return ActionRefusedError(text.DELETES_ON_PUBLISH, usage=False)
        return refused

    def _step(self, store: OperatorStore) -> Callable[..., Any]:
        return store.replay_batch


# --- other rows ----------------------------------------------------------------------------------


class Uncounted:
    """An action whose rows are not counted in advance (no bound to confirm)."""

    def refusal(self) -> ActionRefusedError | None:
        return None

    def confirmed(self) -> Bound | None:
        return None

    async def after_commit(self, session: Session) -> bool:
        return False


@dataclass
class ReleaseHeld(Uncounted):
    """Let rows go that an interrupted replay of version 0.1 left held (pending, not due)."""

    topic: str | None = None
    command = "replay --release-held"
    wakes = True
    atomic = True

    def question(self, matching: int | None) -> str | None:
        return None

    async def count(self, session: Session) -> int | None:
        return None

    async def run(self, session: Session, ledger: Ledger, advance: Advance | None) -> int:
        return await session.store.release_held(topic=self.topic)

    def audited(self) -> dict[str, object]:
        return {"topic": self.topic} if self.topic else {}

    def describe(self, rows: int, *, dry_run: bool) -> str:
        return text.released(rows)


@dataclass
class Cleanup(Uncounted):
    """Delete published rows older than `older_than` seconds now (retention's walk)."""

    older_than: float
    batch_size: int
    command = "cleanup"
    wakes = False
    atomic = False
    batches: int = field(default=0, init=False)

    def question(self, matching: int | None) -> str | None:
        if self.older_than != 0 or not matching:
            return None
        return f"delete all {text.rows(matching, 'published row')} (the whole published history)?"

    async def count(self, session: Session) -> int | None:
        return await session.store.cleanup_count(older_than_seconds=self.older_than)

    async def run(self, session: Session, ledger: Ledger, advance: Advance | None) -> int:
        store = session.store

        async def step(after: int, limit: int) -> Batch:
            row = await store.cleanup_window(
                after=after, older_than_seconds=self.older_than, limit=limit
            )
            self.batches += row["last_id"] is not None
            final = cleanup.walk_ends(row, limit)
            return Batch(row["last_id"], row["deleted"], final=final)

        return await jobs.walk(
            session, step, ledger, self.batch_size, atomic=False, cap=None, advance=advance
        )

    def audited(self) -> dict[str, object]:
        return {"older_than_seconds": self.older_than}

    def describe(self, rows: int, *, dry_run: bool) -> str:
        return text.cleanup(rows, self.older_than, dry_run=dry_run)
