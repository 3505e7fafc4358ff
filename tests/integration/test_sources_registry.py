"""The source registry against real PostgreSQL (issue 36): tenant schemas of a pattern in one
database and a named source in another are followed while the registry runs: a tenant schema
migrated meanwhile is found within seconds, a dropped one is let go, a database that stops and a
broken schema back off alone with one log line per change, one catalogue read per database and
interval, at most one connection per database."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator

import asyncpg
import pytest
from structlog.testing import capture_logs

from outbox_dispatcher.sources.registry import DatabaseState, SourceRegistry, State, View
from outbox_dispatcher.store import db, migrations

from .helpers import Services
from .sources_helpers import (
    APPLICATION,
    execute,
    fresh_database,
    migrate,
    plain_connect,
    running,
    schemas_ready,
    source,
    until,
)

pytestmark = pytest.mark.integration

INTERVAL = 0.2


@pytest.fixture
async def two_databases(services: Services) -> AsyncIterator[tuple[str, str]]:
    async with (
        fresh_database(services.database_url) as a,
        fresh_database(services.database_url) as b,
    ):
        yield a, b


def name(url: str) -> str:
    return url.rpartition("/")[2]


def registry_of(a: str, b: str, **kwargs: float) -> SourceRegistry:
    sources = [source(a, "tenant_*"), source(b, "public", name="shard_b")]
    return SourceRegistry(sources, plain_connect, interval=INTERVAL, jitter=False, **kwargs)


async def registry_connections(admin_url: str, database: str) -> int:
    conn = await asyncpg.connect(admin_url)
    try:
        return int(
            await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 "
                "AND application_name = $2",
                database,
                APPLICATION,
            )
        )
    finally:
        await conn.close()


async def test_tenants_are_followed_across_two_databases(
    services: Services, two_databases: tuple[str, str]
) -> None:
    a, b = two_databases
    await migrate(a, "tenant_a", "tenant_b", "other")
    await execute(a, "CREATE SCHEMA tenant_empty")  # matches, holds no outbox: not an outbox
    await migrate(b, "public")
    registry = registry_of(a, b)
    with capture_logs() as logged:
        async with running(registry):
            expected = {(name(a), "tenant_a"), (name(a), "tenant_b"), (name(b), "public")}
            await until(registry, lambda v: schemas_ready(v) == expected)
            assert len(registry.view().outboxes) == 3  # tenant_empty and other are no outbox

            # A tenant created and migrated while it runs: served within seconds.
            created = time.monotonic()
            await migrate(a, "tenant_new")
            found = await until(registry, lambda v: (name(a), "tenant_new") in schemas_ready(v))
            assert found <= 5.0, f"tenant_new found after {found:.1f}s"
            print(f"\ntenant_new ready {time.monotonic() - created:.2f}s after its migration began")

            # A dropped one is let go (once), the others stay.
            await execute(a, "DROP SCHEMA tenant_b CASCADE")
            await until(registry, lambda v: (name(a), "tenant_b") not in schemas_ready(v))
            await asyncio.sleep(5 * INTERVAL)
            view = registry.view()
            assert schemas_ready(view) == {
                (name(a), "tenant_a"), (name(a), "tenant_new"), (name(b), "public"),
            }  # fmt: skip
            assert [d.reachable for d in view.databases] == [True, True]
    let_go = [e for e in logged if e["event"] == "outbox_let_go"]
    assert [e["source"] for e in let_go] == ["tenant_b.outbox"]
    ready = sorted(e["source"] for e in logged if e["event"] == "outbox_ready")
    assert ready == ["shard_b", "tenant_a.outbox", "tenant_b.outbox", "tenant_new.outbox"]
    assert not [e for e in logged if e["log_level"] == "warning"]


async def test_one_catalogue_read_per_database_and_interval_whatever_the_schemas(
    services: Services, two_databases: tuple[str, str]
) -> None:
    """Every statement the registry's connections run, logged by the driver: once the 13
    outboxes (12 tenant schemas in one database) are ready, one catalogue read per database and
    interval and nothing per schema, the cheap fingerprint (the full read only when it changes:
    a tenant migrated meanwhile is found by it); one connection per database."""
    a, b = two_databases
    await migrate(a, *(f"tenant_{n:02}" for n in range(12)))
    await migrate(b, "public")
    statements: list[tuple[str, str]] = []

    async def logged_connect(url: str) -> db.Connection:
        conn = await plain_connect(url)
        conn.add_query_logger(lambda q: statements.append((name(url), q.query)))
        return conn

    registry = SourceRegistry(
        [source(a, "tenant_*"), source(b, "public", name="shard_b")],
        logged_connect,
        interval=INTERVAL,
        jitter=False,
    )
    async with running(registry):
        await until(registry, lambda v: len(v.ready()) == 13)
        first_pass = len(statements)
        await asyncio.sleep(3)
        steady = statements[first_pass:]
        reads = {d.database.rpartition("/")[2]: d.reads for d in registry.view().databases}
        assert await registry_connections(services.database_url, name(a)) == 1
        assert await registry_connections(services.database_url, name(b)) == 1
    per_database = Counter(database for database, _ in steady)
    assert 3 / INTERVAL * 0.5 <= per_database[name(a)] <= 3 / INTERVAL + 2
    assert abs(per_database[name(a)] - per_database[name(b)]) <= 2  # 12 schemas vs 1
    assert {query.split("FROM")[0].strip() for _, query in steady} == {
        "SELECT count(*) AS relations, coalesce(sum(t.relnamespace::bigint), 0) AS namespaces"
    }, "while nothing changes, the fingerprint only"
    assert reads[name(a)] >= per_database[name(a)]
    # The first pass read each new outbox's version (and its migration lock) once.
    assert first_pass >= 13
    # A tenant migrated now changes the fingerprint: the full read follows, and finds it.
    async with running(registry):
        await until(registry, lambda v: len(v.ready()) == 13)
        await migrate(a, "tenant_late")
        await until(registry, lambda v: len(v.ready()) == 14)


async def test_a_database_that_stops_backs_off_alone_and_comes_back(
    services: Services, two_databases: tuple[str, str]
) -> None:
    a, b = two_databases
    await migrate(a, "tenant_a")
    await migrate(b, "public")
    registry = registry_of(a, b, backoff_initial=INTERVAL, backoff_max=0.8)
    with capture_logs() as logged:
        async with running(registry):
            await until(registry, lambda v: len(v.ready()) == 2)
            # Database b stops taking connections, and its sessions end.
            await execute(
                services.database_url, f'ALTER DATABASE "{name(b)}" WITH ALLOW_CONNECTIONS false'
            )
            await execute(
                services.database_url,
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                f"WHERE datname = '{name(b)}'",
            )
            await until(registry, lambda v: not _database(v, b).reachable)
            reads_a = _database(registry.view(), a).reads
            await asyncio.sleep(3.0)
            view = registry.view()
            down = _database(view, b)
            # Backed off, doubling to 0.8 s: 0.2, 0.4, 0.8, 0.8, 0.8 ... in 3 s, not 15 tries.
            assert 3 <= down.failures <= 8, down.failures
            assert "not currently accepting connections" in (down.reason or "")
            assert [o.state for o in view.outboxes if o.outbox.database == down.database] == [
                State.UNREACHABLE
            ]
            assert schemas_ready(view) == {(name(a), "tenant_a")}  # the other one is served
            assert _database(view, a).reads - reads_a >= 3 / INTERVAL * 0.5
            await execute(
                services.database_url, f'ALTER DATABASE "{name(b)}" WITH ALLOW_CONNECTIONS true'
            )
            await until(registry, lambda v: len(v.ready()) == 2, timeout=5)
    events = [(e["event"], e.get("database", "")[-len(name(b)) :]) for e in logged]
    assert events.count(("source_database_unreachable", name(b))) == 1
    assert events.count(("source_database_reachable", name(b))) == 1
    assert "password" not in str(logged) and "outbox:outbox@" not in str(logged)


async def test_a_broken_schema_backs_off_alone(
    services: Services, two_databases: tuple[str, str]
) -> None:
    a, b = two_databases
    await migrate(a, "tenant_a", "tenant_bad", "tenant_lost")
    await migrate(b, "public")
    # Their versions cannot be read: every read of their steps fails, one with an error that a
    # drop since the catalogue read would also give (undefined_table).
    await execute(
        a,
        "DROP TABLE tenant_bad.outbox_schema_steps; "
        "CREATE VIEW tenant_bad.outbox_schema_steps AS SELECT 1 / 0 AS version; "
        "DROP TABLE tenant_lost.outbox_schema_steps; "
        "CREATE FUNCTION tenant_lost.steps() RETURNS SETOF int LANGUAGE plpgsql AS "
        "$$ BEGIN RETURN QUERY EXECUTE 'SELECT version FROM tenant_lost.nowhere'; END $$; "
        "CREATE VIEW tenant_lost.outbox_schema_steps AS SELECT tenant_lost.steps() AS version",
    )
    registry = registry_of(a, b, backoff_initial=INTERVAL, backoff_max=0.8)
    with capture_logs() as logged:
        async with running(registry):
            await until(registry, lambda v: len(v.ready()) == 2 and len(v.failing()) == 2)
            await asyncio.sleep(3.0)
            view = registry.view()
    bad, lost = view.failing()
    assert (bad.outbox.schema, bad.state) == ("tenant_bad", State.BROKEN)
    assert "division by zero" in (bad.reason or "")
    assert (lost.outbox.schema, lost.state) == ("tenant_lost", State.BROKEN)
    assert "UndefinedTableError" in (lost.reason or "")
    for failing in (bad, lost):
        assert 3 <= failing.failures <= 8, failing
    assert schemas_ready(view) == {(name(a), "tenant_a"), (name(b), "public")}
    warnings = [e for e in logged if e["log_level"] == "warning"]
    assert sorted((e["event"], e["source"]) for e in warnings) == [
        ("outbox_not_ready", "tenant_bad.outbox"),
        ("outbox_not_ready", "tenant_lost.outbox"),
    ]


async def test_a_schema_being_migrated_or_too_old_is_pending_then_ready(
    services: Services, two_databases: tuple[str, str]
) -> None:
    """A tenant that `migrate` is migrating (it holds the table's lock) and one whose schema is
    older than this dispatcher runs are pending, with the reason, until the migration is done;
    a literal source whose table is not there is missing."""
    a, b = two_databases
    await migrate(a, "tenant_busy", "tenant_old")
    await execute(
        a,
        "CREATE TABLE public.steps AS SELECT * FROM tenant_old.outbox_schema_steps; "
        "CREATE TABLE public.versions AS SELECT * FROM tenant_old.outbox_schema_version; "
        "DELETE FROM tenant_old.outbox_schema_steps WHERE version >= 10; "
        "DELETE FROM tenant_old.outbox_schema_version WHERE version >= 10",
    )
    migrator = await asyncpg.connect(a)
    await migrator.execute(
        "SELECT pg_advisory_lock($1)", migrations.lock_key("tenant_busy", "outbox")
    )
    registry = SourceRegistry(
        [source(a, "tenant_*"), source(b, "nothing_here", name="lost")],
        plain_connect,
        interval=INTERVAL,
        jitter=False,
    )
    try:
        view = await registry.refresh()
        states = {o.outbox.schema: (o.state, o.reason or "") for o in view.outboxes}
        assert states["tenant_busy"][0] is State.PENDING
        assert "is migrating it" in states["tenant_busy"][1]
        assert states["tenant_old"][0] is State.PENDING
        assert "version 9, this dispatcher needs 10" in states["tenant_old"][1]
        assert states["nothing_here"][0] is State.MISSING
        assert "outbox-dispatcher migrate" in states["nothing_here"][1]
        async with running(registry):
            await asyncio.sleep(1)
            assert registry.view().ready() == []
            await migrator.execute("SELECT pg_advisory_unlock_all()")
            await execute(  # as if its migration had ended now
                a,
                "INSERT INTO tenant_old.outbox_schema_steps SELECT * FROM public.steps "
                "WHERE version >= 10; INSERT INTO tenant_old.outbox_schema_version "
                "SELECT * FROM public.versions WHERE version >= 10",
            )
            waited = await until(
                registry, lambda v: {o.schema for o in v.ready()} == {"tenant_busy", "tenant_old"}
            )
            assert waited <= 2 * INTERVAL + 1
    finally:
        await migrator.close()
        await registry.close()


def _database(view: View, url: str) -> DatabaseState:
    return next(d for d in view.databases if d.database.endswith("/" + name(url)))
