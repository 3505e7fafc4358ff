"""The connection pool: jsonb decoded with orjson, the dispatcher's session settings."""

from __future__ import annotations

import contextlib
import re
import socket
import ssl
import urllib.parse
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import orjson
from asyncpg.pool import PoolConnectionProxy

from outbox_dispatcher import errors
from outbox_dispatcher.config.names import PERCENT_ENCODE
from outbox_dispatcher.config.settings import Settings

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


# A connection of its own or one lent by the pool.
Executor = asyncpg.Connection | PoolConnectionProxy
# asyncpg's names the rest of the package uses, so that only store/ (and the inbox library)
# import asyncpg.
Pool = asyncpg.Pool
Connection = asyncpg.Connection
Transaction = asyncpg.transaction.Transaction
PostgresError = asyncpg.PostgresError
InsufficientPrivilegeError = asyncpg.InsufficientPrivilegeError


async def fetch(
    executor: asyncpg.Pool | Executor, query: str, *args: object
) -> list[asyncpg.Record]:
    """fetch, except that a connection whose protocol state broke is thrown away instead of
    being used again: after a backend is terminated mid-statement asyncpg can report
    InternalClientError and a pool would otherwise hand out the broken connection again
    (asyncpg#1069)."""
    if isinstance(executor, asyncpg.Pool):
        async with executor.acquire() as conn:
            return await fetch(conn, query, *args)
    try:
        return await executor.fetch(query, *args)
    except asyncpg.InternalClientError:
        executor.terminate()
        raise


@contextlib.asynccontextmanager
async def transaction(executor: asyncpg.Pool | Executor) -> AsyncIterator[Executor]:
    """One database transaction (a connection of the pool's, or the executor itself): what
    runs on the connection it yields commits together, or not at all when the block raises."""
    if isinstance(executor, asyncpg.Pool):
        async with executor.acquire() as conn, conn.transaction():
            yield conn
        return
    async with executor.transaction():
        yield executor


async def init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec(
        "jsonb", encoder=_encode_jsonb, decoder=orjson.loads, schema="pg_catalog", format="text"
    )


def _encode_jsonb(value: Any) -> str:
    return orjson.dumps(value).decode()


def server_settings(settings: Settings) -> dict[str, str]:
    return {
        "application_name": APPLICATION_NAME,
        "synchronous_commit": settings.commit_durability,
        # No dispatcher statement may hold locks for long, whatever happens.
        "idle_in_transaction_session_timeout": "10000",
    }


# The dispatcher's pool runs the claim and settle statements thousands of times a minute, each
# shaped to read by index (an index's first entry, a primary key, a range of ids). Planned anew at
# every call they cost more than they run (the steady path's empty claim: about 1 ms against
# 0.3), and JIT compiled their inflated estimates (hundreds of ms a claim on a table without
# statistics: benchmarks/candidates/README.md). A generic plan is made once per connection,
# possibly while the table is empty: with sequential scans disabled it still reads by index
# when the table has grown (review 3, P7). Set once per connection by a statement, not as
# startup parameters: a pooler refuses startup parameters it does not know (PgBouncer's
# ignore_startup_parameters), and users' pooler configurations must keep working. Only with
# prepared statements (OUTBOX_STATEMENT_CACHE_SIZE above 0): a transaction pooler, which needs it
# 0, would carry a SET over to other clients; there every statement is planned each time.
HOT_PATH_SETTINGS = (
    "SET jit = off; SET plan_cache_mode = force_generic_plan; SET enable_seqscan = off"
)


async def init_hot_connection(conn: asyncpg.Connection) -> None:
    """A pool connection of the dispatcher's hot path (see HOT_PATH_SETTINGS)."""
    await init_connection(conn)
    await conn.execute(HOT_PATH_SETTINGS)


async def require_read_committed(conn: asyncpg.Connection | PoolConnectionProxy[Any]) -> None:
    """The claim locks work and then reads rows in a new snapshot (what a previous owner settled
    is seen); under REPEATABLE READ or SERIALIZABLE every statement shares the transaction's
    first snapshot. A server or role default of those levels would reach the dispatcher's
    sessions through a pooler (the startup settings are dropped there), so it is refused."""
    level = await conn.fetchval("SELECT current_setting('transaction_isolation')")
    if level != "read committed":
        raise errors.ConfigurationError(
            f"the dispatcher's database sessions run at isolation level {level!r} (the server's, "
            "database's or role's default_transaction_isolation); its claims need 'read "
            "committed': give the dispatcher's role its own default with ALTER ROLE <role> SET "
            "default_transaction_isolation = 'read committed' (writers keep theirs)"
        )


async def require_durable_commits(conn: asyncpg.Connection | PoolConnectionProxy[Any]) -> None:
    """exactly-once: a batch's progress record forgets the batch once it is marked, so a mark
    that a database crash loses would send the batch again. The dispatcher asks for
    synchronous_commit on, but a pooler drops that startup setting and the role's or server's
    default applies: off is refused."""
    mode = await conn.fetchval("SELECT current_setting('synchronous_commit')")
    if mode == "off":
        raise errors.ConfigurationError(
            "the dispatcher's database sessions run with synchronous_commit = off (the server's, "
            "database's or role's default, reaching them through a pooler); exactly-once needs "
            "its marks durable: ALTER ROLE <role> SET synchronous_commit = on, or use "
            "at-least-once delivery"
        )


