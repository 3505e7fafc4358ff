"""The source registry (issue 36): which outboxes the configured sources stand for right now, and
in what state, following each database while the process runs.

Per database, every `interval` seconds, one catalogue read (store/catalog.sql `outbox_tables`,
done again only when a cheap fingerprint of the catalogue changed, and every FULL_READ_SECONDS)
lists the tables with their schema steps; `config.outboxes.expand` turns it into outboxes. A new
one's version is read once (and a not-yet-ready one's again on its own backoff); a ready one
costs nothing more. A pattern's schema that is created and migrated is found at the next read,
one that is dropped is let go. An unreachable database backs off alone (every outbox of it with
it), a broken or missing table backs off alone; each logs one line when its state changes, never
per attempt. The registry holds at most one connection per database, and the answer is data
(`view`): what status, `/readyz` and the console print.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence

import structlog

from outbox_dispatcher import errors
from outbox_dispatcher.config.outboxes import Outbox, Source, expand
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.sources.backoff import Backoff
from outbox_dispatcher.store import db, migrations
from outbox_dispatcher.store.catalog import CatalogStore

log = structlog.get_logger(__name__)

Connect = Callable[[str], Awaitable[db.Connection]]
DISCOVERY_SECONDS = 2.0
# undefined_table, invalid_schema_name: a schema dropped between the catalogue read and a check.
DROPPED = frozenset({"42P01", "3F000"})
# A pending outbox (being migrated, most likely) is read again after at most this many intervals:
# a tenant caught mid-migration is served within two intervals of its migration (4 s by default).
PENDING_RECHECK = 1
# The full catalogue read runs when the catalogue's fingerprint changed, and at least this often.
FULL_READ_SECONDS = 60.0
# What makes a whole database back off: away, refusing us (credentials, a database that does not
# exist or takes no connections), or a catalogue that cannot be read.
DATABASE_FAILURES: tuple[type[BaseException], ...] = (
    *db.CONNECTION_ERRORS,
    errors.OutboxDispatcherError,
    db.PostgresError,
)


class State(enum.StrEnum):
    READY = "ready"  # served: its table is at a version this dispatcher runs
    PENDING = "pending"  # its table is there, not (yet) at such a version: being migrated?
    MISSING = "missing"  # a literal source's table is not there
    BROKEN = "broken"  # reading it failed (privileges, a newer schema, ...)
    UNREACHABLE = "unreachable"  # its database cannot be reached


@dataclasses.dataclass(frozen=True)
class OutboxState:
    """One outbox as the registry sees it; `since` is the wall-clock time of its last change."""

    outbox: Outbox
    state: State
    reason: str | None
    since: float
    version: int | None
    failures: int

    @property
    def label(self) -> str:
        return self.outbox.label


@dataclasses.dataclass(frozen=True)
class DatabaseState:
    """One database of the sources (named by hosts, ports and name, never its URL)."""

    database: str
    reachable: bool
    reason: str | None
    since: float
    failures: int
    checked_at: float | None  # wall-clock time of its last catalogue read
    reads: int  # catalogue reads so far (one per interval while it is reachable)


@dataclasses.dataclass(frozen=True)
class View:
    """The registry's answer: every outbox it knows and every database, sorted."""

    outboxes: tuple[OutboxState, ...]
    databases: tuple[DatabaseState, ...]

    def ready(self) -> list[Outbox]:
        """The outboxes that can be served now."""
        return [o.outbox for o in self.outboxes if o.state is State.READY]

    def failing(self) -> list[OutboxState]:
        return [o for o in self.outboxes if o.state is not State.READY]


@dataclasses.dataclass
class _Tracked:
    outbox: Outbox
    backoff: Backoff
    state: State = State.PENDING
    reason: str | None = None
    since: float = 0.0
    version: int | None = None
    checked: bool = False  # its version has been read at least once
    vanished: bool = False  # its last check found a relation missing


class _Database:
    """One database's sources, connection, backoff and outboxes."""

    def __init__(self, name: str, sources: list[Source], backoff: Backoff) -> None:
        self.name = name
        self.sources = sources
        self.url = sources[0].database_url.get_secret_value()
        self.tables = sorted({s.table for s in sources})
        self.backoff = backoff
        self.conn: db.Connection | None = None
        self.reachable = True
        self.reason: str | None = None
        self.since = time.time()
        self.checked_at: float | None = None
        self.reads = 0
        self.outboxes: dict[tuple[str, str], _Tracked] = {}
        # The last full catalogue read's answer, the fingerprint it was read under, and when
        # the next is due anyway (monotonic): an unchanged fingerprint reuses the answer.
        self.found: set[tuple[str, str]] | None = None
        self.fingerprint: tuple[int, int] | None = None
        self.full_due = 0.0

    def state(self) -> DatabaseState:
        return DatabaseState(
            self.name,
            self.reachable,
            self.reason,
            self.since,
            self.backoff.failures,
            self.checked_at,
            self.reads,
        )

    async def close(self) -> None:
        conn, self.conn = self.conn, None
        self.found = None  # read in full again once connected
        if conn is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), 5)
            if not conn.is_closed():
                conn.terminate()


