"""The local stack the benchmarks run against, and a fresh database and topic per measurement.

Each measurement gets a database cloned from a template migrated once per run (a freshly
migrated table, as a user's is: its statistics are those of the empty table) and a topic of its
own; both are removed afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.store import migrations

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
WAIT_LIMIT = 900.0  # seconds a wait may take before the scenario fails


@dataclass
class Stack:
    admin_url: str
    bootstrap: str
    proxied_port: int  # the broker listener that advertises proxy_port
    proxy_port: int
    template: str = ""

    def url(self, database: str) -> str:
        base, _, _ = self.admin_url.rpartition("/")
        return f"{base}/{database}"

    @classmethod
    def from_env(cls) -> Stack:
        """The stack of `deploy/local/services.sh` on the ports its variables choose (those of
        `services.sh env` and the tests' variables too, so a second clone's stack is found)."""
        env = os.environ
        pg_port = env.get("OUTBOX_SERVICES_PG_PORT", "5432")
        bootstrap = (
            env.get("OUTBOX_BENCH_KAFKA_BOOTSTRAP_SERVERS")
            or env.get("OUTBOX_TEST_KAFKA_BOOTSTRAP_SERVERS")
            or f"127.0.0.1:{env.get('OUTBOX_SERVICES_KAFKA_PORT', '9092')}"
        )
        # The proxied listener's ports, derived from the broker's as services.sh does.
        kafka_port = int(bootstrap.split(",")[0].rpartition(":")[2])
        proxied = env.get("OUTBOX_TEST_KAFKA_PROXIED_PORT") or env.get(
            "OUTBOX_SERVICES_KAFKA_PROXIED_PORT", str(kafka_port + 10002)
        )
        proxy = env.get("OUTBOX_TEST_KAFKA_PROXY_PORT") or env.get(
            "OUTBOX_SERVICES_KAFKA_PROXY_PORT", str(kafka_port + 10003)
        )
        return cls(
            admin_url=env.get("OUTBOX_BENCH_DATABASE_URL")
            or env.get("OUTBOX_TEST_DATABASE_URL")
            or f"postgresql://outbox:outbox@127.0.0.1:{pg_port}/outbox",
            bootstrap=bootstrap,
            proxied_port=int(proxied),
            proxy_port=int(proxy),
        )


async def make_template(stack: Stack) -> None:
    stack.template = f"bench_template_{os.getpid()}"
    admin = await asyncpg.connect(stack.admin_url)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{stack.template}"')
        await admin.execute(f'CREATE DATABASE "{stack.template}"')
    finally:
        await admin.close()
    conn = await asyncpg.connect(stack.url(stack.template))
    try:
        await migrations.migrate(conn, "public", "outbox")
        # CHECKPOINT before each WAL measurement (so that the writer's insert and the drain both
        # pay their full-page images alike) needs pg_checkpoint; the local stack's role may
        # grant it to itself (CREATEROLE).
        if not await conn.fetchval("SELECT pg_has_role(current_user, 'pg_checkpoint', 'MEMBER')"):
            await conn.execute("GRANT pg_checkpoint TO CURRENT_USER")
            print("granted pg_checkpoint to the benchmark's role (CHECKPOINT)", flush=True)
    finally:
        await conn.close()


async def drop_database(admin: asyncpg.Connection, name: str) -> None:
    """Drop, waiting out an autovacuum worker that FORCE may not terminate for this role."""
    for _ in range(30):
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        except asyncpg.InsufficientPrivilegeError:
            await asyncio.sleep(1)
        else:
            return


async def drop_template(stack: Stack) -> None:
    admin = await asyncpg.connect(stack.admin_url)
    try:
        await drop_database(admin, stack.template)
    finally:
        await admin.close()


@contextlib.asynccontextmanager
async def fresh(stack: Stack, partitions: int = 6) -> AsyncIterator[tuple[str, str]]:
    """A database cloned from the migrated template and a topic, both removed afterwards."""
    name = f"bench_{uuid.uuid4().hex[:10]}"
    topic = f"bench-{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(stack.admin_url)
    kafka = AIOKafkaAdminClient(bootstrap_servers=stack.bootstrap)
    await kafka.start()
    try:
        await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{stack.template}"')
        await kafka.create_topics([NewTopic(topic, partitions, 1)])
        yield stack.url(name), topic
    finally:
        with contextlib.suppress(Exception):
            await kafka.delete_topics([topic])
        await kafka.close()
        await drop_database(admin, name)
        await admin.close()


def settings_for(url: str, stack: Stack, **overrides: Any) -> Settings:
    overrides.setdefault("http_port", 0)
    overrides.setdefault("kafka_bootstrap_servers", stack.bootstrap)
    return Settings(database_url=url, **overrides)


@contextlib.asynccontextmanager
async def connection(url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(url)
    try:
        yield conn
    finally:
        await conn.close()


async def wait_while(
    conn: asyncpg.Connection, query: str, *args: Any, interval: float, what: str
) -> None:
    """Poll `query` until it returns false: a scenario that stops moving fails, never hangs."""
    deadline = time.monotonic() + WAIT_LIMIT
    while await conn.fetchval(query, *args):
        if time.monotonic() > deadline:
            msg = (
                f"{what}: still waiting after {WAIT_LIMIT:.0f} s; see {RESULTS / 'dispatcher.log'}"
            )
            raise RuntimeError(msg)
        await asyncio.sleep(interval)
