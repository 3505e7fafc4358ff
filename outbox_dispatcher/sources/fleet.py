"""A fleet of processes sharing the outboxes (issue 36), coordinated in PostgreSQL alone: each
member beats its row in the home database's membership table (store/fleet.sql) and reads the
live members; every outbox belongs to the live member with the highest rendezvous hash of
(member, outbox), so that every member computes the same assignment from the same rows and
nothing is written per outbox.

Coordination is for cost, not correctness: several dispatchers may serve one table at once
(per-key leases, SKIP LOCKED, fenced settles), so two members serving an outbox for a moment is
safe, and a gap is bounded by the lease. A member killed stops beating and its outboxes pass to
the others once its row is older than the lease; a member added takes about 1/K of the outboxes,
each from the member that had it; a member stopping deletes its row first. An outbox whose
backlog one member does not drain alone is listed as hot by its owner (in its row, at its beat),
and the next member in its hash order serves it too until the owner stops listing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TypeVar

import structlog

from outbox_dispatcher import errors
from outbox_dispatcher.config.names import FLEET_SCHEMA
from outbox_dispatcher.config.outboxes import Outbox
from outbox_dispatcher.sources.backoff import Backoff
from outbox_dispatcher.store import db
from outbox_dispatcher.store.fleet import FleetStore

log = structlog.get_logger(__name__)

Connect = Callable[[str], Awaitable[db.Connection]]
T = TypeVar("T")
# A member's row dead this many leases is deleted by the others' beats.
FORGET_LEASES = 10
FAILURES: tuple[type[BaseException], ...] = (
    *db.CONNECTION_ERRORS,
    errors.OutboxDispatcherError,
    db.PostgresError,
)
LEAVE_FAILURES: tuple[type[BaseException], ...] = (*FAILURES, TimeoutError)


def outbox_key(outbox: Outbox) -> str:
    """What the hash reads of an outbox: its database (hosts, ports, name), schema and table."""
    return f"{outbox.database}/{outbox.schema}.{outbox.table}"


def _score(member: str, key: str) -> bytes:
    return hashlib.blake2b(f"{member}\0{key}".encode(), digest_size=8).digest()


def owner_of(key: str, members: Sequence[str]) -> str | None:
    """The member that owns `key`: the highest hash of (member, key); None without members."""
    return max(members, key=lambda member: _score(member, key), default=None)


def second_of(key: str, members: Sequence[str]) -> str | None:
    """The member next in `key`'s hash order after its owner: it serves the outbox too while
    the owner lists it as hot (a backlog one member does not drain alone)."""
    ranked = sorted(members, key=lambda member: _score(member, key), reverse=True)
    return ranked[1] if len(ranked) > 1 else None


def assigned(
    items: Iterable[T], members: Sequence[str], me: str, key: Callable[[T], str]
) -> list[T]:
    """The items `me` owns among `members` (rendezvous hashing: adding a member moves only
    items to it, removing one moves only its items)."""
    return [item for item in items if owner_of(key(item), members) == me]


def new_member_id() -> str:
    """host:pid:random, so that a restarted process is a new member."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclasses.dataclass(frozen=True)
class FleetView:
    """What a member knows of the fleet: the live members it last read, and since when that
    read is stale (None: the last beat succeeded)."""

    me: str
    members: tuple[str, ...]
    read_at: float | None  # wall-clock time of the last successful beat
    stale_since: float | None
    reason: str | None
    # The outboxes (outbox_key) each live member lists as hot, by the member listing them.
    hot: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def mine(self, outboxes: Iterable[Outbox]) -> list[Outbox]:
        """The outboxes this member serves: those it owns, and those it is second to while
        their owner lists them as hot. Before its first beat it knows only itself."""
        members = self.members or (self.me,)
        return [o for o in outboxes if self.serves(outbox_key(o), members)]

    def owns(self, outbox: Outbox) -> bool:
        return owner_of(outbox_key(outbox), self.members or (self.me,)) == self.me

    def serves(self, key: str, members: Sequence[str]) -> bool:
        owner = owner_of(key, members)
        if owner == self.me:
            return True
        return self.hot.get(key) == owner and second_of(key, members) == self.me


