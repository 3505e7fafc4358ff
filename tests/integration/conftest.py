"""Real PostgreSQL and Kafka: the local services (`make services`) through OUTBOX_TEST_* variables,
or testcontainers where a Docker engine exists and those variables are absent.

Each test gets a fresh database cloned from a migrated template and its own topic.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from outbox_dispatcher import migrations
from outbox_dispatcher.settings import Settings

from .cluster import Cluster
from .helpers import Services

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SERVICES_SCRIPT = ROOT / "deploy" / "local" / "services.sh"


def _docker_available() -> bool:
    try:
        return (
            subprocess.run(
                ["docker", "info"], capture_output=True, timeout=10, check=False
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def services() -> Iterator[Services]:
    db_url = os.environ.get("OUTBOX_TEST_DATABASE_URL")
    kafka = os.environ.get("OUTBOX_TEST_KAFKA_BOOTSTRAP_SERVERS")
    if db_url is None and kafka is None and _docker_available():
        # A laptop with Docker: containers instead of the local services.
        from testcontainers.kafka import KafkaContainer
        from testcontainers.postgres import PostgresContainer

        with (
            PostgresContainer("postgres:15", driver=None) as pg,
            KafkaContainer("apache/kafka:4.1.1").with_kraft() as kc,
        ):
            yield Services(
                database_url=pg.get_connection_url(),
                kafka_bootstrap_servers=kc.get_bootstrap_server(),
                control=None,
            )
        return
    yield Services(
        database_url=db_url or "postgresql://outbox:outbox@127.0.0.1:5432/outbox",
        kafka_bootstrap_servers=kafka or "127.0.0.1:9092",
        control=SERVICES_SCRIPT if SERVICES_SCRIPT.exists() else None,
    )


def _with_database(url: str, name: str) -> str:
    base, _, _ = url.rpartition("/")
    return f"{base}/{name}"


async def drop_database(admin: asyncpg.Connection, name: str) -> None:
    """DROP ... WITH (FORCE) cannot end an autovacuum worker's superuser session for our role;
    such a worker finishes within moments, so wait it out."""
    for _ in range(30):
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        except asyncpg.InsufficientPrivilegeError:
            await asyncio.sleep(1)
        else:
            return
    await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
async def template_db(services: Services) -> AsyncIterator[str]:
    """A database migrated once per session, cloned by every test."""
    name = f"outbox_template_{os.getpid()}"
    admin = await asyncpg.connect(services.database_url)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
        await admin.execute(f'CREATE DATABASE "{name}"')
        conn = await asyncpg.connect(_with_database(services.database_url, name))
        try:
            await migrations.migrate(conn, "public", "outbox")
        finally:
            await conn.close()
    finally:
        await admin.close()
    yield name
    await _drop_fresh(services.database_url, name)


@contextlib.asynccontextmanager
async def _fresh_database(services: Services, template: str | None) -> AsyncIterator[str]:
    """A new database (a clone of `template`, or empty), dropped afterwards."""
    name = f"outbox_test_{uuid.uuid4().hex[:12]}"
    clause = f' TEMPLATE "{template}"' if template else ""
    admin = await asyncpg.connect(services.database_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"{clause}')
    finally:
        await admin.close()
    yield _with_database(services.database_url, name)
    await _drop_fresh(services.database_url, name)


async def _drop_fresh(url: str, name: str) -> None:
    """Drop through a new connection: the one the database was created with may be gone (a
    chaos test restarts PostgreSQL)."""
    admin = await asyncpg.connect(url)
    try:
        await drop_database(admin, name)
    finally:
        await admin.close()


@pytest.fixture
async def database_url(services: Services, template_db: str) -> AsyncIterator[str]:
    """A fresh database with the outbox schema, cloned from the migrated template."""
    async with _fresh_database(services, template_db) as url:
        yield url


@pytest.fixture
async def empty_database_url(services: Services) -> AsyncIterator[str]:
    """A database without the outbox schema."""
    async with _fresh_database(services, None) as url:
        yield url


@pytest.fixture
async def conn(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    connection = await asyncpg.connect(database_url)
    try:
        yield connection
    finally:
        await connection.close()


@pytest.fixture
async def make_topic(services: Services) -> AsyncIterator[Callable[[], Awaitable[str]]]:
    """Creates unique topics (3 partitions), deleted after the test."""
    admin = AIOKafkaAdminClient(bootstrap_servers=services.kafka_bootstrap_servers)
    await admin.start()
    created: list[str] = []

    async def make() -> str:
        name = f"test-{uuid.uuid4().hex[:12]}"
        await admin.create_topics([NewTopic(name, num_partitions=3, replication_factor=1)])
        created.append(name)
        return name

    try:
        yield make
        with contextlib.suppress(Exception):
            await admin.delete_topics(created)
    finally:
        await admin.close()


@pytest.fixture
async def topic(make_topic: Callable[[], Awaitable[str]]) -> str:
    return await make_topic()


@pytest.fixture
def make_settings(services: Services, database_url: str) -> Any:
    def make(**overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "database_url": database_url,
            "kafka_bootstrap_servers": services.kafka_bootstrap_servers,
            "lease_seconds": 5.0,
            "poll_interval_seconds": 0.2,
            "reclaim_interval_seconds": 1.0,
            "backoff_initial_seconds": 0.1,
            "backoff_max_seconds": 1.0,
            "shutdown_grace_seconds": 10.0,
            "log_format": "console",
            "http_port": 0,  # a free port: several dispatchers run at once
        }
        values.update(overrides)
        return Settings(**values)

    return make


@pytest.fixture
def python() -> str:
    return sys.executable


def _services_script(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SERVICES_SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=check,
    )


def _env_value(output: str, name: str) -> str:
    for line in output.splitlines():
        key, _, value = line.partition("=")
        if key == name:
            return value
    msg = f"services.sh printed no {name}: {output!r}"
    raise AssertionError(msg)


@pytest.fixture(scope="session")
def kafka_cluster() -> Iterator[Cluster]:
    """The three-broker cluster (deploy/local/services.sh cluster-start), started once per test
    run, when a test first needs it, and stopped at the end if this run started it."""
    if not SERVICES_SCRIPT.exists():
        pytest.skip("the multi-broker tests need deploy/local/services.sh")
    already = _services_script("cluster-status", check=False).returncode == 0
    started = _services_script("cluster-start", check=False)
    if started.returncode != 0:
        pytest.fail(f"cluster-start failed:\n{started.stderr[-4000:]}")
    bootstrap = _env_value(
        _services_script("cluster-env").stdout, "OUTBOX_CLUSTER_BOOTSTRAP_SERVERS"
    )
    try:
        yield Cluster(bootstrap, SERVICES_SCRIPT)
    finally:
        if not already:
            _services_script("cluster-stop", check=False)


@pytest.fixture
async def cluster(kafka_cluster: Cluster) -> AsyncIterator[Cluster]:
    """The cluster with every broker up; whatever the test stopped is started again after it,
    and its topics are deleted."""
    await kafka_cluster.start_all()
    await kafka_cluster.wait_all_brokers()
    try:
        yield kafka_cluster
    finally:
        await kafka_cluster.start_all()
        await kafka_cluster.wait_all_brokers()
        await kafka_cluster.delete_topics()


@pytest.fixture(scope="session")
def kafka3_bootstrap() -> Iterator[str]:
    """A single Kafka 3.x broker (deploy/local/services.sh kafka3-start), started once per run
    when a test needs it, stopped at the end if this run started it."""
    if not SERVICES_SCRIPT.exists():
        pytest.skip("the Kafka 3.x smoke test needs deploy/local/services.sh")
    bootstrap = _env_value(_services_script("kafka3-env").stdout, "OUTBOX_KAFKA3_BOOTSTRAP_SERVERS")
    host, _, port = bootstrap.rpartition(":")
    already = _port_open(host, int(port))
    started = _services_script("kafka3-start", check=False)
    if started.returncode != 0:
        pytest.fail(f"kafka3-start failed:\n{started.stderr[-4000:]}")
    try:
        yield bootstrap
    finally:
        if not already:
            _services_script("kafka3-stop", check=False)


def _port_open(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=2):
        return True
    return False
