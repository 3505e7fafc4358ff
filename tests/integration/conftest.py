"""Real PostgreSQL and Kafka: the local services (`make services`) through OUTBOX_TEST_* variables,
or PostgreSQL and Kafka containers started by testcontainers (OUTBOX_TEST_STACK=containers, or
a container engine installed and those variables absent; `make test` runs a subset that way).

Each test gets a fresh database cloned from a migrated template and its own topic.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.store import db, migrations
from tests.containers import Engine, find_engine, free_port, fresh_clone

from .cluster import Cluster
from .helpers import Services, port_open

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SERVICES_SCRIPT = ROOT / "deploy" / "local" / "services.sh"


def _stack() -> str:
    """OUTBOX_TEST_STACK: `services` (deploy/local/services.sh, through the OUTBOX_TEST_*
    variables) or `containers` (PostgreSQL and Kafka started by testcontainers). Unset: containers
    when a container engine is already installed and the service variables are absent."""
    stack = os.environ.get("OUTBOX_TEST_STACK", "")
    if stack in ("services", "containers"):
        return stack
    if stack:
        msg = f"OUTBOX_TEST_STACK must be services or containers, got {stack!r}"
        raise pytest.UsageError(msg)
    variables = ("OUTBOX_TEST_DATABASE_URL", "OUTBOX_TEST_KAFKA_BOOTSTRAP_SERVERS")
    if any(name in os.environ for name in variables):
        return "services"
    installed = shutil.which("podman") or (
        shutil.which("docker")
        and subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0
    )
    return "containers" if installed else "services"


@pytest.fixture(scope="session")
def engine() -> Engine:
    """The container engine (deploy/docker/image.sh engine); skips, with its one line of
    reason, where none is installed and none can be."""
    found = find_engine()
    if isinstance(found, str):
        pytest.skip(found)
    return found


@pytest.fixture(scope="session")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh clone of this checkout's HEAD: what `make image` and compose see on a new machine."""
    return fresh_clone(tmp_path_factory.mktemp("clone") / "outbox-dispatcher")


@pytest.fixture(scope="session")
def dispatcher_image(engine: Engine, checkout: Path) -> str:
    """outbox-dispatcher:<version>, built once per session from the fresh clone (`make image`)."""
    started = time.monotonic()
    image = engine.script(checkout, "build").split()[-1]
    built = time.monotonic() - started
    size = int(engine.run("image", "inspect", "--format", "{{.Size}}", image).stdout.strip())
    print(f"\nimage {image}: {size / 1e6:.0f} MB, built in {built:.0f}s")
    return image


CONTROL_SCRIPT = """#!/usr/bin/env bash
# deploy/local/services.sh's pg-/kafka- stop and start, for the containers of this test session.
set -euo pipefail
export CONTAINERS_CONF={conf}
case $1 in
  pg-stop) {engine} stop --time 30 {pg} >/dev/null ;;
  kafka-stop) {engine} stop --time 30 {kafka} >/dev/null ;;
  pg-start|kafka-start)
    if [[ $1 == pg-start ]]; then name={pg} port={pg_port}; else name={kafka} port={kafka_port}; fi
    {engine} start "$name" >/dev/null
    for _ in $(seq 600); do
      if (exec 7<>/dev/tcp/127.0.0.1/$port) 2>/dev/null; then exit 0; fi
      sleep 0.2
    done
    echo "$name: port $port did not open" >&2; exit 1 ;;
  *) echo "usage: $0 pg-stop|pg-start|kafka-stop|kafka-start" >&2; exit 2 ;;
esac
"""


