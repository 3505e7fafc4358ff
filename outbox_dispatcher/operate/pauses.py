"""Pausing and resuming a topic or the whole table: actions of the one flow (actions.perform),
each one statement in one transaction. Pauses live in a table the claim reads; rows already
claimed when a pause commits are still published."""

from __future__ import annotations

from dataclasses import dataclass, field

from outbox_dispatcher.operate import reads, text
from outbox_dispatcher.operate.actions import Uncounted
from outbox_dispatcher.operate.jobs import Advance, Ledger
from outbox_dispatcher.operate.session import Session


@dataclass
class _Waiting(Uncounted):
    """A pause or resume of a topic (None: the whole table). With `count_waiting` its count is
    the pending rows it holds or lets go, read before it acts (a read of every topic)."""

    topic: str | None = None
    count_waiting: bool = False
    pending: int | None = field(default=None, init=False)
    in_flight: int = field(default=0, init=False)
    atomic = True

    async def count(self, session: Session) -> int | None:
        if self.count_waiting:
            self.pending, self.in_flight = await reads.pending_of(session, self.topic)
        return self.pending


@dataclass
class Pause(_Waiting):
    """Stop claiming rows of a topic or of the whole table; paused_by is the person the console
    knows (`by`), the database role and the client's address."""

    reason: str | None = None
    by: str | None = None
    paused: reads.Pause | None = field(default=None, init=False)
    command = "pause"
    wakes = False

    def question(self, matching: int | None) -> str | None:
        return None if self.topic else f"pause {text.pause_target(None)}?"

    async def run(self, session: Session, ledger: Ledger, advance: Advance | None) -> int:
        topic = self.topic or reads.WHOLE_TABLE
        row = await session.store.pause(topic=topic, reason=self.reason, by=self.by)
        self.paused = reads.Pause(**dict(row or {}))
        return 1

    async def after_commit(self, session: Session) -> bool:
        """Count again once claims that began before the pause have ended: they may still lease
        rows of the topic, and "already claimed" must be every row that still goes out."""
        if not (self.count_waiting and await session.store.wait_for_pause_readers()):
            return False
        self.pending, self.in_flight = await reads.pending_of(session, self.topic)
        return True

    def audited(self) -> dict[str, object]:
        asked = {"topic": self.topic, "reason": self.reason}
        return {name: value for name, value in asked.items() if value is not None}

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

    async def run(self, session: Session, ledger: Ledger, advance: Advance | None) -> int:
        row = await session.store.resume(topic=self.topic or reads.WHOLE_TABLE)
        self.lifted = None if row is None else reads.Pause(**dict(row))
        return 0 if row is None else 1

    def audited(self) -> dict[str, object]:
        return {"topic": self.topic} if self.topic else {}

    def describe(self, rows: int, *, dry_run: bool) -> str:
        lifted = self.lifted is not None
        return text.resume(self.topic, self.pending, lifted=lifted, dry_run=dry_run)