class SourceRegistry:
    """Follows every database of `sources`; `refresh` reads each one that is due, `run` keeps
    doing so every `interval` seconds until stopped."""

    def __init__(
        self,
        sources: Sequence[Source],
        connect: Connect,
        *,
        interval: float = DISCOVERY_SECONDS,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        jitter: bool = True,
    ) -> None:
        self.interval = interval
        self._connect = connect
        self._clock = clock

        def backoff() -> Backoff:
            return Backoff(max(backoff_initial, interval), backoff_max, jitter=jitter)

        self._backoff = backoff
        grouped: dict[str, list[Source]] = {}
        for source in sources:
            grouped.setdefault(source.database, []).append(source)
        self._databases = [_Database(name, group, backoff()) for name, group in grouped.items()]

    @classmethod
    def from_settings(cls, sources: Sequence[Source], settings: Settings) -> SourceRegistry:
        """A registry that connects as the dispatcher does and backs off as its settings say."""

        async def connect(url: str) -> db.Connection:
            return await db.connect(url, settings, setting="OUTBOX_SOURCES")

        return cls(
            sources,
            connect,
            backoff_initial=settings.backoff_initial_seconds,
            backoff_max=settings.backoff_max_seconds,
        )

    def view(self) -> View:
        outboxes = [
            OutboxState(t.outbox, t.state, t.reason, t.since, t.version, t.backoff.failures)
            for database in self._databases
            for t in database.outboxes.values()
        ]
        outboxes.sort(key=lambda o: (o.outbox.database, o.outbox.schema, o.outbox.table))
        databases = sorted((d.state() for d in self._databases), key=lambda d: d.database)
        return View(tuple(outboxes), tuple(databases))

    async def refresh(self) -> View:
        """One pass: every database that is due, at once (a slow one delays no other)."""
        await asyncio.gather(*(self._refresh(d) for d in self._databases))
        return self.view()

    async def run(self, stopping: asyncio.Event) -> None:
        """Follow the databases until `stopping` is set, then close their connections."""
        try:
            async with asyncio.TaskGroup() as group:
                for database in self._databases:
                    group.create_task(self._follow(database, stopping))
        finally:
            await self.close()

    async def close(self) -> None:
        for database in self._databases:
            await database.close()

    async def _follow(self, database: _Database, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            await self._refresh(database)
            wait = max(self.interval, database.backoff.due_at - self._clock())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), wait)

    async def _refresh(self, database: _Database) -> None:
        if not database.backoff.due(self._clock()):
            return
        try:
            if database.conn is None or database.conn.is_closed():
                database.conn = await self._connect(database.url)
            found = await self._tables(database, CatalogStore(database.conn))
            database.reads += 1
            await self._follow_outboxes(database, database.conn, found)
        except DATABASE_FAILURES as exc:
            await self._unreachable(database, exc)
        else:
            self._reachable(database)

    async def _tables(self, database: _Database, catalog: CatalogStore) -> set[tuple[str, str]]:
        """The outbox tables of the database: the last full read's while the catalogue's
        fingerprint is unchanged (asked first: a change after it is seen at the next interval),
        read in full otherwise and every FULL_READ_SECONDS. The full read was most of an idle
        fleet's database time (500 tenants: 4 ms a read, about 30 % of it)."""
        fingerprint = await catalog.fingerprint(database.tables)
        now = self._clock()
        unchanged = fingerprint == database.fingerprint and now < database.full_due
        if database.found is not None and unchanged:
            return database.found
        database.found = await catalog.outbox_tables(database.tables)
        database.fingerprint, database.full_due = fingerprint, now + FULL_READ_SECONDS
        return database.found

    async def _follow_outboxes(
        self, database: _Database, conn: db.Connection, found: set[tuple[str, str]]
    ) -> None:
        current = _expand(database, found)
        now = self._clock()
        for key in [k for k in database.outboxes if k not in current]:
            gone = database.outboxes.pop(key)
            log.info(
                "outbox_let_go",
                source=gone.outbox.label,
                database=database.name,
                reason="its schema no longer holds the outbox table",
            )
        for key, outbox in current.items():
            tracked = database.outboxes.get(key)
            if tracked is None:
                tracked = database.outboxes[key] = _Tracked(outbox, self._backoff())
            present = key in found
            if tracked.state is State.READY and present:
                continue  # a ready table costs nothing more
            if tracked.checked and tracked.state is State.MISSING and not present:
                continue  # nothing to read until the catalogue shows it
            if tracked.checked and not tracked.backoff.due(now) and not _appeared(tracked, present):
                continue
            await self._check(database, conn, tracked, present)

    async def _check(
        self, database: _Database, conn: db.Connection, tracked: _Tracked, present: bool
    ) -> None:
        """Read one outbox's version and settle its state."""
        outbox = tracked.outbox
        tracked.checked = True
        vanished, tracked.vanished = tracked.vanished, False
        if not present:
            self._set(database, tracked, State.MISSING, _missing(outbox), None)
            return
        try:
            if await CatalogStore(conn).migration_running(
                migrations.lock_key(outbox.schema, outbox.table)
            ):
                reason = "`outbox-dispatcher migrate` is migrating it: served once it is done"
                self._set(database, tracked, State.PENDING, reason, None)
                return
            version = await migrations.current_version(conn, outbox.schema, outbox.table)
        except db.PostgresError as exc:
            if isinstance(exc, db.CONNECTION_ERRORS):
                raise
            if exc.sqlstate in DROPPED and not vanished:
                # Dropped since the catalogue read, most likely: the next read says so. Twice
                # in a row, a relation of the schema is missing: broken.
                tracked.vanished, tracked.checked = True, False
                return
            reason = f"reading its schema version failed ({errors.describe(exc)})"
            self._set(database, tracked, State.BROKEN, reason, None)
            return
        if migrations.supported(version):
            self._set(database, tracked, State.READY, None, version)
        elif version > migrations.latest_version():
            reason = (
                f"its schema is at version {version}, newer than this dispatcher understands "
                f"({migrations.latest_version()}): upgrade outbox-dispatcher"
            )
            self._set(database, tracked, State.BROKEN, reason, version)
        else:
            reason = (
                f"its schema is at version {version}, this dispatcher needs "
                f"{migrations.OLDEST_SUPPORTED} to {migrations.latest_version()}: run "
                "`outbox-dispatcher migrate` (a migration under way finishes by itself)"
            )
            self._set(database, tracked, State.PENDING, reason, version)

    def _set(
        self,
        database: _Database,
        tracked: _Tracked,
        state: State,
        reason: str | None,
        version: int | None,
    ) -> None:
        """Record a check's outcome; log only a change of state."""
        now = self._clock()
        if state is State.READY:
            tracked.backoff.succeeded()
        else:
            tracked.backoff.failed(now)
        if state is State.PENDING:  # soon ready, most likely: looked at again within seconds
            tracked.backoff.due_at = min(
                tracked.backoff.due_at, now + PENDING_RECHECK * self.interval
            )
        changed = state is not tracked.state or tracked.since == 0.0
        tracked.reason, tracked.version = reason, version
        if not changed:
            return
        tracked.state, tracked.since = state, time.time()
        event = "outbox_ready" if state is State.READY else "outbox_not_ready"
        emit = log.info if state in (State.READY, State.PENDING) else log.warning
        emit(
            event,
            source=tracked.outbox.label,
            database=database.name,
            state=state.value,
            version=version,
            reason=reason,
        )

    async def _unreachable(self, database: _Database, exc: BaseException) -> None:
        await database.close()
        translated = db.translate(exc, database.url, "OUTBOX_SOURCES")
        reason = str(translated or db.redact(errors.describe(exc), database.url))
        delay = database.backoff.failed(self._clock())
        database.reason = reason
        for tracked in database.outboxes.values():
            if tracked.state is not State.UNREACHABLE:
                tracked.state, tracked.since = State.UNREACHABLE, time.time()
            tracked.reason = reason
        if database.reachable:
            database.reachable, database.since = False, time.time()
            log.warning(
                "source_database_unreachable",
                database=database.name,
                reason=reason,
                retry_in_seconds=round(delay, 1),
                outboxes=len(database.outboxes),
            )

    def _reachable(self, database: _Database) -> None:
        database.backoff.succeeded()
        database.checked_at = time.time()
        if not database.reachable:
            database.reachable, database.reason, database.since = True, None, time.time()
            log.info("source_database_reachable", database=database.name)


def _expand(database: _Database, found: Iterable[tuple[str, str]]) -> dict[tuple[str, str], Outbox]:
    """The outboxes of `database` given the (schema, table) pairs its catalogue holds: each
    table's sources expanded against the schemas holding that table."""
    found = list(found)
    outboxes: dict[tuple[str, str], Outbox] = {}
    for table in database.tables:
        sources = [s for s in database.sources if s.table == table]
        schemas = [schema for schema, name in found if name == table]
        for outbox in expand(sources, database.name, schemas):
            outboxes.setdefault((outbox.schema, outbox.table), outbox)
    return outboxes


def _appeared(tracked: _Tracked, present: bool) -> bool:
    """A table the last check did not find is in the catalogue now: check it at once."""
    return present and tracked.state in (State.MISSING, State.UNREACHABLE)


def _missing(outbox: Outbox) -> str:
    return (
        f"there is no outbox table {outbox.schema}.{outbox.table} (at version "
        f"{migrations.OLDEST_SUPPORTED} or later) in database {outbox.database}: run "
        "`outbox-dispatcher migrate`, or fix the source's schema, table or database"
    )
