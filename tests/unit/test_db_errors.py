"""Connection errors name the setting and never carry the password, whatever the DSN's form."""

from __future__ import annotations

import asyncpg
import pytest

from outbox_dispatcher import errors
from outbox_dispatcher.store import db


@pytest.mark.parametrize(
    ("dsn", "quoted"),
    [
        ("postgresql://u:s3cr3t-pw@h:5432/db", "s3cr3t-pw"),
        ("postgresql://u:s3cr3t/pw@h:5432/db", "s3cr3t"),  # unescaped '/': parsed as a port
        ("postgresql://u:pa@ss-word@h/db", "pa@ss-word"),
        ("postgresql://u@h/db?password=s3cr3t-pw&sslmode=x", "s3cr3t-pw"),
        ("host=h user=u password='s3cr3t-pw'", "s3cr3t-pw"),
    ],
)
def test_a_driver_message_quoting_the_password_is_redacted(dsn: str, quoted: str) -> None:
    translated = db.translate(ValueError(f"bad value {quoted!r} in {dsn}"), dsn)
    assert isinstance(translated, errors.ConfigurationError)
    assert "OUTBOX_DATABASE_URL is not a usable PostgreSQL URL" in str(translated)
    assert quoted not in str(translated)


def test_each_failure_names_the_setting_it_came_from() -> None:
    dsn = "postgresql://u:pw-1234@h/db"
    cases = [
        (asyncpg.InvalidPasswordError("password authentication failed"), errors.ConfigurationError),
        (asyncpg.InvalidCatalogNameError("no such database"), errors.ConfigurationError),
        (ConnectionRefusedError(111, "refused"), errors.DatabaseUnavailableError),
        (asyncpg.ClientConfigurationError("bad sslmode"), errors.ConfigurationError),
    ]
    for exc, kind in cases:
        translated = db.translate(exc, dsn, "OUTBOX_LISTEN_DATABASE_URL")
        assert isinstance(translated, kind)
        assert "OUTBOX_LISTEN_DATABASE_URL" in str(translated)
    assert db.translate(RuntimeError("a bug"), dsn) is None


def test_a_pooler_refusing_session_settings_gets_an_operator_message() -> None:
    # The message PgBouncer sends without ignore_startup_parameters (seen with PgBouncer 1.18).
    exc = asyncpg.ProtocolViolationError("unsupported startup parameter: synchronous_commit")
    translated = db.translate(exc)
    assert isinstance(translated, errors.ConfigurationError)
    assert "ignore_startup_parameters" in str(translated)
    assert "OUTBOX_STATEMENT_CACHE_SIZE=0" in str(translated)
