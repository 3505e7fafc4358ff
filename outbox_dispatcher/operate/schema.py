"""`migrate` as an operation: apply what the schema lacks and say where it stands, as data (the
CLI prints it)."""

from __future__ import annotations

from dataclasses import dataclass

from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.store import db, migrations

OLDEST_SUPPORTED = migrations.OLDEST_SUPPORTED


@dataclass(frozen=True)
class Migration:
    """What `migrate` did: the version the schema is at, the versions applied, and a contract
    step it left for later (`waiting`) while `older` dispatchers still run beside the schema."""

    version: int
    applied: list[int]
    waiting: int | None
    older: int


async def migrate(settings: Settings, *, contract: bool) -> Migration:
    """Apply the missing migrations (safe from several processes at once)."""
    conn = await db.connect(settings.database_url.get_secret_value(), settings)
    try:
        applied = await migrations.migrate(
            conn, settings.db_schema, settings.table, contract=contract
        )
        version = await migrations.current_version(conn, settings.db_schema, settings.table)
    finally:
        await conn.close()
    return Migration(version, list(applied), applied.waiting, applied.older)
