"""The databases of a process serving many outboxes (OUTBOX_SOURCES): one pool per database,
created when its first outbox is served, and one LISTEN connection per database on the
channels of its served outboxes, all within OUTBOX_MAX_CONNECTIONS.

The budget is split, not shared: one connection for the fleet's membership (the home
database), and each database gets its discovery connection (the source registry's), the idle
probe's (dispatch/probe.py: its statements stay prepared there), its LISTEN connection, and a
pool of at most `pool_size_of` connections, so the
process never holds more than the budget, whatever the number of outboxes (an outbox borrows a
connection per statement and holds none while idle)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import structlog

from outbox_dispatcher import errors
from outbox_dispatcher.config.outboxes import Source
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.store import db, listen

log = structlog.get_logger(__name__)


# The fleet membership's connection to the home database (sources/fleet.py).
HOME = 1


def fixed_per_database(settings: Settings) -> int:
    """Connections a database costs besides its pool: discovery's, the idle probe's, and
    LISTEN's."""
    return 2 + int(settings.listen)


def pool_size_of(settings: Settings, databases: int) -> int:
    """The most connections of each database's pool under OUTBOX_MAX_CONNECTIONS (0: each pool
    is OUTBOX_POOL_SIZE, claim_tasks + 2 by default)."""
    fixed = fixed_per_database(settings)
    if settings.max_connections == 0:
        return settings.effective_pool_size
    share = (settings.max_connections - HOME) // max(1, databases) - fixed
    if share < 1:
        least = (fixed + 1) * databases + HOME
        msg = (
            f"OUTBOX_MAX_CONNECTIONS={settings.max_connections} is too few for the "
            f"{databases} database(s) of OUTBOX_SOURCES: each needs {fixed} connection(s) for "
            f"discovery, the idle probe{' and LISTEN' if settings.listen else ''} and at least "
            "one pooled, and "
            f"the fleet's membership takes one: set it to {least} or more (or 0: claim_tasks + "
            f"{fixed + 2} per database, and one)"
        )
        raise errors.ConfigurationError(msg)
    return min(share, settings.effective_pool_size)


class Databases:
    """Pools and LISTEN channels by database (named by hosts, ports and name, never its URL)."""

    def __init__(self, settings: Settings, sources: Sequence[Source]) -> None:
        self._settings = settings
        self._urls = {s.database: s.database_url.get_secret_value() for s in sources}
        self.pool_size = pool_size_of(settings, len(self._urls))
        self._pools: dict[str, db.Pool] = {}
        self._creating = asyncio.Lock()
        self.channels = {name: listen.Channels(name) for name in self._urls}

    def url(self, database: str) -> str:
        return self._urls[database]

    async def pool(self, database: str) -> db.Pool:
        """The database's pool, made at its first use: its sessions checked once (read
        committed), then no connection held until a statement needs one."""
        async with self._creating:
            if (pool := self._pools.get(database)) is not None:
                return pool
            pool = await db.create_pool(
                self._settings,
                url=self._urls[database],
                max_size=self.pool_size,
                setting="OUTBOX_SOURCES",
            )
            try:
                async with pool.acquire() as conn:
                    await db.require_read_committed(conn)
            except BaseException:
                await pool.close()
                raise
            log.info("database_pool_created", database=database, max_size=self.pool_size)
            self._pools[database] = pool
            return pool

    async def close(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            try:
                await asyncio.wait_for(pool.close(), 10)
            except db.CONNECTION_ERRORS:  # TimeoutError among them
                pool.terminate()
