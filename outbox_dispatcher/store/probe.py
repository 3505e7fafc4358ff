"""The batched idle probe's statements (store/probe.sql, store/hints.sql): one statement for
the served outboxes of one database, their branches joined by UNION ALL, in chunks of at most
CHUNK outboxes; and the statistics that say which outboxes' tables were written since.

The full probe is built once per set of tables (the caller passes every served outbox of the
database in a stable order, so the statements change only when outboxes come or go), run without
parameters and prepared once on the probe's own connection (`Session`): planning a chunk costs
about 64 ms, running it 5-15 ms. It was first run through the pool, where asyncpg caches no
statement longer than 15 KiB (a chunk is about 150 KiB): every chunk was planned at every probe,
most of an idle fleet's database CPU. A chunk bounds the planning and the estimated cost: 500
branches in one statement were JIT-compiled, 4-5 s a probe (docs/design/many-outboxes.md, "Idle
cost")."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

import asyncpg

from outbox_dispatcher.config.names import quote_identifier
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.store import db
from outbox_dispatcher.store.named import load
from outbox_dispatcher.store.statements import compile_placeholders, identifiers, parse

# Outboxes per statement: planned once per connection (about 64 ms), well below jit_above_cost.
CHUNK = 100


@dataclass(frozen=True)
class Found:
    """What the probe says about one outbox (only those with something are returned)."""

    index: int  # its place in the list probed
    expired: bool  # a lease expired: takeover and the reclaimer's duty
    work: bool  # a claim would find rows
    hole: bool = False  # a hole of its cursor waits for transactions still running
    due_in: float | None = None  # seconds until a live lease expires or a retry is due

    @property
    def found(self) -> bool:
        """A claim has something to do now (the rest says when to look again)."""
        return self.expired or self.work


@functools.cache
def _sections() -> dict[str, str]:
    return parse(resources.files(__package__).joinpath("probe.sql").read_text("utf-8"))


def _branch() -> str:
    return _sections()["branch"]


@functools.lru_cache(maxsize=256)
def probe_sql(tables: tuple[tuple[str, str], ...], first: int, takes_blocked: bool) -> str:
    """The statement for `tables` ((schema, table) pairs), numbering them from `first`."""
    branches = []
    for n, (schema, table) in enumerate(tables, start=first):
        names = identifiers(schema, table, table)
        names.update(n=str(n), takes_blocked="true" if takes_blocked else "false")
        branches.append(_branch().format_map(names))
    statement = compile_placeholders("idle_probe", "\nUNION ALL\n".join(branches))
    if statement.params:  # a plan cached per connection needs a statement without any
        msg = f"the idle probe takes no parameters, found {statement.params}"
        raise ValueError(msg)
    return statement.sql


def chunks(tables: Sequence[tuple[str, str]]) -> list[tuple[int, tuple[tuple[str, str], ...]]]:
    """The tables in CHUNK-sized slices, each with the index of its first table."""
    return [(i, tuple(tables[i : i + CHUNK])) for i in range(0, len(tables), CHUNK)]


async def probe(
    executor: db.Pool | db.Executor | Session,
    tables: Sequence[tuple[str, str]],
    *,
    takes_blocked: bool,
    keep: str | None = None,
) -> list[Found]:
    """Which of `tables` have something to do (or will have: a live lease, a retry later, a
    hole), a statement per chunk; `keep`: the chunks stay prepared on a Session's connection, in
    that group (the full probe; a few outboxes' probe is planned each time, in its cache of
    statements)."""
    found: list[Found] = []
    for first, chunk in chunks(tables):
        sql = probe_sql(chunk, first, takes_blocked)
        if isinstance(executor, Session):
            rows = await executor.fetch(sql, keep=keep)
        else:
            rows = await db.fetch(executor, sql)
        found.extend(_found(r) for r in rows)
    return found


async def announce(
    session: Session, tables: Sequence[tuple[str, str]], *, owner: str, seconds: float
) -> None:
    """Announce the waits of `tables` for `seconds` (probe.sql `announce`), a statement per
    chunk: at an outbox's first look, instead of one statement each (500 at a fleet's start)."""
    for first, chunk in chunks(tables):
        ctes = []
        for n, (schema, table) in enumerate(chunk, start=first):
            names = identifiers(schema, table, table)
            names["n"] = str(n)
            ctes.append(_sections()["announce"].format_map(names))
        sql = "WITH " + ",\n".join(ctes) + "\nSELECT 1"
        statement = compile_placeholders("announce", sql)
        await session.fetch(statement.sql, *statement.bind({"owner": owner, "seconds": seconds}))


def probe_sqls(tables: Sequence[tuple[str, str]], *, takes_blocked: bool) -> set[str]:
    """The statements `probe` runs for `tables`."""
    return {probe_sql(chunk, first, takes_blocked) for first, chunk in chunks(tables)}


def _found(row: asyncpg.Record) -> Found:
    due_in = row["due_in"]
    return Found(
        int(row["outbox"]),
        bool(row["expired"]),
        bool(row["work"]),
        bool(row["hole"]),
        None if due_in is None else float(due_in),
    )


# The relations whose writes can give an idle outbox work (besides time passing: a lease
# expiring, a retry falling due, a hole's transactions ending, which the probe's answer
# says when to look at again): its table (rows), change log, work (leases, retries, operators'
# actions), cursor (holes, pauses' generation) and table pauses.
WATCHED = ("", "_changed", "_work", "_cursor", "_paused")


def watched(tables: Sequence[tuple[str, str]]) -> list[str]:
    """The quoted names of the WATCHED relations of each table, len(WATCHED) per table."""
    return [
        f"{quote_identifier(schema)}.{quote_identifier(table + suffix)}"
        for schema, table in tables
        for suffix in WATCHED
    ]


class Session:
    """The idle probe's own connection to one database (and the batched heartbeat's,
    store/heartbeats.py), made at its first use and again after it broke: the full probe's
    chunks stay prepared there, planned once while the served outboxes stay the same, whatever
    the pool's connections run. With OUTBOX_STATEMENT_CACHE_SIZE=0 (a transaction pooler) nothing
    is prepared: every statement is planned at each run."""

    def __init__(self, url: str, settings: Settings) -> None:
        self._url = url
        self._settings = settings
        self._prepares = settings.statement_cache_size > 0
        self._conn: db.Connection | None = None
        self._kept: dict[str, dict[str, asyncpg.prepared_stmt.PreparedStatement]] = {}
        self._lock = asyncio.Lock()  # one statement at a time on one connection
        self.connects = 0  # connections made (for tests)

    async def fetch(self, sql: str, *args: object, keep: str | None = None) -> list[asyncpg.Record]:
        """Run `sql`; `keep`: prepared once and kept, in that group, until `keep_only` drops it
        or the connection goes."""
        async with self._lock:
            conn = await self._connection()
            try:
                if keep is not None and self._prepares:
                    return await self._kept_fetch(conn, keep, sql, args)
                return await db.fetch(conn, sql, *args)
            except db.CONNECTION_ERRORS:
                await self._drop()
                raise

    async def _kept_fetch(
        self, conn: db.Connection, keep: str, sql: str, args: tuple[object, ...]
    ) -> list[asyncpg.Record]:
        group = self._kept.setdefault(keep, {})
        kept = group.get(sql)
        if kept is None:
            kept = group[sql] = await conn.prepare(sql)
        try:
            return await kept.fetch(*args)
        except db.PostgresError:  # a table dropped or changed under it: prepared anew next time
            group.pop(sql, None)
            raise

    async def named(self, name: str, **values: object) -> asyncpg.Record:
        """One row of a statement of store/hints.sql."""
        statement = load("hints.sql")[name]
        [row] = await self.fetch(statement.sql, *statement.bind(values))
        return row

    def keep_only(self, keep: str, sqls: set[str]) -> None:
        """Forget the prepared statements of group `keep` not in `sqls` (outboxes came or
        went); asyncpg deallocates them once unreferenced."""
        group = self._kept.get(keep, {})
        self._kept[keep] = {sql: kept for sql, kept in group.items() if sql in sqls}

    async def _connection(self) -> db.Connection:
        if self._conn is None or self._conn.is_closed():
            self._kept = {}
            conn = await db.connect(
                self._url,
                self._settings,
                "OUTBOX_SOURCES",
                statement_cache_size=self._settings.statement_cache_size,
            )
            if self._prepares:
                await conn.execute(db.HOT_PATH_SETTINGS)
            self._conn = conn
            self.connects += 1
        return self._conn

    async def _drop(self) -> None:
        conn, self._conn, self._kept = self._conn, None, {}
        if conn is not None:
            conn.terminate()

    async def close(self) -> None:
        async with self._lock:
            conn, self._conn, self._kept = self._conn, None, {}
            if conn is not None:
                try:
                    await asyncio.wait_for(conn.close(), 5)
                except db.CONNECTION_ERRORS:
                    conn.terminate()


async def relations(session: Session, tables: Sequence[tuple[str, str]]) -> list[int]:
    """The oids of `watched(tables)` (0 for one that is not there)."""
    row = await session.named("relations", names=watched(tables))
    return [int(oid) for oid in row["relations"]]


async def changes(session: Session, oids: Sequence[int]) -> list[tuple[int, int]] | None:
    """The writes counted so far, for each table: to its WATCHED relations, and to the table
    itself (the rows); None when the server counts none (track_counts off)."""
    row = await session.named("counters", relations=list(oids))
    if not row["counting"]:
        return None
    counts = [int(n) for n in row["changes"]]
    step = len(WATCHED)
    return [(sum(counts[i : i + step]), counts[i]) for i in range(0, len(counts), step)]