def redact(text: str, dsn: str) -> str:
    """`text` without the password of `dsn`: a driver's message may quote parts of the URL. The
    password is what the writer meant (up to the last '@'), and its pieces between '/', '?' and
    '#', which, unescaped, end the URL's host part early and show up in parse errors."""
    secrets = {dsn}
    _, sep, rest = dsn.partition("://")
    userinfo = rest.rpartition("@")[0] if sep else ""
    if ":" in userinfo:
        password = userinfo.split(":", 1)[1]
        secrets.add(password)
        secrets.update(piece for piece in re.split(r"[/?#]", password) if len(piece) >= 4)
    with contextlib.suppress(ValueError):
        query = urllib.parse.urlsplit(dsn).query
        secrets.update(urllib.parse.parse_qs(query).get("password", []))
    secrets.update(re.findall(r"password\s*=\s*'?([^'\s&]+)", dsn))
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def translate(
    exc: BaseException, dsn: str = "", setting: str = "OUTBOX_DATABASE_URL"
) -> errors.OutboxDispatcherError | None:
    """The dispatcher's error for a failure to connect, or None if exc is something else. The
    message names the setting and never contains the password."""
    reason = redact(f"{type(exc).__name__}: {exc}", dsn) if dsn else f"{type(exc).__name__}: {exc}"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return errors.ConfigurationError(
            f"PostgreSQL's TLS certificate was not accepted ({exc.verify_message or exc}): "
            f"sslrootcert in {setting} must name the CA that signed the server's "
            "certificate, and with sslmode=verify-full the certificate must name the host"
        )
    if isinstance(exc, ssl.SSLError):
        return errors.ConfigurationError(
            f"the TLS handshake with PostgreSQL failed ({errors.describe(exc)}): check sslmode, "
            f"sslrootcert, sslcert and sslkey in {setting}"
        )
    if isinstance(exc, FileNotFoundError | PermissionError | IsADirectoryError):
        return errors.ConfigurationError(
            f"a file named in {setting} (sslrootcert, sslcert or sslkey) cannot be read "
            f"({errors.describe(exc)}): fix the path or the file's permissions"
        )
    if isinstance(
        exc, asyncpg.InvalidPasswordError | asyncpg.InvalidAuthorizationSpecificationError
    ):
        return errors.ConfigurationError(
            f"PostgreSQL rejected the credentials in {setting} ({reason}): fix the user or "
            "password in the URL"
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
            f"the database named in {setting} does not exist ({reason}): fix the URL or create "
            "the database"
        )
    if isinstance(exc, asyncpg.ClientConfigurationError):  # an option's value, e.g. sslmode
        return errors.ConfigurationError(
            f"{setting} is not a usable PostgreSQL URL ({reason}): expected "
            "postgresql://user:password@host:port/database[?option=value]"
        )
    if isinstance(exc, ValueError):
        # A parse error quotes a piece of the URL, which may be a piece of the password of any
        # length: say nothing of it (config.names.database_url_problem catches most of these first).
        return errors.ConfigurationError(
            f"{setting} is not a usable PostgreSQL URL: expected "
            f"postgresql://user:password@host:port/database[?option=value]; {PERCENT_ENCODE}"
        )
    if isinstance(exc, CONNECTION_ERRORS):
        return errors.DatabaseUnavailableError(
            f"cannot reach PostgreSQL ({reason}): check {setting} and that the server is up"
        )
    return None


async def _keep_session(conn: asyncpg.Connection) -> None:
    """What the pool does to a connection it takes back, besides rolling back a transaction left
    open (asyncpg always does that): nothing. Its default runs a reset statement (advisory
    unlock, CLOSE ALL, UNLISTEN *, RESET ALL) on every release, a round trip the caller awaits
    after each claim and settle; the dispatcher's pool runs single statements that leave no
    session state behind (transaction-level advisory locks only, no LISTEN, no SET)."""


# A pool of many outboxes (OUTBOX_SOURCES) closes a connection idle this long: an idle outbox
# holds none.
IDLE_CONNECTION_SECONDS = 30.0


async def create_pool(
    settings: Settings,
    *,
    url: str | None = None,
    max_size: int | None = None,
    setting: str = "OUTBOX_DATABASE_URL",
) -> asyncpg.Pool:
    """The dispatcher's pool of OUTBOX_DATABASE_URL; or, given `url` (a source's database),
    one that keeps no idle connection: min_size 0, idle ones closed after
    IDLE_CONNECTION_SECONDS."""
    dsn = settings.database_url.get_secret_value() if url is None else url
    try:
        pool = await asyncpg.create_pool(
            dsn,
            min_size=1 if url is None else 0,
            max_size=max_size or settings.effective_pool_size,
            max_inactive_connection_lifetime=300.0 if url is None else IDLE_CONNECTION_SECONDS,
            init=init_hot_connection if settings.statement_cache_size > 0 else init_connection,
            reset=_keep_session,
            server_settings=server_settings(settings),
            command_timeout=60,
            timeout=10,
            statement_cache_size=settings.statement_cache_size,
        )
    except Exception as exc:
        translated = translate(exc, dsn, setting)
        if translated is None:
            raise
        # Not chained: the driver's own exception may quote the URL.
        raise translated from None
    if pool is None:  # only with a pool that is already closed
        raise errors.DatabaseUnavailableError
    return pool


async def connect(
    dsn: str,
    settings: Settings,
    setting: str = "OUTBOX_DATABASE_URL",
    *,
    statement_cache_size: int = 100,
) -> asyncpg.Connection:
    """A single connection outside the pool (LISTEN, migrations, status, the idle probe's);
    `setting` names where the DSN came from, for the error message."""
    try:
        conn: asyncpg.Connection = await asyncpg.connect(
            dsn,
            server_settings=server_settings(settings),
            timeout=10,
            statement_cache_size=statement_cache_size,
        )
    except Exception as exc:
        translated = translate(exc, dsn, setting)
        if translated is None:
            raise
        raise translated from None
    await init_connection(conn)
    return conn
