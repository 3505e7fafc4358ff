"""What every operator read and action runs on: one connection to one outbox table.

Built once per command (CLI) or request (console) by `connected`, and handed to the reads and to
`actions.perform`, so that nothing below rebuilds a store from a connection.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import AsyncIterator

from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.store import OperatorStore, Statements, db, listen, migrations

# What the faces catch from an operator's command: any database error, and a missing grant.
DatabaseError = db.PostgresError
PrivilegeError = db.InsufficientPrivilegeError
# Errors that a later attempt may not meet (a dropped connection, a restart, a failover).
RETRIABLE_ERRORS = db.RETRIABLE_ERRORS


def audit_lock_key(schema: str, table: str) -> int:
    """The first key of the advisory locks (key, record id) that running actions hold, one per
    table (the migrations' one-key lock and the registry's key space are other keys)."""
    return zlib.crc32(f"outbox-dispatcher audit:{schema}.{table}".encode()) & 0x7FFFFFFF


class Session:
    """A connection, the table's statements over it, the channel its dispatchers listen on (an
    action that makes rows pending wakes them there) and the table's lock key of running
    actions."""

    def __init__(
        self,
        conn: db.Connection,
        statements: Statements,
        channel: str,
        audit_lock: int = 0,
    ) -> None:
        self.conn = conn
        self.store = OperatorStore(conn, statements)
        self.channel = channel
        self.audit_lock = audit_lock

    @classmethod
    def of(cls, conn: db.Connection, settings: Settings) -> Session:
        """A session on `conn` for the table the settings name."""
        statements = Statements.for_table(settings.db_schema, settings.table)
        lock = audit_lock_key(settings.db_schema, settings.table)
        return cls(conn, statements, listen.channel_name(settings), lock)

    def transaction(self) -> db.Transaction:
        return self.conn.transaction()


@contextlib.asynccontextmanager
async def connected(settings: Settings) -> AsyncIterator[Session]:
    """A session for an operator command: its changes are durable before it reports them
    (synchronous_commit on, whatever the dispatcher's own setting), and the schema is a version
    this code knows that has the operator's tables (migrations.CONSOLE_VERSION: a dispatcher runs
    on older ones during a rolling upgrade, an operator command does not)."""
    durable = settings.model_copy(update={"synchronous_commit": "on"})
    conn = await db.connect(settings.database_url.get_secret_value(), durable)
    try:
        await migrations.check_version(
            conn,
            settings.db_schema,
            settings.table,
            oldest=migrations.CONSOLE_VERSION,
            who_needs="the operator commands and the console need",
        )
        yield Session.of(conn, settings)
    finally:
        await conn.close()
