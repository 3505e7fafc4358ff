"""`outbox-dispatcher migrate` with OUTBOX_SOURCES, as a real process against real PostgreSQL
(issue 36): every matching schema of every source in two databases, one line each; a schema
that fails and a database that cannot be reached do not stop the others, and the exit code says
so; --schema migrates one; the fleet's membership table is created in the home database."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator

import asyncpg
import pytest

from outbox_dispatcher.store import migrations

from .helpers import Ran, Services
from .sources_helpers import execute, fresh_database, migrate

pytestmark = pytest.mark.integration

LATEST = migrations.latest_version()


@pytest.fixture
async def two_databases(services: Services) -> AsyncIterator[tuple[str, str]]:
    async with (
        fresh_database(services.database_url) as a,
        fresh_database(services.database_url) as b,
    ):
        yield a, b


async def migrate_cli(home: str, sources: list[dict[str, str]], *args: str) -> Ran:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env |= {"OUTBOX_DATABASE_URL": home, "OUTBOX_SOURCES": json.dumps(sources)}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "outbox_dispatcher", "migrate", *args,
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode is not None
    return Ran(process.returncode, out.decode(), err.decode())


async def version(url: str, schema: str) -> int:
    conn = await asyncpg.connect(url)
    try:
        return await migrations.current_version(conn, schema, "outbox")
    finally:
        await conn.close()


def line_of(ran: Ran, schema: str) -> str:
    [line] = [line for line in ran.out.splitlines() if line.startswith(f"schema {schema}.")]
    return line


async def test_migrate_every_schema_of_every_source(two_databases: tuple[str, str]) -> None:
    a, b = two_databases
    await execute(a, "CREATE SCHEMA tenant_a; CREATE SCHEMA tenant_b; CREATE SCHEMA other")
    await migrate(a, "tenant_c")  # already at the latest version
    # A schema whose migration fails: a table of that name that is no outbox.
    await execute(a, "CREATE SCHEMA tenant_bad; CREATE TABLE tenant_bad.outbox (x int)")
    gone = "postgresql://outbox:pw-s3cret@127.0.0.1:1/nowhere"
    sources = [
        {"schema": "tenant_*"},
        {"schema": "public", "database_url": b, "name": "shard_b"},
        {"schema": "public", "database_url": gone, "name": "gone"},
    ]
    ran = await migrate_cli(a, sources)
    assert ran.code == 1, ran
    for schema in ("tenant_a", "tenant_b"):
        assert line_of(ran, schema).endswith(
            f"is at version {LATEST} (applied {', '.join(map(str, range(1, LATEST + 1)))})"
        )
        assert await version(a, schema) == LATEST
    assert line_of(ran, "tenant_c").endswith(f"is at version {LATEST} (nothing to apply)")
    assert "FAILED: DuplicateTableError" in line_of(ran, "tenant_bad")
    public = [line for line in ran.out.splitlines() if line.startswith("schema public.")]
    assert len(public) == 2
    assert any("(source shard_b) is at version" in line for line in public)
    assert any("(source gone) FAILED: cannot reach PostgreSQL" in line for line in public)
    assert await version(b, "public") == LATEST
    assert await version(a, "other") == 0  # no source's schema
    assert "fleet membership table outbox_fleet.member of the home database: created" in ran.out
    assert "2 of 7 migrations failed" in ran.err
    assert "pw-s3cret" not in ran.out + ran.err

    # The broken one fixed, --schema migrates it alone.
    await execute(a, "DROP TABLE tenant_bad.outbox")
    again = await migrate_cli(a, sources[:2], "--schema", "tenant_bad")
    assert again.code == 0, again
    assert [line.split(" (source")[0] for line in again.out.splitlines()[:-1]] == [
        f"schema tenant_bad.outbox of {line_of(ran, 'tenant_bad').split(' of ')[1].split(' ')[0]}"
    ]
    assert "applied 1," in again.out
    assert "outbox_fleet.member of the home database: present" in again.out
    assert await version(a, "tenant_bad") == LATEST

    unknown = await migrate_cli(a, sources[:2], "--schema", "nobody")
    assert unknown.code == 2, unknown
    assert "no source serves schema 'nobody'" in unknown.err


async def test_a_schema_created_later_is_migrated_by_the_next_run(
    two_databases: tuple[str, str],
) -> None:
    a, _ = two_databases
    sources = [{"schema": "tenant_*", "table": "events", "name": "tenants"}]
    first = await migrate_cli(a, sources)
    assert first.code == 0, first
    assert [line for line in first.out.splitlines() if line.startswith("schema ")] == []
    await execute(a, "CREATE SCHEMA tenant_new")
    second = await migrate_cli(a, sources)
    assert second.code == 0, second
    assert "schema tenant_new.events of" in second.out
    assert "(source tenants/tenant_new) is at version" in second.out
    conn = await asyncpg.connect(a)
    try:
        assert await migrations.current_version(conn, "tenant_new", "events") == LATEST
    finally:
        await conn.close()
