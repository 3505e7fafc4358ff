from __future__ import annotations

import asyncpg

from outbox_dispatcher import db, errors


def test_a_pooler_refusing_session_settings_gets_an_operator_message() -> None:
    # The message PgBouncer sends without ignore_startup_parameters (seen with PgBouncer 1.18).
    exc = asyncpg.ProtocolViolationError("unsupported startup parameter: synchronous_commit")
    translated = db.translate(exc)
    assert isinstance(translated, errors.ConfigurationError)
    assert "ignore_startup_parameters" in str(translated)
    assert "OUTBOX_STATEMENT_CACHE_SIZE=0" in str(translated)