def _container_services(engine: Engine, tmp: Path) -> Iterator[Services]:
    """PostgreSQL and Kafka from the locally built images (deploy/docker/image.sh
    service-images), started by testcontainers on the host network on free ports."""
    images = engine.service_images()
    pg_port, kafka_port, controller_port = free_port(), free_port(), free_port()
    with engine.api_socket() as docker_host:
        # Ryuk's image cannot be pulled everywhere; the containers are removed on exit instead.
        saved = {k: os.environ.get(k) for k in ("DOCKER_HOST", "TESTCONTAINERS_RYUK_DISABLED")}
        os.environ.update(DOCKER_HOST=docker_host, TESTCONTAINERS_RYUK_DISABLED="true")
        try:
            from testcontainers.core.config import testcontainers_config
            from testcontainers.core.container import DockerContainer
            from testcontainers.core.wait_strategies import LogMessageWaitStrategy

            testcontainers_config.ryuk_disabled = True
            suffix = uuid.uuid4().hex[:8]
            pg_name, kafka_name = f"outbox-test-postgres-{suffix}", f"outbox-test-kafka-{suffix}"
            postgres = (
                DockerContainer(images["POSTGRES_IMAGE"])
                .with_name(pg_name)
                .with_envs(
                    POSTGRES_USER="outbox",
                    POSTGRES_PASSWORD="outbox",
                    POSTGRES_DB="outbox",
                    PGPORT=str(pg_port),
                )
                .with_kwargs(network_mode="host")
                .waiting_for(
                    LogMessageWaitStrategy(
                        "database system is ready to accept connections"
                    ).with_startup_timeout(120)
                )
            )
            kafka = (
                DockerContainer(images["KAFKA_IMAGE"])
                .with_name(kafka_name)
                .with_envs(KAFKA_PORT=str(kafka_port), KAFKA_CONTROLLER_PORT=str(controller_port))
                .with_kwargs(network_mode="host")
                .waiting_for(
                    LogMessageWaitStrategy("Kafka Server started").with_startup_timeout(180)
                )
            )
            with postgres, kafka:
                control = tmp / "containers.sh"
                control.write_text(
                    CONTROL_SCRIPT.format(
                        conf=engine.env.get("CONTAINERS_CONF", ""),
                        engine=engine.name,
                        pg=pg_name,
                        kafka=kafka_name,
                        pg_port=pg_port,
                        kafka_port=kafka_port,
                    )
                )
                yield Services(
                    database_url=f"postgresql://outbox:outbox@127.0.0.1:{pg_port}/outbox",
                    kafka_bootstrap_servers=f"127.0.0.1:{kafka_port}",
                    control=control,
                )
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


@pytest.fixture(scope="session")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    db_url = os.environ.get("OUTBOX_TEST_DATABASE_URL")
    kafka = os.environ.get("OUTBOX_TEST_KAFKA_BOOTSTRAP_SERVERS")
    if _stack() == "containers":
        found = find_engine()
        if isinstance(found, str):
            pytest.skip(found)
        yield from _container_services(found, tmp_path_factory.mktemp("containers"))
        return
    # Unset: services.sh's ports (OUTBOX_SERVICES_*), so that a second clone with services of
    # its own on other ports never runs its tests against the first clone's.
    pg_port = os.environ.get("OUTBOX_SERVICES_PG_PORT", "5432")
    kafka_port = os.environ.get("OUTBOX_SERVICES_KAFKA_PORT", "9092")
    yield Services(
        database_url=db_url or f"postgresql://outbox:outbox@127.0.0.1:{pg_port}/outbox",
        kafka_bootstrap_servers=kafka or f"127.0.0.1:{kafka_port}",
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
async def pool(database_url: str) -> AsyncIterator[asyncpg.Pool]:
    """A pool on the test's database, set up as the dispatcher sets up its connections."""
    p = await asyncpg.create_pool(database_url, min_size=1, max_size=8, init=db.init_connection)
    try:
        yield p
    finally:
        await p.close()


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
        unknown = set(overrides) - set(Settings.model_fields)
        assert not unknown, f"not settings (the model ignores them): {sorted(unknown)}"
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
    env = _services_script("cluster-env").stdout
    bootstrap = _env_value(env, "OUTBOX_CLUSTER_BOOTSTRAP_SERVERS")
    proxied = Cluster.parse_proxied(_env_value(env, "OUTBOX_CLUSTER_PROXIED"))
    try:
        yield Cluster(bootstrap, SERVICES_SCRIPT, proxied=proxied)
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
    already = port_open(host, int(port))
    started = _services_script("kafka3-start", check=False)
    if started.returncode != 0:
        pytest.fail(f"kafka3-start failed:\n{started.stderr[-4000:]}")
    try:
        yield bootstrap
    finally:
        if not already:
            _services_script("kafka3-stop", check=False)


@pytest.fixture
async def databases(services: Services) -> AsyncIterator[tuple[str, str]]:
    """Two databases of their own for the many-outboxes tests; the first is the home database,
    with the fleet's membership table (as `migrate` makes it)."""
    from outbox_dispatcher.store.fleet import FleetStore

    from .sources_helpers import fresh_database  # it imports this module

    async with (
        fresh_database(services.database_url) as a,
        fresh_database(services.database_url) as b,
    ):
        conn = await asyncpg.connect(a)
        try:
            await FleetStore(conn).create()
        finally:
            await conn.close()
        yield a, b
