"""LISTEN/NOTIFY as a wake-up hint: new rows go out within milliseconds, and an idle dispatcher
only polls at poll_interval. Losing the connection loses nothing; polling covers the gap."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import asyncpg
import structlog

from outbox_dispatcher import db, errors
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.store import DispatchStore

log = structlog.get_logger(__name__)

PING_SECONDS = 15.0
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    errors.OutboxDispatcherError,
    *db.CONNECTION_ERRORS,
)


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
        conn: asyncpg.Connection | None = None
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


class Waiting:
    """Tells writers' trigger that this dispatcher waits for a wake-up, so that writers pay for
    a notification only while someone listens for it. Best effort: a lost announcement only
    means the next poll finds the rows."""

    def __init__(self, store: DispatchStore, owner: str, ttl: float) -> None:
        self._store = store
        self._owner = owner
        self._ttl = ttl
        self._until = 0.0  # this process's clock; 0: not announced

    async def announce(self) -> bool:
        """Announce (or refresh) the wait; True if it was not announced a moment ago, so that the
        caller claims once more (rows committed before the announcement sent no notification)."""
        now = asyncio.get_running_loop().time()
        if now < self._until - self._ttl / 2:
            return False
        try:
            await self._store.waiting_announce(owner=self._owner, seconds=self._ttl)
        except db.RETRIABLE_ERRORS as exc:
            log.debug("waiting_announce_failed", error=repr(exc))
            return False
        fresh = now >= self._until
        self._until = now + self._ttl
        return fresh

    async def withdraw(self) -> None:
        """Busy again: writers can stop notifying (a no-op when nothing was announced)."""
        if not self._until:
            return
        self._until = 0.0
        try:
            await self._store.waiting_withdraw(owner=self._owner)
        except db.RETRIABLE_ERRORS as exc:
            log.debug("waiting_withdraw_failed", error=repr(exc))
