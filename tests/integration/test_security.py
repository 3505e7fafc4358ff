"""Security against the real services: Kafka SASL (PLAIN, SCRAM-SHA-256/512), SASL_SSL and mutual
TLS; PostgreSQL TLS up to verify-full; the least-privilege roles of schema/roles.sql; malicious
identifiers given to the real CLI. No secret may appear in any output.

The extra Kafka listeners and the TLS files come from deploy/local/services.sh: ports
OUTBOX_SERVICES_KAFKA_SASL_PORT / _SASL_SSL_PORT / _MTLS_PORT (default: the Kafka port + 100,
+101, +102), files in <repo>/.services/tls/.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import orjson
import pytest

from outbox_dispatcher import errors
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.supervisor import Dispatcher, configs_of
from outbox_dispatcher.kafka.publisher import KafkaPublisher
from outbox_dispatcher.operate import reads
from outbox_dispatcher.operate.actions import ReleaseHeld, perform
from outbox_dispatcher.operate.session import Session
from outbox_dispatcher.store import DispatchStore, Statements, db, migrations

from .conftest import ROOT, _fresh_database
from .helpers import (
    Services,
    check,
    consume,
    event_ids,
    insert_sequenced,
    running,
    settings_env,
    wait_all_settled,
    wait_until,
)

TLS_DIR = ROOT / ".services" / "tls"
CA = TLS_DIR / "ca.crt"
OTHER_CA = TLS_DIR / "other-ca.crt"
CLIENT_KEY_PASSWORD = "outbox-key-secret"  # services.sh: client-encrypted.key
HOST = "127.0.0.1"


def _password(user: str) -> str:
    """services.sh gives every SASL user the password <user>-secret."""
    return f"{user}-secret"


@pytest.fixture(scope="module")
def listeners(services: Services) -> dict[str, str]:
    """Bootstrap address of each extra listener, checked to be open."""
    if services.control is None:
        pytest.skip("needs the SASL and TLS listeners of deploy/local/services.sh")
    main_port = int(services.kafka_bootstrap_servers.rsplit(":", 1)[1])
    ports = {
        "sasl": int(os.environ.get("OUTBOX_SERVICES_KAFKA_SASL_PORT", main_port + 100)),
        "sasl_ssl": int(os.environ.get("OUTBOX_SERVICES_KAFKA_SASL_SSL_PORT", main_port + 101)),
        "mtls": int(os.environ.get("OUTBOX_SERVICES_KAFKA_MTLS_PORT", main_port + 102)),
    }
    for name, port in ports.items():

        async def probe(port: int = port) -> None:
            _, writer = await asyncio.open_connection(HOST, port)
            writer.close()

        try:
            asyncio.run(probe())
        except OSError:
            pytest.fail(
                f"no Kafka {name} listener on {HOST}:{port}: restart the broker with the current "
                "deploy/local/services.sh (kafka-stop, then kafka-start)"
            )
    if not CA.exists():
        pytest.fail(f"{CA} is missing: run deploy/local/services.sh start")
    return {name: f"{HOST}:{port}" for name, port in ports.items()}


def _kafka(listeners: dict[str, str], how: str, **extra: Any) -> dict[str, Any]:
    """The Kafka settings that reach the broker one way."""
    if how in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"):
        user = {"PLAIN": "outbox_plain", "SCRAM-SHA-256": "outbox_scram256"}.get(
            how, "outbox_scram512"
        )
        values: dict[str, Any] = {
            "kafka_bootstrap_servers": listeners["sasl"],
            "kafka_security_protocol": "SASL_PLAINTEXT",
            "kafka_sasl_mechanism": how,
            "kafka_sasl_username": user,
            "kafka_sasl_password": _password(user),
        }
    elif how == "SASL_SSL":
        values = {
            "kafka_bootstrap_servers": listeners["sasl_ssl"],
            "kafka_security_protocol": "SASL_SSL",
            "kafka_sasl_mechanism": "SCRAM-SHA-512",
            "kafka_sasl_username": "outbox_scram512",
            "kafka_sasl_password": _password("outbox_scram512"),
            "kafka_ssl_cafile": str(CA),
        }
    else:  # mutual TLS, with the password-protected client key
        assert how == "MTLS"
        values = {
            "kafka_bootstrap_servers": listeners["mtls"],
            "kafka_security_protocol": "SSL",
            "kafka_ssl_cafile": str(CA),
            "kafka_ssl_certfile": str(TLS_DIR / "client.crt"),
            "kafka_ssl_keyfile": str(TLS_DIR / "client-encrypted.key"),
            "kafka_ssl_key_password": CLIENT_KEY_PASSWORD,
        }
    values.update(extra)
    return values


async def _publish_all(
    services: Services, conn: asyncpg.Connection, topic: str, settings: Settings
) -> None:
    """Rows in, a dispatcher with these settings, every row on the topic exactly once, in order."""
    await insert_sequenced(conn, topic, keys=4, per_key=5)
    expected = await event_ids(conn)
    async with running(settings):
        await wait_all_settled(conn, timeout=60)
    assert await conn.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL") == 0
    verdict = check(await consume(services.kafka_bootstrap_servers, topic, len(expected)), expected)
    assert (verdict.delivered, verdict.lost, verdict.reordered) == (len(expected), [], [])


def _run_cli(env: dict[str, str], *args: str) -> tuple[int, str]:
    result = subprocess.run(
        [sys.executable, "-m", "outbox_dispatcher", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return result.returncode, result.stdout + result.stderr


# --- Kafka -------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "SASL_SSL", "MTLS"])
async def test_publishes_through_each_secure_listener(
    how: str,
    listeners: dict[str, str],
    services: Services,
    conn: asyncpg.Connection,
    topic: str,
    make_settings: Callable[..., Settings],
) -> None:
    settings = make_settings(http_port=0, **_kafka(listeners, how))
    await _publish_all(services, conn, topic, settings)


@pytest.mark.parametrize(
    ("how", "extra", "names"),
    [
        pytest.param(
            "PLAIN", {"kafka_sasl_password": "wrong-Pa55"}, "OUTBOX_KAFKA_SASL_", id="plain"
        ),
        pytest.param(
            "SCRAM-SHA-256", {"kafka_sasl_password": "wrong-Pa55"}, "OUTBOX_KAFKA_SASL_", id="s256"
        ),
        pytest.param(  # a SCRAM-SHA-256 user has no SCRAM-SHA-512 credentials
            "SCRAM-SHA-256",
            {"kafka_sasl_mechanism": "SCRAM-SHA-512"},
            "OUTBOX_KAFKA_SASL_",
            id="wrong-mechanism",
        ),
        pytest.param(
            "SASL_SSL", {"kafka_ssl_cafile": str(OTHER_CA)}, "OUTBOX_KAFKA_SSL_CAFILE", id="ca"
        ),
        pytest.param(  # the system CAs do not know our local CA either
            "SASL_SSL", {"kafka_ssl_cafile": None}, "OUTBOX_KAFKA_SSL_CAFILE", id="system-ca"
        ),
        pytest.param(
            "MTLS",
            {"kafka_ssl_certfile": None, "kafka_ssl_keyfile": None, "kafka_ssl_key_password": None},
            "OUTBOX_KAFKA_SSL_CERTFILE",
            id="no-client-cert",
        ),
        pytest.param(
            "MTLS",
            {"kafka_ssl_key_password": "wrong-Pa55"},
            "OUTBOX_KAFKA_SSL_KEY_PASSWORD",
            id="key-password",
        ),
        pytest.param(  # TLS spoken to a listener that is not TLS
            "SASL_SSL",
            {"kafka_bootstrap_servers": "SASL_PORT"},
            "OUTBOX_KAFKA_SECURITY_PROTOCOL",
            id="protocol-mismatch",
        ),
    ],
)
async def test_refused_credentials_or_certificates_are_one_clear_configuration_error(
    how: str, extra: dict[str, Any], names: str, listeners: dict[str, str]
) -> None:
    if extra.get("kafka_bootstrap_servers") == "SASL_PORT":
        extra = {**extra, "kafka_bootstrap_servers": listeners["sasl"]}
    settings = Settings(**_kafka(listeners, how, **extra), publish_timeout_seconds=10)
    publisher = KafkaPublisher(configs_of(settings).publisher)
    with pytest.raises(errors.ConfigurationError) as caught:
        await publisher.start()
    message = str(caught.value)
    assert names in message
    assert "wrong-Pa55" not in message
    assert "secret" not in message
    await publisher.stop()


def test_wrong_sasl_password_exits_with_one_line_and_never_logs_it(
    listeners: dict[str, str], database_url: str, tmp_path: Path
) -> None:
    secret = f"Wr0ng-{uuid.uuid4().hex}"
    settings = Settings(
        database_url=database_url,
        http_port=0,
        **_kafka(listeners, "SCRAM-SHA-512", kafka_sasl_password="placeholder"),
    )
    env = settings_env(settings)
    del env["OUTBOX_KAFKA_SASL_PASSWORD"]  # from a file, as a mounted secret would be
    (tmp_path / "password").write_text(secret + "\n")
    env["OUTBOX_KAFKA_SASL_PASSWORD_FILE"] = str(tmp_path / "password")
    env["OUTBOX_LOG_LEVEL"] = "DEBUG"  # even the debug logs must not carry it
    code, output = _run_cli(env, "run")
    assert code == 2, output
    lines = [line for line in output.splitlines() if "OUTBOX_KAFKA_SASL_" in line]
    assert len(lines) == 1, output
    assert "rejected the SASL credentials" in lines[0]
    assert "Traceback" not in output
    assert secret not in output


# --- PostgreSQL TLS ----------------------------------------------------------------------------


def _with_query(url: str, **params: str) -> str:
    return url + "?" + "&".join(f"{k}={v}" for k, v in params.items())


async def _ssl_sessions(conn: asyncpg.Connection) -> list[bool]:
    rows = await conn.fetch(
        "SELECT s.ssl FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) "
        "WHERE a.application_name = $1 AND a.datname = current_database()",
        db.APPLICATION_NAME,
    )
    return [r["ssl"] for r in rows]


async def test_dispatcher_and_status_over_verify_full(
    listeners: dict[str, str],
    services: Services,
    conn: asyncpg.Connection,
    database_url: str,
    topic: str,
    make_settings: Callable[..., Settings],
) -> None:
    url = _with_query(database_url, sslmode="verify-full", sslrootcert=str(CA))
    settings = make_settings(database_url=url, listen_database_url=url, http_port=0)
    await insert_sequenced(conn, topic, keys=4, per_key=5)
    expected = await event_ids(conn)
    async with running(settings):
        await wait_all_settled(conn, timeout=60)

        async def pool_and_listener_on_tls() -> bool:
            sessions = await _ssl_sessions(conn)
            return len(sessions) >= 2 and all(sessions)

        await wait_until(pool_and_listener_on_tls, 30, "the dispatcher's sessions on TLS")
    verdict = check(await consume(services.kafka_bootstrap_servers, topic, len(expected)), expected)
    assert verdict.delivered == len(expected)

    code, output = _run_cli(settings_env(settings), "status", "--json")
    assert code == 0, output
    assert orjson.loads(output)["topics"][0]["published"] == len(expected)


async def test_wrong_database_ca_is_a_clear_error(
    database_url: str, make_settings: Callable[..., Settings]
) -> None:
    url = _with_query(database_url, sslmode="verify-full", sslrootcert=str(OTHER_CA))
    settings = make_settings(database_url=url, http_port=0)
    with pytest.raises(errors.ConfigurationError, match="sslrootcert"):
        await Dispatcher(settings).run()
    code, output = _run_cli(settings_env(settings), "status")
    assert code == 2, output
    lines = output.strip().splitlines()
    assert len(lines) == 1, output
    assert "TLS certificate was not accepted" in lines[0]
    assert "sslrootcert in OUTBOX_DATABASE_URL" in lines[0]
    assert "outbox:outbox@" not in output


async def test_sslmode_require_and_plain_connections(
    database_url: str, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(database_url=_with_query(database_url, sslmode="require"))
    code, output = _run_cli(settings_env(settings), "status")
    assert code == 0, output
    for mode, encrypted in (("require", True), ("disable", False)):
        conn = await db.connect(_with_query(database_url, sslmode=mode), settings)
        try:
            assert await _ssl_sessions(conn) == [encrypted]
        finally:
            await conn.close()


# --- Least privilege ---------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _roles_database(services: Services) -> AsyncIterator[tuple[str, str, str]]:
    """An empty database and two role names; the roles are dropped after the database."""
    suffix = uuid.uuid4().hex[:8]
    owner, dispatcher = f"outbox_owner_{suffix}", f"outbox_dispatcher_{suffix}"
    admin = await asyncpg.connect(services.database_url)
    try:
        can_create_roles = await admin.fetchval(
            "SELECT rolcreaterole OR rolsuper FROM pg_roles WHERE rolname = current_user"
        )
        if not can_create_roles:
            pytest.fail(
                "the test role needs CREATEROLE: run deploy/local/services.sh start (pg-start) "
                "again, it grants it"
            )
        try:
            async with _fresh_database(services, None) as url:
                yield url, owner, dispatcher
        finally:
            for role in (dispatcher, owner):
                await admin.execute(f'DROP ROLE IF EXISTS "{role}"')
    finally:
        await admin.close()


def _as_role(url: str, role: str, password: str) -> str:
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{role}:{password}@{rest.split('@', 1)[1]}"


FORBIDDEN = [
    "INSERT INTO outbox (topic, payload) VALUES ('t', 'x')",
    "SELECT outbox_enqueue('t', NULL, 'x')",
    "UPDATE outbox SET payload = 'x'",
    "UPDATE outbox SET topic = 'elsewhere'",
    "UPDATE outbox SET headers = '{}'",
    "UPDATE outbox SET event_id = gen_random_uuid()",
    "DELETE FROM outbox_schema_version",
    "DROP TABLE outbox",
    "TRUNCATE outbox",
    "ALTER TABLE outbox ADD COLUMN evil integer",
    "CREATE TABLE public.evil (id integer)",
    "CREATE FUNCTION public.evil() RETURNS integer LANGUAGE sql RETURN 1",
    "CREATE SCHEMA evil",
]


async def test_dispatcher_role_publishes_and_can_do_nothing_else(
    services: Services, make_topic: Callable[[], Awaitable[str]]
) -> None:
    async with _roles_database(services) as (url, owner, dispatcher):
        sql = migrations.render_roles("public", "outbox", owner, dispatcher)
        admin = await asyncpg.connect(url)
        try:
            await admin.execute(sql)  # before migrating: the roles, the owner may create
            for role in (owner, dispatcher):
                await admin.execute(f"ALTER ROLE \"{role}\" LOGIN PASSWORD 'pw-{role}'")
            owner_conn = await asyncpg.connect(_as_role(url, owner, f"pw-{owner}"))
            try:
                assert await migrations.migrate(owner_conn, "public", "outbox")
                await admin.execute(sql)  # after migrating: the dispatcher's grants
                assert (
                    await admin.fetchval(
                        "SELECT tableowner FROM pg_tables WHERE tablename = $1", "outbox"
                    )
                    == owner
                )
                topic = await make_topic()
                await insert_sequenced(owner_conn, topic, keys=4, per_key=5)
                expected = await event_ids(owner_conn)
                dispatcher_url = _as_role(url, dispatcher, f"pw-{dispatcher}")
                settings = Settings(
                    database_url=dispatcher_url,
                    kafka_bootstrap_servers=services.kafka_bootstrap_servers,
                    http_port=0,
                    poll_interval_seconds=0.2,
                    log_format="console",
                )
                async with running(settings):
                    await wait_all_settled(owner_conn, timeout=60)
                records = await consume(services.kafka_bootstrap_servers, topic, len(expected))
                assert check(records, expected).delivered == len(expected)

                disp = await asyncpg.connect(dispatcher_url)
                try:
                    queries = Statements.for_table("public", "outbox")
                    session = Session(disp, queries, "public.outbox")
                    topics = await reads.topics(session)
                    assert [t.published for t in topics] == [len(expected)]
                    # The metrics sampler's clock and gauges (version 7), and the operator
                    # commands that set pending_since, work under the dispatcher role.
                    store = DispatchStore(disp, queries)
                    await store.clock_tick()
                    gauges = await store.gauges(block_on_dead=False)
                    await store.clock_prune(first_pending_id=gauges["first_pending_id"])
                    assert gauges["pending"] == 0
                    assert (await perform(ReleaseHeld(), session)).rows == 0
                    for statement in [*FORBIDDEN, f'SET ROLE "{owner}"']:
                        with pytest.raises(asyncpg.InsufficientPrivilegeError):
                            await disp.execute(statement)
                    # Retention's DELETE of published rows is granted.
                    assert (
                        await disp.execute("DELETE FROM outbox WHERE published_at IS NOT NULL")
                        == f"DELETE {len(expected)}"
                    )
                finally:
                    await disp.close()
            finally:
                await owner_conn.close()
        finally:
            await admin.close()


RIGHTS = """
SELECT p.proname::text AS name,
       bool_or(a.grantee = 0) AS public,
       bool_or(a.grantee = to_regrole($1)) AS dispatcher
  FROM pg_proc p, aclexplode(p.proacl) a
 WHERE p.proname IN ('outbox_claim_work', 'outbox_discover') AND a.privilege_type = 'EXECUTE'
 GROUP BY p.proname ORDER BY p.proname
