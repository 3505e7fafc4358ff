"""plpgsql_check over the PL/pgSQL a migration creates (issue 34): PostgreSQL checks only the
syntax of a function it creates, so a column renamed under the engine, a wrong type or a typo in
a rarely taken branch would otherwise show when that branch first runs in production. Every
check is on: errors fail, and a warning fails unless ALLOWED says why it is acceptable.

The extension is created in the app database by deploy/local/services.sh (postgres.sh): on that
stack this test must run. Only the testcontainers stack may lack it (then the test skips)."""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import pytest

from outbox_dispatcher.store import migrations

from .helpers import Services

ROOT = Path(__file__).resolve().parents[2]
TABLE = "outbox"


@dataclass(frozen=True)
class Allowed:
    """A warning that may stay: `function` is the name after `<table>_`, `message` a regex."""

    function: str
    message: str
    why: str


# The old dispatchers' entry points (schema/tables.sql): their bodies only raise "upgrade
# outbox-dispatcher", and their signatures (parameters, OUT columns) must stay what those
# releases call.
_RETIRED = {
    "claim": ("unused parameter", "unmodified OUT variable"),
    "claim_keys": ("unused parameter", "unmodified OUT variable"),
    "settle": ("unused parameter",),
}
ALLOWED = (
    *(
        Allowed(name, pattern, "a retired entry point: it only raises, its signature is fixed")
        for name, patterns in _RETIRED.items()
        for pattern in (*patterns, "routine is marked as VOLATILE, should be IMMUTABLE")
    ),
    Allowed(
        "discover",
        r'unused parameter "p_hole_margin"',
        "no longer read, kept so that the dispatchers' call keeps its signature (discover.sql)",
    ),
)


@dataclass(frozen=True)
class Finding:
    function: str
    line: int | None
    level: str
    message: str

    def __str__(self) -> str:
        return f"{self.function} line {self.line}: {self.level}: {self.message}"


async def _extension_schema(conn: asyncpg.Connection) -> str | None:
    """Where plpgsql_check is installed; where it is only available, create it (a superuser:
    the testcontainers stack)."""
    query = "SELECT extnamespace::regnamespace::text FROM pg_extension WHERE extname = $1"
    found: str | None = await conn.fetchval(query, "plpgsql_check")
    if found is not None:
        return found
    available = await conn.fetchval(
        "SELECT true FROM pg_available_extensions WHERE name = 'plpgsql_check'"
    )
    if not available or not await conn.fetchval(
        "SELECT rolsuper FROM pg_roles WHERE rolname = current_user"
    ):
        return None
    await conn.execute("CREATE SCHEMA IF NOT EXISTS plpgsql_check")
    await conn.execute("CREATE EXTENSION IF NOT EXISTS plpgsql_check SCHEMA plpgsql_check")
    return "plpgsql_check"


@pytest.fixture
async def checked(services: Services) -> AsyncIterator[tuple[asyncpg.Connection, str, str]]:
    """(connection, the extension's schema, a schema with a freshly migrated table), in the app
    database (the extension is there); the schema is dropped afterwards."""
    conn = await asyncpg.connect(services.database_url)
    schema = f"plcheck_{uuid.uuid4().hex[:10]}"
    try:
        extension = await _extension_schema(conn)
        if extension is None:
            if os.environ.get("OUTBOX_TEST_STACK") == "containers":
                pytest.skip("plpgsql_check is not available in the PostgreSQL container image")
            pytest.fail(
                "plpgsql_check is not installed in the app database: `make services` installs "
                "postgresql-<major>-plpgsql-check and creates it (deploy/local/lib/postgres.sh)"
            )
        await migrations.migrate(conn, schema, TABLE)
        yield conn, extension, schema
    finally:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await conn.close()


CHECK = """
SELECT p.proname::text AS function, t.lineno AS line, t.level, t.message
  FROM pg_proc p
  JOIN pg_language l ON l.oid = p.prolang AND l.lanname = 'plpgsql'
  -- a trigger function is checked against each relation it fires on
  LEFT JOIN LATERAL (SELECT DISTINCT g.tgrelid FROM pg_trigger g WHERE g.tgfoid = p.oid) r
    ON p.prorettype = 'trigger'::regtype
 CROSS JOIN LATERAL {extension}.plpgsql_check_function_tb(
       p.oid, coalesce(r.tgrelid, 0), fatal_errors => false, other_warnings => true,
       performance_warnings => true, extra_warnings => true, security_warnings => true,
       compatibility_warnings => true) t
 WHERE p.pronamespace = $1::regnamespace AND starts_with(p.proname, $2)
 ORDER BY 1, 2, 4
"""


async def check(conn: asyncpg.Connection, extension: str, schema: str) -> list[Finding]:
    """Every finding of plpgsql_check on the table's PL/pgSQL functions."""
    rows = await conn.fetch(CHECK.format(extension=extension), schema, f"{TABLE}_")
    return [
        Finding(r["function"].removeprefix(f"{TABLE}_"), r["line"], r["level"], r["message"])
        for r in rows
    ]


def covers(entry: Allowed, finding: Finding) -> bool:
    return (
        finding.level != "error"
        and entry.function == finding.function
        and re.search(entry.message, finding.message) is not None
    )


def allowed(finding: Finding) -> bool:
    return any(covers(a, finding) for a in ALLOWED)


async def plpgsql_functions(conn: asyncpg.Connection, schema: str) -> set[str]:
    names = await conn.fetch(
        "SELECT p.proname FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang"
        " WHERE l.lanname = 'plpgsql' AND p.pronamespace = $1::regnamespace",
        schema,
    )
    return {r["proname"].removeprefix(f"{TABLE}_") for r in names}


def engine_plpgsql() -> set[str]:
    """The engine functions written in PL/pgSQL, from their sources (schema/engine/)."""
    sources = (ROOT / "schema" / "engine").glob("*.sql")
    return {p.stem for p in sources if re.search(r"LANGUAGE\s+plpgsql", p.read_text(), re.I)}


async def test_the_engine_passes_plpgsql_check(
    checked: tuple[asyncpg.Connection, str, str],
) -> None:
    conn, extension, schema = checked
    assert engine_plpgsql() <= await plpgsql_functions(conn, schema), "engine functions missing"
    findings = await check(conn, extension, schema)
    assert [str(f) for f in findings if not allowed(f)] == []
    stale = [a for a in ALLOWED if not any(covers(a, f) for f in findings)]
    assert stale == [], "ALLOWED entries that match nothing any more: remove them"


BROKEN = """
CREATE FUNCTION "{schema}".{table}_broken() RETURNS bigint LANGUAGE plpgsql AS $fn$
DECLARE
    v_unused integer;
    v_rows bigint;
BEGIN
    SELECT count(*) INTO v_rows FROM "{schema}".{table}_work w WHERE w.claim_tokn IS NOT NULL;
    RETURN v_rows;
END;
$fn$
"""


async def test_the_check_finds_a_broken_function(
    checked: tuple[asyncpg.Connection, str, str],
) -> None:
    """The check has teeth: a function of the table that PostgreSQL creates without a word (a
    misspelt column, an unused variable) is found by its prefix and reported, the column as an
    error, the variable as a warning that ALLOWED does not cover."""
    conn, extension, schema = checked
    await conn.execute(BROKEN.format(schema=schema, table=TABLE))
    findings = [f for f in await check(conn, extension, schema) if f.function == "broken"]
    assert any(f.level == "error" and "claim_tokn" in f.message for f in findings), findings
    assert any(not allowed(f) and "v_unused" in f.message for f in findings), findings
