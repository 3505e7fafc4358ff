"""Bad configuration, through the real CLI: every failure is one clear message that names the
setting, a non-zero exit, and no secret in any line the process writes."""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from dataclasses import dataclass
from typing import Any

import asyncpg
import pytest

from .helpers import Services, settings_env

pytestmark = pytest.mark.integration

DB_SECRET = f"db-pw-{uuid.uuid4().hex}"
SASL_SECRET = f"sasl-pw-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Ran:
    code: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


async def cli(env: dict[str, str], *args: str, timeout: float = 90) -> Ran:
    """`python -m outbox_dispatcher ARGS` with exactly this environment (plus PATH)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "outbox_dispatcher",
        *args,
        env={"PATH": os.environ.get("PATH", ""), **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    assert process.returncode is not None
    return Ran(process.returncode, out.decode(), err.decode())


def _with_password(url: str, password: str) -> str:
    """The same DSN with another password."""
    scheme, rest = url.split("://", 1)
    credentials, host = rest.split("@", 1)
    user = credentials.split(":", 1)[0]
    return f"{scheme}://{user}:{password}@{host}"


def _with_host(url: str, host: str) -> str:
    scheme, rest = url.split("://", 1)
    credentials, place = rest.split("@", 1)
    return f"{scheme}://{credentials}@{host}/{place.split('/', 1)[1]}"


@pytest.fixture
def base_env(make_settings: Any) -> dict[str, str]:
    """A working configuration (fresh migrated database, the test broker). A SASL password with
    PLAINTEXT is refused (it would go unused); the secret test sets one where it fits."""
    env = settings_env(make_settings(log_format="json", http_port=0))
    return {k: v for k, v in env.items() if k.startswith("OUTBOX_")}


def _assert_one_clear_error(ran: Ran, code: int, *names: str) -> None:
    lines = [line for line in ran.stderr.splitlines() if line.strip()]
    # Ours: the dispatcher's error lines (a client library may add its own, e.g. aiokafka's
    # "Unable connect to ..."), or the settings check's lines.
    problems = [
        line
        for line in lines
        if ('"level":"error"' in line and '"logger":"outbox_dispatcher' in line)
        or line.startswith("outbox-dispatcher: ")
    ]
    assert ran.code == code, ran.output[-3000:]
    assert len(problems) == 1, lines
    for name in names:
        assert name in problems[0], problems[0]
    assert "Traceback" not in ran.output, ran.output[-3000:]


async def test_an_unreachable_broker_at_start_names_the_bootstrap_setting(
    base_env: dict[str, str],
) -> None:
    env = {**base_env, "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"}
    ran = await cli(env, "run")
    _assert_one_clear_error(ran, 1, "OUTBOX_KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:1")


async def test_an_unreachable_database_names_the_url_setting_and_hides_the_password(
    base_env: dict[str, str],
) -> None:
    url = _with_password(base_env["OUTBOX_DATABASE_URL"], DB_SECRET)
    for command in ("run", "migrate", "status"):
        refused = await cli(
            {**base_env, "OUTBOX_DATABASE_URL": _with_host(url, "127.0.0.1:1")}, command
        )
        _assert_one_clear_error(refused, 1, "OUTBOX_DATABASE_URL", "cannot reach PostgreSQL")
        assert DB_SECRET not in refused.output
    unknown = await cli({**base_env, "OUTBOX_DATABASE_URL": _with_host(url, "db.invalid")}, "run")
    _assert_one_clear_error(unknown, 1, "OUTBOX_DATABASE_URL")
    assert DB_SECRET not in unknown.output


async def test_a_wrong_database_password_is_a_configuration_error(
    base_env: dict[str, str],
) -> None:
    url = _with_password(base_env["OUTBOX_DATABASE_URL"], DB_SECRET)
    for command in ("run", "migrate", "status"):
        ran = await cli({**base_env, "OUTBOX_DATABASE_URL": url}, command)
        _assert_one_clear_error(ran, 2, "OUTBOX_DATABASE_URL", "rejected the credentials")
        assert DB_SECRET not in ran.output


INVALID = [
    ("OUTBOX_BATCH_SIZE", "-5", "--batch-size"),
    ("OUTBOX_DEAD_LETTER_POLICY", "sometimes", "--dead-letter-policy"),
    ("OUTBOX_KAFKA_BOOTSTRAP_SERVERS", "localhost", "--kafka-bootstrap-servers"),
    ("OUTBOX_KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:abc", "--kafka-bootstrap-servers"),
    ("OUTBOX_KAFKA_BOOTSTRAP_SERVERS", "kafka:99999", "--kafka-bootstrap-servers"),
    ("OUTBOX_TOPIC_TEMPLATE", "events.{aggregate", "--topic-template"),
    ("OUTBOX_TOPIC_TEMPLATE", "events.{aggregate}/x", "--topic-template"),
    ("OUTBOX_LEASE_SECONDS", "soon", "--lease-seconds"),
    ("OUTBOX_TABLE", "outbox; drop", "--table"),
]


async def test_a_repeatable_read_default_is_refused_with_the_role_setting_that_fixes_it(
    base_env: dict[str, str], conn: asyncpg.Connection
) -> None:
    """Java and Django shops often set default_transaction_isolation = 'repeatable read' for the
    whole database; through a pooler the dispatcher cannot override it at connect time."""
    database = await conn.fetchval("SELECT current_database()")
    await conn.execute(
        f"ALTER DATABASE \"{database}\" SET default_transaction_isolation = 'repeatable read'"
    )
    ran = await cli(base_env, "run")
    _assert_one_clear_error(ran, 2, "repeatable read", "ALTER ROLE", "read committed")
    checked = await cli(base_env, "check")
    assert checked.code == 1, checked.output[-3000:]
    assert "default_transaction_isolation = 'read committed'" in checked.output
    # The fix the message names: the role's own default wins over the database's.
    role = await conn.fetchval("SELECT current_user")
    await conn.execute(
        f'ALTER ROLE "{role}" IN DATABASE "{database}" SET '
        "default_transaction_isolation = 'read committed'"
    )
    try:
        fresh = await asyncpg.connect(base_env["OUTBOX_DATABASE_URL"])
        try:
            assert await fresh.fetchval("SHOW transaction_isolation") == "read committed"
        finally:
            await fresh.close()
    finally:
        await conn.execute(f'ALTER ROLE "{role}" IN DATABASE "{database}" RESET ALL')


async def test_an_invalid_setting_is_one_line_naming_variable_and_flag(
    base_env: dict[str, str],
) -> None:
    """From the environment and from the flag alike (the processes run side by side)."""
    runs = await asyncio.gather(
        *(cli({**base_env, variable: value}, "run") for variable, value, _ in INVALID),
        *(cli(base_env, "run", flag, value) for _, value, flag in INVALID),
    )
    for ran, (variable, _, flag) in zip(runs, INVALID * 2, strict=True):
        _assert_one_clear_error(ran, 2, f"invalid setting {variable} / {flag}")
        assert ran.stdout == ""


async def test_several_invalid_settings_are_one_line_each(base_env: dict[str, str]) -> None:
    env = {**base_env, "OUTBOX_BATCH_SIZE": "0", "OUTBOX_KAFKA_COMPRESSION": "brotli"}
    ran = await cli(env, "status")
    assert ran.code == 2
    lines = ran.stderr.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith(
        "outbox-dispatcher: invalid setting OUTBOX_BATCH_SIZE / --batch-size"
    )
    assert lines[1].startswith("invalid setting OUTBOX_KAFKA_COMPRESSION / --kafka-compression")


async def test_exactly_once_refuses_a_batch_whose_progress_record_cannot_fit_a_request(
    base_env: dict[str, str],
) -> None:
    """Issue 35, E8: a progress record lists its batch's rows; with 10,000 rows it cannot fit
    64 KiB, and every transaction of the lane would abort. Refused at start, naming both."""
    env = {
        **base_env,
        "OUTBOX_DELIVERY": "exactly-once",
        "OUTBOX_LEASE_SECONDS": "30",
        "OUTBOX_TRANSACTION_TIMEOUT_SECONDS": "10",
        "OUTBOX_BATCH_SIZE": "10000",
        "OUTBOX_KAFKA_MAX_REQUEST_BYTES": "65536",
    }
    ran = await cli(env, "run")
    assert ran.code == 2, ran.output[-3000:]
    assert "OUTBOX_BATCH_SIZE=10000" in ran.stderr, ran.stderr
    assert "OUTBOX_KAFKA_MAX_REQUEST_BYTES=65536" in ran.stderr
    assert "Traceback" not in ran.output


async def test_a_malformed_database_url_names_the_setting_not_the_password(
    base_env: dict[str, str],
) -> None:
    url = _with_password(base_env["OUTBOX_DATABASE_URL"], DB_SECRET)
    scheme_host, database = url.rsplit("/", 1)
    malformed = [
        scheme_host.rsplit(":", 1)[0] + ":notaport/" + database,  # port is not a number
        url.replace("postgresql://", "postgresql//"),  # no scheme
        f"{url}?sslmode=sometimes",
        # A password with an unescaped '/' ends the host part early: the driver then reports
        # the password's first part as a bad port number.
        _with_password(url, f"{DB_SECRET}/tail"),
        f"{scheme_host.split('@')[0].rsplit(':', 1)[0]}@127.0.0.1/x?password={DB_SECRET}"
        "&sslmode=bogus",
    ]
    for dsn in malformed:
        ran = await cli({**base_env, "OUTBOX_DATABASE_URL": dsn}, "run")
        _assert_one_clear_error(ran, 2, "OUTBOX_DATABASE_URL is not a usable PostgreSQL URL")
        assert DB_SECRET not in ran.output, ran.output


async def test_a_wrong_listen_url_names_its_own_setting(base_env: dict[str, str]) -> None:
    url = _with_password(base_env["OUTBOX_DATABASE_URL"], DB_SECRET)
    ran = await cli({**base_env, "OUTBOX_LISTEN_DATABASE_URL": url}, "run")
    assert ran.code == 2, ran.output[-3000:]
    assert "OUTBOX_LISTEN_DATABASE_URL" in ran.stderr
    assert DB_SECRET not in ran.output


async def test_no_secret_appears_in_any_line_in_any_failure_mode(
    base_env: dict[str, str], services: Services, database_url: str
) -> None:
    """Every failure mode above and a few more, at DEBUG, console and JSON: neither the database
    password nor the SASL password is written anywhere."""
    wrong = _with_password(base_env["OUTBOX_DATABASE_URL"], DB_SECRET)
    modes: list[tuple[dict[str, str], tuple[str, ...]]] = [
        ({"OUTBOX_DATABASE_URL": wrong}, ("run",)),
        ({"OUTBOX_DATABASE_URL": _with_host(wrong, "127.0.0.1:1")}, ("migrate",)),
        ({"OUTBOX_DATABASE_URL": wrong + "?sslmode=nope"}, ("status", "--json")),
        ({"OUTBOX_KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"}, ("run",)),
        ({"OUTBOX_LISTEN_DATABASE_URL": wrong}, ("run",)),
        ({"OUTBOX_BATCH_SIZE": "-1", "OUTBOX_DATABASE_URL": wrong}, ("run",)),
        ({"OUTBOX_KAFKA_SASL_MECHANISM": "PLAIN"}, ("run",)),  # no username
        ({"OUTBOX_KAFKA_SASL_PASSWORD": SASL_SECRET}, ("check",)),  # no SASL protocol
        (
            {
                "OUTBOX_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
                "OUTBOX_KAFKA_SASL_MECHANISM": "PLAIN",
                "OUTBOX_KAFKA_SASL_USERNAME": "outbox_plain",
                "OUTBOX_KAFKA_SASL_PASSWORD": SASL_SECRET,  # wrong, and at a PLAINTEXT listener
                "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1",
            },
            ("run",),
        ),
    ]
    outputs = await asyncio.gather(
        *(
            cli({**base_env, **extra, "OUTBOX_LOG_LEVEL": "DEBUG", "OUTBOX_LOG_FORMAT": fmt}, *args)
            for extra, args in modes
            for fmt in ("json", "console")
        )
    )
    for ran in outputs:
        assert ran.code != 0, ran.output[-2000:]
        assert DB_SECRET not in ran.output, ran.output
        assert SASL_SECRET not in ran.output, ran.output
        # The working database's own password is a common word; its DSN must not appear either.
        assert database_url not in ran.output


async def test_the_secret_check_would_see_a_leak(base_env: dict[str, str]) -> None:
    """The harness reads everything the process writes: a value the CLI does echo is found."""
    ran = await cli({**base_env, "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": SASL_SECRET}, "run")
    assert ran.code == 2
    assert SASL_SECRET in ran.stderr
