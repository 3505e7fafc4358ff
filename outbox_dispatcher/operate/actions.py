"""The operator's actions and the one flow both faces run them through.

`perform` is that flow: refuse what must not run, count what would change, ask (a hook: the CLI
asks on a terminal; the console's two-step page is its own confirmation), act and audit (in one
transaction where the action is one), wake idle dispatchers, describe. Each action says only what
is its own: its refusal, its count, its statement, its audit filter and its words (text.py).

Every action is safe while dispatchers run. Dead and published rows are never leased, so the
actions that change them cannot race a dispatcher's publish; each works in batches of
`batch_size` rows between ids fixed when it starts. Pauses live in a table the claim reads; rows
already claimed when a pause commits are still published. docs/operations.md says more.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

import orjson

from outbox_dispatcher import cleanup, errors
from outbox_dispatcher.operate import reads, text
from outbox_dispatcher.operate.filters import FIELDS, Filters, Names, refusal
from outbox_dispatcher.operate.session import Session
from outbox_dispatcher.store import Row, Store

# Rows done by one more batch.
Advance = Callable[[int], object]
# What shows an action's advance, given the rows it is expected to change (None: not counted).
Progress = Callable[[int | None], AbstractContextManager[Advance]]
# Go on? Given what the count found and the action's question (None: it asks nothing).
Confirm = Callable[[int | None, str | None], bool]
# Where an action came from, for its audit row (merged into the filter): the CLI gives none, the
# console {"via": "console", "http_client": ...}.
Origin = Mapping[str, object]


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
        """Whether it acts and audits in one transaction (else each batch commits)."""

    def refusal(self) -> ActionRefusedError | None: ...

    def question(self, matching: int | None) -> str | None: ...

    async def count(self, session: Session) -> int | None: ...

    async def run(self, session: Session, advance: Advance | None) -> int: ...

    def audited(self) -> dict[str, object]: ...

    def describe(self, rows: int, *, dry_run: bool) -> str: ...


@dataclass(frozen=True)
class ActionResult:
    """What an action did (or, as a dry run, would do): `rows` changed, or that would change."""

    command: str
    rows: int
    dry_run: bool
    detail: str
    matching: int | None = None  # what the count found before acting (None: not counted)
    done: bool = True  # False: a dry run, or not confirmed

    def as_json(self) -> dict[str, object]:
        return {
            "command": self.command,
            "rows": self.rows,
            "dry_run": self.dry_run,
            "detail": self.detail,
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
) -> ActionResult:
    """Count -> confirm -> act and audit -> wake -> describe; a dry run stops after counting."""
    refuse(action)
    matching = await action.count(session)
    if dry_run or (confirm is not None and not confirm(matching, action.question(matching))):
        rows = matching or 0
        detail = action.describe(rows, dry_run=True)
        return ActionResult(action.command, rows, dry_run, detail, matching, done=False)
    with progress(matching) if progress else contextlib.nullcontext() as advance:
        rows = await _act(action, session, advance, origin)
    # An action may look again once its change is visible to everyone (a pause's count).
    after_commit = getattr(action, "after_commit", None)
    if after_commit is not None:
        await after_commit(session)
    if rows and action.wakes:
        await session.store.wake(channel=session.channel)
    return ActionResult(action.command, rows, False, action.describe(rows, dry_run=False), matching)


async def _act(
    action: Action, session: Session, advance: Advance | None, origin: Origin | None
) -> int:
    async with _transaction(session, atomic=action.atomic):
        rows = await action.run(session, advance)
        await audit(session, action.command, {**action.audited(), **(origin or {})}, rows)
    return rows


def _transaction(session: Session, *, atomic: bool) -> AbstractAsyncContextManager[object]:
    return session.transaction() if atomic else contextlib.nullcontext()


async def audit(session: Session, command: str, filter: object, rows: int) -> None:
    """Record an operator action in the database (who, from where and when: the database's)."""
    # As text: the statement works on any connection, with or without our jsonb codec.
    await session.store.audit(command=command, filter_json=orjson.dumps(filter).decode(), rows=rows)


# One batch of a cursor-batched statement: Store.dead_requeue, dead_discard or replay_batch.
Step = Callable[..., Awaitable[Row]]


async def walk(
    store: Store, step: Step, args: tuple[object, ...], batch_size: int, advance: Advance | None
) -> int:
    """Run a cursor-batched statement over ids (0, max id now], one transaction per batch
    (unless the caller holds one)."""
    bound = await store.max_id()
    after = 0
    total = 0
    while True:
        row = await step(filter_args=args, after=after, bound=bound, limit=batch_size)
        if row["last_id"] is None:
            return total
        after = row["last_id"]
        total += row["rows"]
        if advance is not None:
            advance(row["rows"])


# --- rows a filter selects ----------------------------------------------------------------------


@dataclass
class _Filtered:
    """An action over the rows its filters select, walked in batches of `batch_size` ids."""

    filters: Filters
    batch_size: int
    everything: bool = False  # every such row, on purpose (--all, "all": true)
    names: Names = FIELDS
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

    def _args(self) -> tuple[object, ...]:
        return self.filters.replay_args() if self.replays else self.filters.dead_args()

    async def count(self, session: Session) -> int | None:
        store = session.store
        counting = store.replay_count if self.replays else store.dead_count
        return await counting(filter_args=self._args())

    async def run(self, session: Session, advance: Advance | None) -> int:
        store = session.store
        return await walk(store, self._step(store), self._args(), self.batch_size, advance)

    def _step(self, store: Store) -> Step:
        raise NotImplementedError

    def audited(self) -> dict[str, object]:
        return self.filters.as_json()

    def describe(self, rows: int, *, dry_run: bool) -> str:
        return text.changed(self.verb, rows, self.noun, dry_run=dry_run)


@dataclass
class DeadRequeue(_Filtered):
    """Make matching dead rows pending again (attempts 0, due now)."""

    command = "dead requeue"
    verb = "requeue"
    noun = "dead row"
    wakes = True

    def _step(self, store: Store) -> Step:
        return store.dead_requeue


@dataclass
class DeadDiscard(_Filtered):
    """Delete matching dead rows; every dead row only after asking."""

    command = "dead discard"
    verb = "discard"
    noun = "dead row"
    asks = True

    def _step(self, store: Store) -> Step:
        return store.dead_discard


@dataclass
class Replay(_Filtered):
    """Make matching published rows pending again, with their event ids.

    One transaction (in batches, for progress): dispatchers see every replayed row at once when
    it commits, so a key's replayed rows go out in their order and before the key's newer rows;
    an interrupted replay changes nothing. Published rows are never leased, so the row locks it
    holds until then delay no dispatcher.
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

    def _step(self, store: Store) -> Step:
        return store.replay_batch


# --- other rows ----------------------------------------------------------------------------------


@dataclass
class ReleaseHeld:
    """Let rows go that an interrupted replay of version 0.1 left held (pending, not due)."""

    topic: str | None = None
    command = "replay --release-held"
    wakes = True
    atomic = True

    def refusal(self) -> ActionRefusedError | None:
        return None

    def question(self, matching: int | None) -> str | None:
        return None

    async def count(self, session: Session) -> int | None:
        return None

    async def run(self, session: Session, advance: Advance | None) -> int:
        return await session.store.release_held(topic=self.topic)

    def audited(self) -> dict[str, object]:
        return {"topic": self.topic} if self.topic else {}

    def describe(self, rows: int, *, dry_run: bool) -> str:
        return text.released(rows)


@dataclass
class Cleanup:
    """Delete published rows older than `older_than` seconds now (retention's walk)."""

    older_than: float
    batch_size: int
    command = "cleanup"
    wakes = False
    atomic = False
    swept: cleanup.Swept | None = field(default=None, init=False)

    def refusal(self) -> ActionRefusedError | None:
        return None

    def question(self, matching: int | None) -> str | None:
        if self.older_than != 0 or not matching:
            return None
        return f"delete all {text.rows(matching, 'published row')} (the whole published history)?"

    async def count(self, session: Session) -> int | None:
        return await session.store.cleanup_count(older_than_seconds=self.older_than)

    async def run(self, session: Session, advance: Advance | None) -> int:
        self.swept = await cleanup.delete_published(
            session.conn, session.queries, self.older_than, self.batch_size, advance
        )
        return self.swept.deleted

    def audited(self) -> dict[str, object]:
        return {"older_than_seconds": self.older_than}

    def describe(self, rows: int, *, dry_run: bool) -> str:
        return text.cleanup(rows, self.older_than, dry_run=dry_run)


# --- pauses ------------------------------------------------------------------------------------


@dataclass
class _Waiting:
    """A pause or resume of a topic (None: the whole table). With `count_waiting` its count is
    the pending rows it holds or lets go, read before it acts (a read of every topic)."""

    topic: str | None = None
    count_waiting: bool = False
    pending: int | None = field(default=None, init=False)
    in_flight: int = field(default=0, init=False)
    atomic = True

    def refusal(self) -> ActionRefusedError | None:
        return None

    async def count(self, session: Session) -> int | None:
        if self.count_waiting:
            self.pending, self.in_flight = await reads.pending_of(session, self.topic)
        return self.pending


@dataclass
class Pause(_Waiting):
    """Stop claiming rows of a topic or of the whole table; paused_by is the database role and
    the client's address."""

    reason: str | None = None
    paused: reads.Pause | None = field(default=None, init=False)
    command = "pause"
    wakes = False

    def question(self, matching: int | None) -> str | None:
        return None if self.topic else f"pause {text.pause_target(None)}?"

    async def run(self, session: Session, advance: Advance | None) -> int:
        row = await session.store.pause(topic=self.topic or reads.WHOLE_TABLE, reason=self.reason)
        self.paused = reads.Pause(**dict(row or {}))
        return 1

    async def after_commit(self, session: Session) -> None:
        """Count again once claims that began before the pause have ended: they may still lease
        rows of the topic, and "already claimed" must be every row that still goes out."""
        if self.count_waiting and await session.store.wait_for_pause_readers():
            self.pending, self.in_flight = await reads.pending_of(session, self.topic)

    def audited(self) -> dict[str, object]:
        return {"topic": self.topic, "reason": self.reason}

    def describe(self, rows: int, *, dry_run: bool) -> str:
        if self.pending is not None:
            return text.pause_counted(self.topic, self.pending, self.in_flight, dry_run=dry_run)
        paused_at = None if self.paused is None else self.paused.paused_at
        return text.pause(self.topic, paused_at, dry_run=dry_run)


@dataclass
class Resume(_Waiting):
    """Lift a pause; idle dispatchers are woken so that its rows go out at once."""

    lifted: reads.Pause | None = field(default=None, init=False)
    command = "resume"
    wakes = True

    def question(self, matching: int | None) -> str | None:
        return None

    async def run(self, session: Session, advance: Advance | None) -> int:
        row = await session.store.resume(topic=self.topic or reads.WHOLE_TABLE)
        self.lifted = None if row is None else reads.Pause(**dict(row))
        return 0 if row is None else 1

    def audited(self) -> dict[str, object]:
        return {"topic": self.topic}

    def describe(self, rows: int, *, dry_run: bool) -> str:
        lifted = self.lifted is not None
        return text.resume(self.topic, self.pending, lifted=lifted, dry_run=dry_run)
