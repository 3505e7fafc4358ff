"""What the many-outboxes tests share (issue 36): databases of their own, tenant schemas migrated
or half-made, and the registry run in the background."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable

import asyncpg
from pydantic import SecretStr

from outbox_dispatcher.config.outboxes import Source
from outbox_dispatcher.sources.registry import SourceRegistry, View
from outbox_dispatcher.store import db, migrations

from .conftest import drop_database

APPLICATION = "outbox-sources-test"  # the registry's sessions in pg_stat_activity


def with_database(url: str, name: str) -> str:
    return f"{url.rpartition('/')[0]}/{name}"


@contextlib.asynccontextmanager
async def fresh_database(admin_url: str) -> AsyncIterator[str]:
    """An empty database of its own, dropped afterwards."""
    name = f"outbox_src_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(admin_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    try:
        yield with_database(admin_url, name)
    finally:
        admin = await asyncpg.connect(admin_url)
        try:
            await admin.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS true')
            await drop_database(admin, name)
        finally:
            await admin.close()


async def migrate(url: str, *schemas: str, table: str = "outbox") -> None:
    conn = await asyncpg.connect(url)
    try:
        for schema in schemas:
            await migrations.migrate(conn, schema, table)
    finally:
        await conn.close()


async def execute(url: str, sql: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def source(url: str, schema: str, *, name: str | None = None, table: str = "outbox") -> Source:
    return Source(SecretStr(url), schema, table, name)


async def plain_connect(url: str) -> db.Connection:
    conn: db.Connection = await asyncpg.connect(
        url, timeout=5, server_settings={"application_name": APPLICATION}
    )
    await db.init_connection(conn)
    return conn


@contextlib.asynccontextmanager
async def running(registry: SourceRegistry) -> AsyncIterator[None]:
    stopping = asyncio.Event()
    task = asyncio.create_task(registry.run(stopping))
    try:
        yield
    finally:
        stopping.set()
        await asyncio.wait_for(task, 15)


async def until(
    registry: SourceRegistry, check: Callable[[View], bool], timeout: float = 10.0
) -> float:
    """Seconds until `check` holds for the registry's view (fails after `timeout`)."""
    started = time.monotonic()
    while not check(registry.view()):
        if time.monotonic() - started > timeout:
            msg = f"not within {timeout}s: {registry.view()}"
            raise AssertionError(msg)
        await asyncio.sleep(0.05)
    return time.monotonic() - started


def schemas_ready(view: View) -> set[tuple[str, str]]:
    """(database name, schema) of every ready outbox."""
    return {(o.database.rpartition("/")[2], o.schema) for o in view.ready()}
