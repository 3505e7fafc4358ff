"""LISTEN/NOTIFY as a wake-up hint: new rows go out within milliseconds, and an idle dispatcher
only polls at poll_interval. Losing the connection loses nothing; polling covers the gap."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import structlog

from outbox_dispatcher import errors
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.store import db

log = structlog.get_logger(__name__)

PING_SECONDS = 15.0
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    errors.OutboxDispatcherError,
    *db.CONNECTION_ERRORS,
)

# A source's database may also refuse us with a server error (e.g. not accepting connections).
_SOURCE_UNAVAILABLE: tuple[type[BaseException], ...] = (*_UNAVAILABLE, db.PostgresError)


def _setter(event: asyncio.Event) -> Callable[[object], None]:
    return lambda _conn: event.set()


def channel_name(settings: Settings) -> str:
    """The channel the table's trigger notifies: "<schema>.<table>"."""
    return f"{settings.db_schema}.{settings.table}"


async def listen(settings: Settings, notify: Callable[[], object]) -> None:
    """Forever: hold a LISTEN connection, reconnecting with backoff; pass each hint on (to the
    claim loops' Wakeup)."""
    secret = settings.listen_database_url or settings.database_url
    setting = (
        "OUTBOX_LISTEN_DATABASE_URL" if settings.listen_database_url else "OUTBOX_DATABASE_URL"
    )
    channel = channel_name(settings)
    pause = 0.5
    listened = False

    def wake(*_: object) -> None:
        notify()

    while True:
        conn: db.Connection | None = None
        try:
            conn = await db.connect(secret.get_secret_value(), settings, setting)
            lost = asyncio.Event()
            conn.add_termination_listener(_setter(lost))
            await conn.add_listener(channel, wake)
            log.info("listening", channel=channel)
            listened = True
            wake()  # rows may have arrived while we were not listening
            pause = 0.5
            while not lost.is_set():
                try:
                    await asyncio.wait_for(lost.wait(), PING_SECONDS)
                except TimeoutError:
                    # A silently dropped connection is only noticed by using it.
                    await asyncio.wait_for(conn.execute("SELECT 1"), PING_SECONDS)
            log.warning("listen_connection_lost", channel=channel)
        except errors.ConfigurationError as exc:
            if not listened:
                raise  # wrong from the start (e.g. its password): stop with the message, exit 2
            log.warning("listen_unavailable", channel=channel, error=repr(exc), retry_in=pause)
        except _UNAVAILABLE as exc:
            log.warning("listen_unavailable", channel=channel, error=repr(exc), retry_in=pause)
        finally:
            if conn is not None and not conn.is_closed():
                conn.terminate()
        await asyncio.sleep(pause)
        pause = min(pause * 2, 10.0)


class Channels:
    """The channels one database's LISTEN connection follows (OUTBOX_SOURCES: one connection per
    database, not per outbox), each with what a notification on it wakes. Changed while the
    connection lives: `listen_channels` listens to new ones and unlistens gone ones."""

    def __init__(self, database: str) -> None:
        self.database = database  # named by hosts, ports and name (never the URL), for the logs
        self.routes: dict[str, Callable[[], object]] = {}
        self.changed = asyncio.Event()
        # What a (re)connection calls for the notifications it may have missed, instead of waking
        # every route: the database's idle probe (dispatch/probe.py), which claims only the
        # outboxes with work. Waking 500 routes put 500 empty claims ahead of every notified
        # outbox at a fleet's start.
        self.missed: Callable[[], object] | None = None

    def set(self, routes: Mapping[str, Callable[[], object]]) -> None:
        if routes.keys() != self.routes.keys():
            self.changed.set()
        self.routes = dict(routes)

    def wake(self, _conn: object, _pid: int, channel: str, _payload: object) -> None:
        if (route := self.routes.get(channel)) is not None:
            route()

    def wake_all(self) -> None:
        if self.missed is not None:
            self.missed()
            return
        for route in list(self.routes.values()):
            route()


async def listen_channels(dsn: str, settings: Settings, channels: Channels) -> None:
    """Forever: hold one LISTEN connection to a source database, on every channel of
    `channels`, reconnecting with backoff; each notification wakes its outbox. One warning per
    outage (the registry says why the database is away), not one per attempt."""
    pause = 0.5
    warned = False
    while True:
        conn: db.Connection | None = None
        try:
            conn = await db.connect(dsn, settings, "OUTBOX_SOURCES")
            pause, warned = 0.5, False
            lost = asyncio.Event()
            conn.add_termination_listener(_setter(lost))
            await _follow_channels(conn, channels, lost)
            log.warning("listen_connection_lost", database=channels.database)
        except _SOURCE_UNAVAILABLE as exc:
            (log.debug if warned else log.warning)(
                "listen_unavailable", database=channels.database, error=repr(exc), retry_in=pause
            )
            warned = True
        finally:
            if conn is not None and not conn.is_closed():
                conn.terminate()
        await asyncio.sleep(pause)
        pause = min(pause * 2, 10.0)


async def _follow_channels(conn: db.Connection, channels: Channels, lost: asyncio.Event) -> None:
    """Listen to the channels as they change until the connection is lost (pinged every
    PING_SECONDS: a silently dropped connection is only noticed by using it)."""
    listening: set[str] = set()
    first = True
    while not lost.is_set():
        channels.changed.clear()
        wanted = set(channels.routes)
        for channel in sorted(wanted - listening):
            await conn.add_listener(channel, channels.wake)
        for channel in sorted(listening - wanted):
            await conn.remove_listener(channel, channels.wake)
        if wanted != listening or first:
            log.info("listening", database=channels.database, channels=len(wanted))
        listening = wanted
        if first:
            channels.wake_all()  # rows may have arrived while nobody listened
            first = False
        changed = asyncio.ensure_future(channels.changed.wait())
        gone = asyncio.ensure_future(lost.wait())
        try:
            done, _ = await asyncio.wait(
                {changed, gone}, timeout=PING_SECONDS, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            changed.cancel()
            gone.cancel()
        if not done:
            await asyncio.wait_for(conn.execute("SELECT 1"), PING_SECONDS)