"""


async def test_the_upgrade_to_version_16_keeps_the_least_privilege_rights(
    services: Services,
) -> None:
    """Step 16 makes the claim and its discovery again (a new result type): the EXECUTE rights
    schema/roles.sql gave at version 15 (PUBLIC revoked, the dispatcher's role granted) hold
    after it. Before, the new functions had PUBLIC's EXECUTE and no grant of the role."""
    async with _roles_database(services) as (url, owner, dispatcher):
        sql = migrations.render_roles("public", "outbox", owner, dispatcher)
        admin = await asyncpg.connect(url)
        try:
            await admin.execute(sql)
            for migration in migrations.load_migrations()[:15]:
                async with admin.transaction():
                    await admin.execute(
                        migrations.render(migration.path.read_text("utf-8"), "public", "outbox")
                    )
            await admin.execute(sql)  # the dispatcher's grants at version 15
            expected = [("outbox_claim_work", False, True), ("outbox_discover", False, True)]
            assert [tuple(r) for r in await admin.fetch(RIGHTS, dispatcher)] == expected
            assert (await migrations.migrate(admin, "public", "outbox")) == [16]
            assert [tuple(r) for r in await admin.fetch(RIGHTS, dispatcher)] == expected
        finally:
            await admin.close()


# --- Identifiers -------------------------------------------------------------------------------

MALICIOUS = [
    ("OUTBOX_TABLE", 'outbox"; DROP TABLE canary; --'),
    ("OUTBOX_SCHEMA", "public; DROP TABLE canary; --"),
    ("OUTBOX_TABLE", "canary CASCADE"),
]


async def test_malicious_identifiers_stop_the_cli_before_any_sql(
    empty_database_url: str, services: Services
) -> None:
    conn = await asyncpg.connect(empty_database_url)
    try:
        await conn.execute("CREATE TABLE canary (id integer)")
        catalog = "SELECT array_agg(oid ORDER BY oid) FROM {}"
        before = [await conn.fetchval(catalog.format(t)) for t in ("pg_class", "pg_proc")]
        base = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        base |= {
            "OUTBOX_DATABASE_URL": empty_database_url,
            "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": services.kafka_bootstrap_servers,
            "OUTBOX_HTTP_PORT": "0",
        }
        runs = [
            asyncio.to_thread(_run_cli, {**base, name: value}, command)
            for name, value in MALICIOUS
            for command in ("migrate", "run")
        ]
        for (name, _), result in zip(
            [m for m in MALICIOUS for _ in range(2)], await asyncio.gather(*runs), strict=True
        ):
            code, output = result
            assert code == 2, output
            lines = output.strip().splitlines()
            assert len(lines) == 1, output
            assert name in lines[0]
            assert "is not allowed" in lines[0]
        assert await conn.fetchval("SELECT to_regclass('canary') IS NOT NULL")
        after = [await conn.fetchval(catalog.format(t)) for t in ("pg_class", "pg_proc")]
        assert after == before
    finally:
        await conn.close()
