"""`migrate` as an operation: apply what the schema lacks and say where it stands, as data (the
CLI prints it); with OUTBOX_SOURCES, for every schema of every source, each on its own."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from outbox_dispatcher import errors
from outbox_dispatcher.config.names import FLEET_SCHEMA
from outbox_dispatcher.config.outboxes import Outbox, Source, expand
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.store import db, migrations
from outbox_dispatcher.store.catalog import CatalogStore
from outbox_dispatcher.store.fleet import MEMBER_TABLE, FleetStore

OLDEST_SUPPORTED = migrations.OLDEST_SUPPORTED


@dataclass(frozen=True)
class Migration:
    """What `migrate` did: the version the schema is at, the versions applied, and a contract
    step it left for later (`waiting`) while `older` dispatchers still run beside the schema."""

    version: int
    applied: list[int]
    waiting: int | None
    older: int


async def migrate(settings: Settings, *, contract: bool) -> Migration:
    """Apply the missing migrations (safe from several processes at once)."""
    conn = await db.connect(settings.database_url.get_secret_value(), settings)
    try:
        applied = await migrations.migrate(
            conn, settings.db_schema, settings.table, contract=contract
        )
        version = await migrations.current_version(conn, settings.db_schema, settings.table)
    finally:
        await conn.close()
    return Migration(version, list(applied), applied.waiting, applied.older)


@dataclass(frozen=True)
class SchemaMigration:
    """`migrate` of one outbox of the sources: where it stands, or why it failed (`error`)."""

    database: str
    schema: str
    table: str
    label: str
    version: int | None = None
    applied: list[int] = field(default_factory=list)
    waiting: int | None = None
    older: int = 0
    error: str | None = None


@dataclass(frozen=True)
class SourcesMigration:
    """`migrate` of every outbox of the sources, and of the fleet's membership table in the
    home database (`fleet`: created, present, or the error)."""

    schemas: list[SchemaMigration]
    fleet: str
    fleet_failed: bool = False
    fleet_table: str = f"{FLEET_SCHEMA}.{MEMBER_TABLE}"

    @property
    def failed(self) -> list[SchemaMigration]:
        return [s for s in self.schemas if s.error is not None]


async def migrate_sources(
    settings: Settings, sources: Sequence[Source], *, only_schema: str | None, contract: bool
) -> SourcesMigration:
    """Migrate every schema of every source that matches (only `only_schema`'s when given),
    database by database over one connection each; a failure is reported and the next schema
    goes on. Then the fleet's membership table in the home database (OUTBOX_DATABASE_URL's)."""
    grouped: dict[str, list[Source]] = {}
    for source in sources:
        grouped.setdefault(source.database, []).append(source)
    done: list[SchemaMigration] = []
    for database, group in grouped.items():
        done += await _migrate_database(settings, database, group, only_schema, contract)
    if only_schema is not None and not done:
        names = ", ".join(sorted({s.schema for s in sources}))
        msg = f"no source serves schema {only_schema!r} (the sources' schemas: {names})"
        raise errors.ConfigurationError(msg)
    fleet, fleet_failed = await _migrate_fleet(settings)
    return SourcesMigration(done, fleet, fleet_failed)


async def _migrate_database(
    settings: Settings,
    database: str,
    sources: list[Source],
    only_schema: str | None,
    contract: bool,
) -> list[SchemaMigration]:
    url = sources[0].database_url.get_secret_value()
    try:
        conn = await db.connect(url, settings, setting="OUTBOX_SOURCES")
    except FAILURES as exc:
        reason = str(exc) if isinstance(exc, errors.OutboxDispatcherError) else _reason(exc, url)
        return [_failed(database, o, reason) for o in _literal_outboxes(sources, only_schema)]
    try:
        try:
            schemas = await CatalogStore(conn).schemas()
        except FAILURES as exc:
            return [
                _failed(database, o, _reason(exc, url))
                for o in _literal_outboxes(sources, only_schema)
            ]
        outboxes = [
            o
            for table in sorted({s.table for s in sources})
            for o in expand([s for s in sources if s.table == table], database, schemas)
            if only_schema is None or o.schema == only_schema
        ]
        return [await _migrate_one(conn, url, o, contract) for o in outboxes]
    finally:
        await conn.close()


# What fails one schema's migration and lets the next one go on.
FAILURES: tuple[type[BaseException], ...] = (
    db.PostgresError,
    errors.OutboxDispatcherError,
    *db.CONNECTION_ERRORS,
)


async def _migrate_one(
    conn: db.Connection, url: str, outbox: Outbox, contract: bool
) -> SchemaMigration:
    where = (outbox.database, outbox.schema, outbox.table, outbox.label)
    if conn.is_closed():
        return SchemaMigration(*where, error="the connection to its database was lost before it")
    try:
        applied = await migrations.migrate(conn, outbox.schema, outbox.table, contract=contract)
        version = await migrations.current_version(conn, outbox.schema, outbox.table)
    except FAILURES as exc:
        return SchemaMigration(*where, error=_reason(exc, url))
    return SchemaMigration(*where, version, list(applied), applied.waiting, applied.older)


def _literal_outboxes(sources: list[Source], only_schema: str | None) -> list[Outbox]:
    """What a database that cannot be reached is reported as: its sources, a pattern as is."""
    return [Outbox(s, s.schema) for s in sources if only_schema is None or s.matches(only_schema)]


def _failed(database: str, outbox: Outbox, reason: str) -> SchemaMigration:
    return SchemaMigration(database, outbox.schema, outbox.table, outbox.label, error=reason)


def _reason(exc: BaseException, url: str) -> str:
    return db.redact(errors.describe(exc), url)


async def _migrate_fleet(settings: Settings) -> tuple[str, bool]:
    """The membership table in the home database: ('created' | 'present' | why not, failed)."""
    url = settings.database_url.get_secret_value()
    try:
        conn = await db.connect(url, settings)
        try:
            created = await FleetStore(conn).create()
        finally:
            await conn.close()
    except FAILURES as exc:
        return _reason(exc, url), True
    return ("created" if created else "present"), False
