"""The writer contract: schema.sql equals the migrations; writers get clear errors; migrate is
idempotent and concurrent-safe; the dispatcher refuses a schema it does not understand."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess

import asyncpg
import pytest

from outbox_dispatcher import errors
from outbox_dispatcher.dispatch.supervisor import Dispatcher
from outbox_dispatcher.store import migrations

pytestmark = pytest.mark.integration


PG_ATTVER = re.compile(r"ALTER TABLE ONLY \S+ ALTER COLUMN \S+ SET \(pg_attver=\d+\);")


def _pg_dump(url: str) -> str:
    pg_dump = shutil.which("pg_dump")
    assert pg_dump, "pg_dump (postgresql-client) is needed to compare catalogs"
    out = subprocess.run(
        [pg_dump, "--schema-only", "--no-owner", "--no-privileges", url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    # Comments carry no catalog content; blank lines vary; \restrict carries a random key.
    # Debian's PostgreSQL 15.20 stamps every column with a pg_attver option that differs per
    # CREATE, so two equal catalogs dump different `ALTER COLUMN ... SET (pg_attver=N)` lines.
    return "\n".join(
        line
        for line in out.splitlines()
        if line.strip()
        and not line.startswith(("--", "\\restrict", "\\unrestrict"))
        and not PG_ATTVER.fullmatch(line)
    )


async def _versions(url: str) -> list[tuple[int, str]]:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch("SELECT version, name FROM outbox_schema_version ORDER BY 1")
    finally:
        await conn.close()
    return [(r["version"], r["name"]) for r in rows]


async def test_schema_sql_builds_the_same_catalog_as_the_migrations(
    database_url: str, empty_database_url: str
) -> None:
    conn = await asyncpg.connect(empty_database_url)
    try:
        sql = (migrations.schema_dir() / "schema.sql").read_text()
        await conn.execute(migrations.render(sql, "public", "outbox"))
    finally:
        await conn.close()
    from_migrations = _pg_dump(database_url)
    from_schema = _pg_dump(empty_database_url)
    assert "CREATE TABLE public.outbox" in from_migrations
    assert from_schema == from_migrations
    assert await _versions(empty_database_url) == await _versions(database_url)


async def test_enqueue_functions_and_defaults(conn: asyncpg.Connection) -> None:
    event_id = await conn.fetchval(
        "SELECT outbox_enqueue('orders', 'order-1', '\\x0102'::bytea, '{\"a\": \"b\"}')"
    )
    json_id = await conn.fetchval(
        "SELECT outbox_enqueue_json('orders', 'order-1', '{\"total\": 3}'::jsonb)"
    )
    plain = await conn.fetchrow("SELECT * FROM outbox WHERE event_id = $1", event_id)
    doc = await conn.fetchrow("SELECT * FROM outbox WHERE event_id = $1", json_id)
    assert plain["payload"] == b"\x01\x02"
    assert plain["ordering_key"] == "order-1"
    assert plain["published_at"] is None and plain["attempts"] == 0
    assert doc["payload"] == b'{"total": 3}'
    assert '"content-type": "application/json"' in doc["headers"]
    assert doc["id"] > plain["id"]


@pytest.mark.parametrize(
    ("headers", "topic", "constraint"),
    [
        ('{"a": 1}', "orders", "outbox_headers_valid"),
        ('["a"]', "orders", "outbox_headers_valid"),
        ('{"a": {"b": "c"}}', "orders", "outbox_headers_valid"),
        ("{}", "bad topic!", "outbox_topic_valid"),
        ("{}", "", "outbox_topic_valid"),
        ("{}", "x" * 250, "outbox_topic_valid"),
        ("{}", ".", "outbox_topic_valid"),
        ("{}", "..", "outbox_topic_valid"),
        ("{}", "a\nb", "outbox_topic_valid"),
        ("{}", "__consumer_offsets", "outbox_topic_not_internal"),
        ("{}", "__anything", "outbox_topic_not_internal"),
    ],
)
async def test_malformed_rows_are_rejected_at_write_time(
    conn: asyncpg.Connection, headers: str, topic: str, constraint: str
) -> None:
    with pytest.raises(asyncpg.CheckViolationError, match=constraint):
        await conn.execute(
            "INSERT INTO outbox (topic, ordering_key, payload, headers) VALUES ($1, 'k', 'x', $2)",
            topic,
            headers,
        )


@pytest.mark.parametrize("topic", ["x" * 249, "a", "Orders.v2_eu-1", "..."])
async def test_topics_kafka_accepts_are_accepted(conn: asyncpg.Connection, topic: str) -> None:
    """The topic check is Kafka's rule (1 to 249 of [A-Za-z0-9._-], not "." or ".."), written
    with `+` and a length because a bounded repetition is slow in PostgreSQL's regex engine."""
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload) VALUES ($1, 'k', 'x')", topic
    )


async def test_event_id_is_unique(conn: asyncpg.Connection) -> None:
    await conn.execute(
        "INSERT INTO outbox (topic, payload, event_id) VALUES ('t', 'x', "
        "'00000000-0000-0000-0000-000000000001')"
    )
    with pytest.raises(asyncpg.UniqueViolationError):
        await conn.execute(
            "INSERT INTO outbox (topic, payload, event_id) VALUES ('t', 'y', "
            "'00000000-0000-0000-0000-000000000001')"
        )


async def test_migrate_is_idempotent_and_safe_concurrently(empty_database_url: str) -> None:
    conns = [await asyncpg.connect(empty_database_url) for _ in range(3)]
    try:
        results = await asyncio.gather(*(migrations.migrate(c, "public", "outbox") for c in conns))
        assert sorted(results) == [[], [], list(range(1, migrations.latest_version() + 1))]
        assert await migrations.migrate(conns[0], "public", "outbox") == []
        assert (
            await migrations.current_version(conns[0], "public", "outbox")
            == migrations.latest_version()
        )
    finally:
        for c in conns:
            await c.close()


async def test_custom_schema_and_table(empty_database_url: str) -> None:
    conn = await asyncpg.connect(empty_database_url)
    try:
        await migrations.migrate(conn, "events", "order_outbox")
        event_id = await conn.fetchval(
            "SELECT events.order_outbox_enqueue('orders', 'k', 'x'::bytea)"
        )
        assert (
            await conn.fetchval(
                "SELECT count(*) FROM events.order_outbox WHERE event_id = $1", event_id
            )
            == 1
        )
        assert await conn.fetchval("SELECT to_regclass('public.outbox')") is None
    finally:
        await conn.close()


async def test_refuses_to_start_on_an_older_or_newer_schema(
    empty_database_url: str, database_url: str, make_settings: object
) -> None:
    settings = make_settings(database_url=empty_database_url)  # type: ignore[operator]
    with pytest.raises(errors.SchemaVersionError, match="run `outbox-dispatcher migrate`"):
        await Dispatcher(settings).run()

    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute("INSERT INTO outbox_schema_version (version, name) VALUES (999, 'x')")
    finally:
        await conn.close()
    with pytest.raises(errors.SchemaVersionError, match="upgrade outbox-dispatcher"):
        await Dispatcher(make_settings()).run()  # type: ignore[operator]


def test_migration_files_are_rendered_with_validated_names_only() -> None:
    sql = (migrations.schema_dir() / "migrations" / "0001_initial.sql").read_text()
    rendered = migrations.render(sql, "public", "outbox")
    assert "${" not in rendered
    assert re.search(r'CREATE TABLE "public"\.outbox \(', rendered)
    with pytest.raises(ValueError, match="not allowed"):
        migrations.render(sql, "public", 'outbox"; DROP TABLE x; --')
