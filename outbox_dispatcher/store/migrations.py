"""Applies schema/migrations/*.sql in order and checks the version a database is at.

The files are plain SQL with ${schema} and ${table} placeholders, so Flyway or Liquibase can apply
the same files; each file records its own version in <table>_schema_version.
"""

from __future__ import annotations

import functools
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import structlog

from outbox_dispatcher import errors
from outbox_dispatcher.config.names import quote_identifier, validate_identifier
from outbox_dispatcher.store import db
from outbox_dispatcher.store.base import StoreBase
from outbox_dispatcher.store.statements import Statements

log = structlog.get_logger(__name__)

_MIGRATION_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


def schema_dir() -> Path:
    """The packaged schema/ (in a wheel) or the source tree's schema/."""
    package = Path(__file__).resolve().parent.parent
    packaged = package / "_schema"
    if packaged.is_dir():
        return packaged
    return package.parent / "schema"


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    path: Path


def load_migrations(directory: Path | None = None) -> list[Migration]:
    directory = directory or schema_dir() / "migrations"
    found = []
    for path in sorted(directory.glob("*.sql")):
        match = _MIGRATION_NAME.match(path.name)
        if not match:
            msg = f"{path}: migration files are named NNNN_name.sql"
            raise errors.ConfigurationError(msg)
        found.append(Migration(int(match.group(1)), match.group(2), path))
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        msg = f"migrations in {directory} must be numbered 1..n without gaps, found {versions}"
        raise errors.ConfigurationError(msg)
    return found


@functools.cache
def latest_version() -> int:
    """The packaged migrations' last version, read once (the registry asks at each outbox)."""
    return len(load_migrations())


def render(sql: str, schema: str, table: str) -> str:
    """Fill the placeholders with validated names; the only place DDL gets identifiers."""
    validate_identifier(schema, "schema")
    validate_identifier(table, "table")
    return sql.replace("${schema}", quote_identifier(schema)).replace("${table}", table)


def render_roles(schema: str, table: str, owner_role: str, dispatcher_role: str) -> str:
    """schema/roles.sql with every placeholder filled by a validated, quoted name."""
    sql = (schema_dir() / "roles.sql").read_text("utf-8")
    for role in (owner_role, dispatcher_role):
        validate_identifier(role, "role")
    return (
        render(sql, schema, table)
        .replace("${owner_role}", quote_identifier(owner_role))
        .replace("${dispatcher_role}", quote_identifier(dispatcher_role))
    )


def lock_key(schema: str, table: str) -> int:
    """A stable advisory-lock key for one outbox table (migrations and the claim's lock space)."""
    return zlib.crc32(f"outbox-dispatcher:{schema}.{table}".encode()) & 0x7FFFFFFF


# The oldest schema version this dispatcher runs on: version 10 (claim engine v3, expanded beside
# version 9 for a rolling upgrade) and version 11 (contracted) both serve it.
OLDEST_SUPPORTED = 10
# The console's version (12): the operator's audit records, logins and replay counts, and the
# heartbeat's counters, which a dispatcher writes only from here on (it runs from
# OLDEST_SUPPORTED on). The operator commands and the console need it.
CONSOLE_VERSION = 12
# The delivery mode's version (14): the heartbeat's `delivery` column, which a dispatcher writes
# only from here on (a new release may beat on 10 to 13 during a rolling upgrade).
DELIVERY_VERSION = 14
# Exactly-once's version (15): each dispatcher records its transactional ids, which a takeover
# fences. An exactly-once dispatcher needs it; an at-least-once one runs from OLDEST_SUPPORTED on.
TRANSACTIONAL_IDS_VERSION = 15
# Claim engine v4's version (16): the steady path's one-statement claim and settle (dispatch.sql
# `claim_steady`, `settle_steady`) read its columns; on older versions the dispatcher runs the
# engine's functions alone.
STEADY_VERSION = 16
# Exactly-once's progress identity (16, issue 35, E5): the outbox's uuid in progress records
# (<table>_cursor.progress_id) and the reconcile duty. An exactly-once dispatcher needs it.
PROGRESS_ID_VERSION = 16
# Steps that a dispatcher older than 10 cannot run beside: `migrate` applies them only once no
# such dispatcher beats (docs/operations.md, "Upgrading").
CONTRACT_STEPS = frozenset({11})
# How recently an older dispatcher must have beaten to hold a contract step back (registry's
# LIVE_SECONDS: three missed heartbeats).
OLDER_LIVE_SECONDS = 35.0


async def current_version(conn: db.Executor, schema: str, table: str) -> int:
    """The highest version applied. From version 10 on a step records itself in
    <table>_schema_steps; <table>_schema_version, which dispatchers of version 9 and older read,
    only gets the steps those cannot run beside (so that a rolling upgrade keeps them ready)."""
    store = _store(conn, schema, table)
    if not await store.relation_exists(relation=_relation(schema, f"{table}_schema_version")):
        return 0
    if await store.relation_exists(relation=_relation(schema, f"{table}_schema_steps")):
        return await store.schema_version()
    return await store.schema_version_before_steps()