class FleetMember:
    """One process's membership: beats every min(5 s, lease / 3), keeps the last view while the
    home database is away (and says since when), and leaves when stopped."""

    def __init__(
        self,
        home_url: str,
        connect: Connect,
        *,
        lease_seconds: float,
        member_id: str | None = None,
        schema: str = FLEET_SCHEMA,
        backoff_initial: float = 0.5,
    ) -> None:
        self.me = member_id or new_member_id()
        self.lease_seconds = lease_seconds
        self.beat_seconds = min(5.0, lease_seconds / 3)
        self._url = home_url
        self._connect = connect
        self._schema = schema
        self._conn: db.Connection | None = None
        self._backoff = Backoff(backoff_initial, self.beat_seconds)
        self._members: tuple[str, ...] = ()
        self._hot: dict[str, str] = {}  # the live members' hot outboxes, by outbox key
        self._read_at: float | None = None
        self._stale_since: float | None = None
        self._reason: str | None = None
        # The outboxes (outbox_key) it owns whose backlog wants a second member, written at its
        # next beat (dispatch/fleet.py sets them).
        self.hot: tuple[str, ...] = ()
        self.changed = asyncio.Event()  # set whenever the members change

    def view(self) -> FleetView:
        return FleetView(
            self.me, self._members, self._read_at, self._stale_since, self._reason, self._hot
        )

    async def beat(self) -> FleetView:
        """Renew this member's row and read the live members (one statement)."""
        try:
            if self._conn is None or self._conn.is_closed():
                self._conn = await self._connect(self._url)
            rows = await FleetStore(self._conn, self._schema).heartbeat(
                self.me,
                lease_seconds=self.lease_seconds,
                forget_seconds=FORGET_LEASES * self.lease_seconds,
                hot=self.hot,
            )
        except FAILURES as exc:
            await self._failed(exc)
        else:
            self._read(tuple(sorted(owner for owner, _ in rows)))
            self._read_hot({key: owner for owner, hot in rows for key in hot})
        return self.view()

    async def run(self, stopping: asyncio.Event) -> None:
        """Beat until `stopping`, then leave."""
        try:
            while not stopping.is_set():
                await self.beat()
                wait = self.beat_seconds if self._stale_since is None else self._backoff.delay()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), wait)
        finally:
            await self.leave()

    async def leave(self) -> None:
        """Delete this member's row (the others take its outboxes at their next beat) and close
        the connection; best effort: a member that cannot is dropped after its lease."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            if not conn.is_closed():
                await asyncio.wait_for(FleetStore(conn, self._schema).leave(self.me), 5)
        except LEAVE_FAILURES as exc:
            log.warning("fleet_leave_failed", member=self.me, error=errors.describe(exc))
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), 5)

    def _read(self, members: tuple[str, ...]) -> None:
        self._backoff.succeeded()
        self._read_at = time.time()
        if self._stale_since is not None:
            log.info(
                "fleet_view_fresh",
                member=self.me,
                stale_seconds=round(self._read_at - self._stale_since, 1),
            )
            self._stale_since, self._reason = None, None
        if members != self._members:
            log.info(
                "fleet_members_changed",
                member=self.me,
                members=list(members),
                joined=sorted(set(members) - set(self._members)),
                left=sorted(set(self._members) - set(members)),
            )
            self._members = members
            self.changed.set()

    def _read_hot(self, hot: dict[str, str]) -> None:
        if hot != self._hot:
            log.info(
                "fleet_hot_outboxes",
                member=self.me,
                hot=sorted(hot),
                second_here=sorted(
                    key for key in hot if second_of(key, self._members or (self.me,)) == self.me
                ),
            )
            self._hot = hot
            self.changed.set()

    async def _failed(self, exc: BaseException) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.terminate()
        translated = db.translate(exc, self._url)
        reason = str(translated or db.redact(errors.describe(exc), self._url))
        self._backoff.failed(time.monotonic())
        self._reason = reason
        if self._stale_since is None:
            self._stale_since = time.time()
            log.warning(
                "fleet_view_stale", member=self.me, reason=reason, members=list(self._members)
            )
