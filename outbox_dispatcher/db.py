"""The connection pool: jsonb decoded with orjson, the dispatcher's session settings."""

from __future__ import annotations

import socket
import ssl
from typing import Any

import asyncpg
import orjson

from outbox_dispatcher import errors
from outbox_dispatcher.settings import Settings

APPLICATION_NAME = "outbox-dispatcher"

# Errors that mean "the database is not there right now", as opposed to a bug or bad SQL.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.CannotConnectNowError,
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
    asyncpg.TooManyConnectionsError,
    TimeoutError,
    socket.gaierror,
)

# Errors worth retrying the same statement for: the database is away, or a statement lost a race
# or a timeout. Anything else is a bug or a broken schema and stops the process.
RETRIABLE_ERRORS: tuple[type[BaseException], ...] = (
    *CONNECTION_ERRORS,
    asyncpg.SerializationError,
    asyncpg.DeadlockDetectedError,
    asyncpg.LockNotAvailableError,
    asyncpg.QueryCanceledError,
    asyncpg.ReadOnlySQLTransactionError,
    asyncpg.InternalClientError,
)


async def fetch(pool: asyncpg.Pool, query: str, *args: object) -> list[asyncpg.Record]:
    """pool.fetch, except that a connection whose protocol state broke is thrown away instead of
    going back to the pool: after a backend is terminated mid-statement asyncpg can report
    InternalClientError and would otherwise hand out the broken connection again (asyncpg#1069)."""
    async with pool.acquire() as conn:
        try:
            return await conn.fetch(query, *args)
        except asyncpg.InternalClientError:
            conn.terminate()
            raise


async def init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec(
        "jsonb", encoder=_encode_jsonb, decoder=orjson.loads, schema="pg_catalog", format="text"
    )


def _encode_jsonb(value: Any) -> str:
    return orjson.dumps(value).decode()


def server_settings(settings: Settings) -> dict[str, str]:
    return {
        "application_name": APPLICATION_NAME,
        "synchronous_commit": settings.synchronous_commit,
        # No dispatcher statement may hold locks for long, whatever happens.
        "idle_in_transaction_session_timeout": "10000",
    }


def translate(exc: BaseException) -> errors.OutboxDispatcherError | None:
    """The dispatcher's error for a failure to connect, or None if exc is something else."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return errors.ConfigurationError(
            f"PostgreSQL's TLS certificate was not accepted ({exc.verify_message or exc}): "
            "sslrootcert in OUTBOX_DATABASE_URL must name the CA that signed the server's "
            "certificate, and with sslmode=verify-full the certificate must name the host"
        )
    if isinstance(exc, ssl.SSLError):
        return errors.ConfigurationError(
            f"the TLS handshake with PostgreSQL failed ({errors.describe(exc)}): check sslmode, "
            "sslrootcert, sslcert and sslkey in OUTBOX_DATABASE_URL"
        )
    if isinstance(exc, FileNotFoundError | PermissionError | IsADirectoryError):
        return errors.ConfigurationError(
            f"a file named in OUTBOX_DATABASE_URL (sslrootcert, sslcert or sslkey) cannot be read "
            f"({errors.describe(exc)}): fix the path or the file's permissions"
        )
    if isinstance(exc, asyncpg.ClientConfigurationError):
        return errors.ConfigurationError(f"OUTBOX_DATABASE_URL: {exc}")
    if isinstance(exc, ValueError):
        # The text of a DSN parsing error may quote the DSN, password included: leave it out.
        return errors.ConfigurationError(
            f"OUTBOX_DATABASE_URL is not a valid PostgreSQL URL ({type(exc).__name__}): expected "
            "postgresql://user:password@host:port/database[?sslmode=verify-full&sslrootcert=...]"
        )
    if isinstance(
        exc, asyncpg.InvalidPasswordError | asyncpg.InvalidAuthorizationSpecificationError
    ):
        return errors.ConfigurationError(
            f"PostgreSQL rejected the credentials in OUTBOX_DATABASE_URL: {exc}"
        )
    if isinstance(exc, asyncpg.ProtocolViolationError) and "startup parameter" in str(exc):
        return errors.ConfigurationError(
            f"a connection pooler refused the dispatcher's session settings ({exc}): with "
            "PgBouncer add 'ignore_startup_parameters = extra_float_digits,synchronous_commit,"
            "idle_in_transaction_session_timeout' to pgbouncer.ini (a transaction pooler cannot "
            "keep session settings; set them per role with ALTER ROLE ... SET if they matter) "
            "and OUTBOX_STATEMENT_CACHE_SIZE=0"
        )
    if isinstance(exc, asyncpg.InvalidCatalogNameError):
        return errors.ConfigurationError(
            f"the database named in OUTBOX_DATABASE_URL does not exist: {exc}"
        )
    if isinstance(exc, CONNECTION_ERRORS):
        return errors.DatabaseUnavailableError(
            f"cannot reach PostgreSQL ({type(exc).__name__}: {exc}): check "
            "OUTBOX_DATABASE_URL and that the server is up"
        )
    return None


async def create_pool(settings: Settings) -> asyncpg.Pool:
    try:
        pool = await asyncpg.create_pool(
            settings.database_url.get_secret_value(),
            min_size=1,
            max_size=settings.effective_pool_size,
            init=init_connection,
            server_settings=server_settings(settings),
            command_timeout=60,
            timeout=10,
            statement_cache_size=settings.statement_cache_size,
        )
    except Exception as exc:
        raise (translate(exc) or exc) from exc
    if pool is None:  # only with a pool that is already closed
        raise errors.DatabaseUnavailableError
    return pool


async def connect(dsn: str, settings: Settings) -> asyncpg.Connection:
    """A single connection outside the pool (LISTEN, migrations, status)."""
    try:
        conn: asyncpg.Connection = await asyncpg.connect(
            dsn, server_settings=server_settings(settings), timeout=10
        )
    except Exception as exc:
        raise (translate(exc) or exc) from exc
    await init_connection(conn)
    return conn