def _store(conn: db.Executor, schema: str, table: str) -> StoreBase:
    return StoreBase(conn, Statements.for_table(schema, table))


def _relation(schema: str, name: str) -> str:
    """A relation's name as to_regclass reads it: quoted, so that any case survives."""
    return f"{quote_identifier(schema)}.{quote_identifier(name)}"


async def older_dispatchers(conn: db.Executor, schema: str, table: str) -> int:
    """Dispatchers older than version 10 that beat lately (0 when the table has none yet)."""
    store = _store(conn, schema, table)
    dispatchers = _relation(schema, f"{table}_dispatchers")
    if not await store.relation_exists(relation=dispatchers):
        return 0
    if not await store.column_exists(relation=dispatchers, column="version"):
        return len(await store.dispatchers_live(live_seconds=OLDER_LIVE_SECONDS))
    return await store.live_older_dispatchers(seconds=OLDER_LIVE_SECONDS, version=OLDEST_SUPPORTED)


class Migrated(list[int]):
    """The versions `migrate` applied (a list), and the contract step it left for later because
    dispatchers older than version 10 still run (`waiting`: its version; `older`: how many)."""

    def __init__(self, applied: list[int], waiting: int | None = None, older: int = 0) -> None:
        super().__init__(applied)
        self.waiting = waiting
        self.older = older


async def migrate(
    conn: asyncpg.Connection, schema: str, table: str, *, contract: bool = False
) -> Migrated:
    """Apply what is missing, safely from several processes at once. A contract step waits
    while dispatchers older than version 10 beat (`contract`: apply it anyway)."""
    migrations = load_migrations()
    applied: list[int] = []
    store = _store(conn, schema, table)
    await store.migration_lock(key=lock_key(schema, table))
    try:
        # Only when missing: CREATE SCHEMA IF NOT EXISTS checks the database's CREATE privilege
        # even for an existing schema, which a least-privilege owner role (schema/roles.sql)
        # does not have.
        if not await store.schema_exists(schema_name=schema):
            await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {quote_identifier(schema)}")
        version = await current_version(conn, schema, table)
        if version > len(migrations):
            raise errors.SchemaVersionError(_too_new(version, len(migrations)))
        for migration in migrations[version:]:
            if migration.version in CONTRACT_STEPS and not contract:
                older = await older_dispatchers(conn, schema, table)
                if older:
                    log.warning(
                        "migration_waits_for_older_dispatchers",
                        version=migration.version,
                        older_dispatchers=older,
                    )
                    return Migrated(applied, migration.version, older)
            sql = render(migration.path.read_text("utf-8"), schema, table)
            async with conn.transaction():
                await conn.execute(sql)
            log.info("migration_applied", version=migration.version, name=migration.name)
            applied.append(migration.version)
    finally:
        await store.migration_unlock(key=lock_key(schema, table))
    return Migrated(applied)


def exactly_once_refusal(version: int) -> str | None:
    """Why an outbox at `version` is not served exactly-once (None: it is): the fleet refuses
    it alone (dispatch/fleet.py) and `status` says so (operate/sources.py)."""
    if version >= PROGRESS_ID_VERSION:
        return None
    return (
        f"schema version {version}: exactly-once delivery needs version {PROGRESS_ID_VERSION} "
        "or later (run `outbox-dispatcher migrate`)"
    )


def supported(version: int) -> bool:
    """Whether this dispatcher runs on a schema at `version`."""
    return OLDEST_SUPPORTED <= version <= latest_version()


async def check_version(
    conn: db.Executor,
    schema: str,
    table: str,
    *,
    oldest: int = OLDEST_SUPPORTED,
    who_needs: str = "this dispatcher needs",
) -> int:
    """Refuse to run against a schema this version does not understand (older than `oldest`,
    which `who_needs`, or newer than the latest); the version it is at."""
    expected = latest_version()
    version = await current_version(conn, schema, table)
    if version == 0:
        msg = (
            f"there is no outbox table {schema}.{table} in this database: check OUTBOX_SCHEMA, "
            "OUTBOX_TABLE and the database in OUTBOX_DATABASE_URL; for a new outbox, run "
            "`outbox-dispatcher migrate` (or apply schema/migrations with your migration tool)"
        )
        raise errors.SchemaVersionError(msg)
    if version < oldest:
        msg = (
            f"the outbox schema of {schema}.{table} is at version {version}, {who_needs} "
            f"{oldest} or later: run `outbox-dispatcher migrate` (or apply "
            "schema/migrations with your migration tool), then start again"
        )
        raise errors.SchemaVersionError(msg)
    if version > expected:
        raise errors.SchemaVersionError(_too_new(version, expected))
    return version


def _too_new(version: int, expected: int) -> str:
    return (
        f"the outbox schema is at version {version}, newer than this dispatcher understands "
        f"({expected}): upgrade outbox-dispatcher"
    )
